#include "backends/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "common/trace.h"

namespace kvasync {
namespace {

using namespace kvasync::cuda;

constexpr auto kFencePollMax = std::chrono::microseconds(500);
// Upkeep waits until maps and unmaps have been quiet this long: a map followed soon by an unmap
// gets its handles back from the unmap (no create, no release).
constexpr auto kHandleGrace = std::chrono::milliseconds(5);

// Note [Memory headroom]
// ~~~~~~~~~~~~~~~~~~~~~~
// cuMemGetInfo costs ~8 us, a sixth of a cold map's driver time: a map must not pay it each time.
// The backend keeps the last reading and adds what it created since (its releases are not
// subtracted: the estimate only errs towards less headroom). A map uses a reading up to
// kMemoryInfoMaxAge old, and the mapper's upkeep reads it again once maps and unmaps have been
// quiet for kMemoryInfoQuiet (not at once: the next job of a burst would wait behind it). A map
// that follows another (a burst, a trim then an alloc) or a quiet spell pays no cuMemGetInfo;
// one in a long busy stretch reads it at most every kMemoryInfoMaxAge. What other processes
// allocated since the reading is not seen: the guard can be late by at most that age (the
// driver still refuses what does not fit). A refusal is always confirmed by a fresh reading.
constexpr auto kMemoryInfoMaxAge = std::chrono::milliseconds(20);
constexpr auto kMemoryInfoQuiet = std::chrono::milliseconds(2);

const CudaDriver& checked_driver() {
  const CudaDriver& driver = CudaDriver::get();
  if (!driver.ok()) throw BackendError(driver.problem);
  return driver;
}

std::string mib(int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// Live backends by the base of their range 0, so that Python can find the device of a backend
// even when it is wrapped (FaultBackend forwards range_base but hides the CudaBackend).
std::mutex registry_mutex;
std::map<uintptr_t, int>& registry() {
  static std::map<uintptr_t, int> backends;
  return backends;
}

// Process-wide fence recorders, one per device: the primary context and a private stream.
struct FenceRecorder {
  explicit FenceRecorder(int device) : context(device), stream(context) {}
  PrimaryContext context;
  Stream stream;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// RAII driver resources

PrimaryContext::PrimaryContext(int device) : device_(device) {
  const std::string problem = device_problem(device);
  if (!problem.empty()) throw BackendError(problem);
  const CudaDriver& driver = checked_driver();
  CUresult result = driver.cuDeviceGet(&handle_, device);
  if (result == CUDA_SUCCESS) result = driver.cuDevicePrimaryCtxRetain(&context_, handle_);
  if (result != CUDA_SUCCESS) {
    throw BackendError(driver.failure(result, "retaining the primary context of device " +
                                                  std::to_string(device)));
  }
}

PrimaryContext::~PrimaryContext() { CudaDriver::get().cuDevicePrimaryCtxRelease(handle_); }

CUresult PrimaryContext::make_current() const {
  return CudaDriver::get().cuCtxSetCurrent(context_);
}

ScopedContext::ScopedContext(const PrimaryContext& context) {
  const CudaDriver& driver = CudaDriver::get();
  if (driver.cuCtxGetCurrent(&previous_) != CUDA_SUCCESS) previous_ = nullptr;
  status_ = context.make_current();
}

ScopedContext::~ScopedContext() {
  if (previous_ != nullptr) CudaDriver::get().cuCtxSetCurrent(previous_);
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  // Note [Graph capture beside the mapper].
  previous_ = cuda::CU_STREAM_CAPTURE_MODE_RELAXED;
  exchanged_ = CudaDriver::get().cuThreadExchangeStreamCaptureMode(&previous_) == CUDA_SUCCESS;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (exchanged_) CudaDriver::get().cuThreadExchangeStreamCaptureMode(&previous_);
}

AddressReservation::AddressReservation(size_t bytes, size_t alignment) : bytes_(bytes) {
  const CudaDriver& driver = checked_driver();
  const CUresult result = driver.cuMemAddressReserve(&base_, bytes, alignment, 0, 0);
  if (result != CUDA_SUCCESS) {
    throw BackendError(driver.failure(result, "cuMemAddressReserve of " + mib(bytes)));
  }
}

AddressReservation::~AddressReservation() { CudaDriver::get().cuMemAddressFree(base_, bytes_); }

std::unique_ptr<PhysicalPage> PhysicalPage::create(const CUmemAllocationProp& prop,
                                                   size_t handle_bytes, int num_handles,
                                                   std::string& error) {
  const CudaDriver& driver = CudaDriver::get();
  std::unique_ptr<PhysicalPage> page(new PhysicalPage());
  page->handles_.reserve(num_handles);
  for (int i = 0; i < num_handles; ++i) {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult result = driver.cuMemCreate(&handle, handle_bytes, &prop, 0);
    if (result != CUDA_SUCCESS) {
      error = driver.failure(result, "cuMemCreate of " + mib(handle_bytes));
      return nullptr;  // the handles made so far are released by ~PhysicalPage
    }
    page->handles_.push_back(handle);
  }
  return page;
}

PhysicalPage::~PhysicalPage() {
  for (CUmemGenericAllocationHandle handle : handles_) CudaDriver::get().cuMemRelease(handle);
}

Stream::Stream(const PrimaryContext& context) {
  ScopedContext current(context);
  const CudaDriver& driver = CudaDriver::get();
  const CUresult result = driver.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
  if (result != CUDA_SUCCESS) throw BackendError(driver.failure(result, "cuStreamCreate"));
}

Stream::~Stream() { CudaDriver::get().cuStreamDestroy(stream_); }

// ---------------------------------------------------------------------------------------------
// CudaBackend

CudaBackend::CudaBackend(int device, int num_ranges, int64_t num_pages, int64_t page_size,
                         int64_t spare_pages, double gpu_utilization)
    : driver_(checked_driver()),
      context_(device),
      num_ranges_(num_ranges),
      num_pages_(num_pages),
      page_size_(page_size),
      gpu_utilization_(gpu_utilization),
      spare_capacity_(std::max<int64_t>(0, spare_pages)) {
  if (num_ranges <= 0 || num_pages <= 0) throw std::invalid_argument("cuda backend: empty range");
  if (!(gpu_utilization > 0.0 && gpu_utilization <= 1.0)) {
    throw std::invalid_argument("cuda backend: gpu_utilization must be in (0, 1]");
  }
  ScopedContext current(context_);
  if (current.status() != CUDA_SUCCESS) {
    throw BackendError(driver_.failure(current.status(), "cuCtxSetCurrent"));
  }
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop_.location = {CU_MEM_LOCATION_TYPE_DEVICE, device};
  access_.location = prop_.location;
  access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  granularity_ = device_granularity(device);
  if (page_size <= 0 || page_size % granularity_ != 0) {
    throw std::invalid_argument("cuda backend: page_size " + std::to_string(page_size) +
                                " must be a positive multiple of device " +
                                std::to_string(device) + "'s allocation granularity " +
                                std::to_string(granularity_) + " bytes");
  }
  for (int r = 0; r < num_ranges; ++r) {
    ranges_.push_back(std::make_unique<AddressReservation>(
        static_cast<size_t>(num_pages * page_size), static_cast<size_t>(granularity_)));
  }
  mapped_.resize(num_pages);
  retired_.assign(num_pages, false);
  probe_driver();
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry()[range_base(0)] = device;
  }
}

CudaBackend::~CudaBackend() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().erase(range_base(0));
  }
  ScopedContext current(context_);
  for (int64_t page = 0; page < num_pages_; ++page) {
    if (mapped_[page] || retired_[page]) {
      for (int r = 0; r < num_ranges_; ++r) driver_.cuMemUnmap(address(r, page), page_size_);
    }
  }
  mapped_.clear();  // releases the handles (cuMemRelease) ...
  scratch_.reset();
  spare_.clear();
  to_release_.clear();
  ranges_.clear();  // ... before the reservations are freed
}

uintptr_t CudaBackend::range_base(int range) const {
  return static_cast<uintptr_t>(ranges_.at(range)->base());
}

int64_t CudaBackend::device_granularity(int device) {
  const CudaDriver& driver = checked_driver();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, device};
  size_t granularity = 0;
  const CUresult result =
      driver.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (result != CUDA_SUCCESS || granularity == 0) {
    throw BackendError(driver.failure(result, "cuMemGetAllocationGranularity"));
  }
  return static_cast<int64_t>(granularity);
}

int CudaBackend::device_of_range(uintptr_t base) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = registry().find(base);
  return found == registry().end() ? -1 : found->second;
}

void CudaBackend::probe_driver() {
  // Two questions the documentation leaves open, answered once on a scratch range of 2 pages:
  // does cuMemMap take a non-zero offset into a handle, and does cuMemUnmap take a range that
  // spans several mappings? Either "no" selects the slower, always-valid path.
  const size_t page = static_cast<size_t>(page_size_);
  AddressReservation scratch(2 * page, static_cast<size_t>(granularity_));
  std::string error;
  if (num_ranges_ > 1) {
    auto wide = PhysicalPage::create(prop_, 2 * page, 1, error);
    if (!wide) throw BackendError(error + " (probing the driver)");
    offset_mapping_ = driver_.cuMemMap(scratch.base(), page, page, wide->handle(0), 0) == CUDA_SUCCESS;
    if (offset_mapping_) driver_.cuMemUnmap(scratch.base(), page);
  }
  auto a = PhysicalPage::create(prop_, page, 1, error);
  auto b = a ? PhysicalPage::create(prop_, page, 1, error) : nullptr;
  if (!b) throw BackendError(error + " (probing the driver)");
  const bool mapped_a = driver_.cuMemMap(scratch.base(), page, 0, a->handle(0), 0) == CUDA_SUCCESS;
  const bool mapped_b =
      driver_.cuMemMap(scratch.base() + page, page, 0, b->handle(0), 0) == CUDA_SUCCESS;
  run_unmap_ = mapped_a && mapped_b &&
               driver_.cuMemUnmap(scratch.base(), 2 * page) == CUDA_SUCCESS;
  if (!run_unmap_) {
    if (mapped_a) driver_.cuMemUnmap(scratch.base(), page);
    if (mapped_b) driver_.cuMemUnmap(scratch.base() + page, page);
  }
}

CUresult CudaBackend::refresh_memory_info() {
  size_t free_bytes = 0, total_bytes = 0;
  const CUresult result = driver_.cuMemGetInfo(&free_bytes, &total_bytes);
  if (result != CUDA_SUCCESS) return result;
  info_total_ = static_cast<int64_t>(total_bytes);
  info_used_ = info_total_ - static_cast<int64_t>(free_bytes);
  created_since_info_ = 0;
  info_time_ = std::chrono::steady_clock::now();
  ++memory_info_reads_;
  return CUDA_SUCCESS;
}

BackendResult CudaBackend::headroom_check(int64_t pages) {
  const int64_t want = pages * page_size_ * num_ranges_;
  // Signed on purpose: a device already above the ceiling has a negative headroom, i.e. none.
  auto headroom = [&] {
    const int64_t ceiling =
        static_cast<int64_t>(gpu_utilization_ * static_cast<double>(info_total_));
    return ceiling - (info_used_ + created_since_info_);
  };
  // Note [Memory headroom]: a recent reading, and a fresh one before saying no.
  bool fresh = false;
  if (info_total_ == 0 || std::chrono::steady_clock::now() - info_time_ > kMemoryInfoMaxAge) {
    const CUresult result = refresh_memory_info();
    if (result != CUDA_SUCCESS) return BackendResult::failure(driver_.failure(result, "cuMemGetInfo"));
    fresh = true;
  }
  if (want > headroom() && !fresh) {
    const CUresult result = refresh_memory_info();
    if (result != CUDA_SUCCESS) return BackendResult::failure(driver_.failure(result, "cuMemGetInfo"));
  }
  const int64_t room = headroom();
  if (want <= room) {
    created_since_info_ += want;  // counted now: the caller creates it next
    return BackendResult::success();
  }
  return BackendResult::failure(
      "CUDA_ERROR_OUT_OF_MEMORY: creating " + std::to_string(pages) + " page(s) (" + mib(want) +
      ") would exceed gpu_utilization " + std::to_string(gpu_utilization_) + " of " +
      mib(info_total_) + " on device " + std::to_string(device()) + " (" +
      mib(info_used_ + created_since_info_) + " in use, headroom " +
      (room > 0 ? mib(room) : "none") + ")");
}

BackendResult CudaBackend::take_pages(int64_t count,
                                      std::vector<std::unique_ptr<PhysicalPage>>& out) {
  int64_t from_pool = 0;
  {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    while (static_cast<int64_t>(out.size()) < count && !spare_.empty()) {
      out.push_back(std::move(spare_.back()));
      spare_.pop_back();
    }
    from_pool = static_cast<int64_t>(out.size());
    taken_from_pool_ += from_pool;
    last_activity_ = std::chrono::steady_clock::now();
    // Create ahead of the next need what this map consumed (Note [CUDA backend]).
    ahead_ = std::min(ahead_ + count, spare_capacity_ - static_cast<int64_t>(spare_.size()));
  }
  const int64_t cold = count - from_pool;
  if (cold == 0) {
    trace::mark(trace::kCreated);
    return BackendResult::success();
  }
  BackendResult room = headroom_check(cold);
  trace::mark(trace::kHeadroomDone);
  const int handles = offset_mapping_ ? 1 : num_ranges_;
  const size_t bytes = static_cast<size_t>(page_size_) * (offset_mapping_ ? num_ranges_ : 1);
  for (int64_t i = 0; room.ok && i < cold; ++i) {
    std::string error;
    auto page = PhysicalPage::create(prop_, bytes, handles, error);
    if (!page) room = BackendResult::failure(error);
    else out.push_back(std::move(page));
  }
  trace::mark(trace::kCreated);
  std::lock_guard<std::mutex> lock(spare_mutex_);
  created_on_map_ += static_cast<int64_t>(out.size()) - from_pool;
  created_ += static_cast<int64_t>(out.size()) - from_pool;
  return room;
}

void CudaBackend::give_back(std::vector<std::unique_ptr<PhysicalPage>> pages) {
  bool surplus = false;
  {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    for (auto& page : pages) {
      if (static_cast<int64_t>(spare_.size()) < spare_capacity_) {
        spare_.push_back(std::move(page));
      } else {
        to_release_.push_back(std::move(page));  // released by upkeep, off the job's path
        surplus = true;
      }
    }
    ahead_ = std::min(ahead_, spare_capacity_ - static_cast<int64_t>(spare_.size()));
    last_activity_ = std::chrono::steady_clock::now();
  }
  if (surplus && spare_capacity_ == 0) {  // no pool at all: release here, without the lock
    std::vector<std::unique_ptr<PhysicalPage>> surplus_pages;
    {
      std::lock_guard<std::mutex> lock(spare_mutex_);
      surplus_pages.swap(to_release_);
      released_ += static_cast<int64_t>(surplus_pages.size());
    }
    surplus_pages.clear();
  }  // else: upkeep releases the surplus once maps and unmaps are quiet
}

BackendResult CudaBackend::map_page(int range, int64_t page, const PhysicalPage& memory) {
  const CUmemGenericAllocationHandle handle = memory.handle(offset_mapping_ ? 0 : range);
  const size_t offset = offset_mapping_ ? static_cast<size_t>(range) * page_size_ : 0;
  const CUresult result = driver_.cuMemMap(address(range, page), page_size_, offset, handle, 0);
  if (result == CUDA_SUCCESS) return BackendResult::success();
  return BackendResult::failure(driver_.failure(
      result, "cuMemMap of page " + std::to_string(page) + " in range " + std::to_string(range)));
}

BackendResult CudaBackend::map(int64_t first, int64_t count) {
  if (first < 0 || count <= 0 || first + count > num_pages_) {
    return BackendResult::failure("CUDA_ERROR_INVALID_VALUE: pages out of range");
  }
  for (int64_t page = first; page < first + count; ++page) {
    if (mapped_[page] || retired_[page]) {
      return BackendResult::failure("CUDA_ERROR_INVALID_VALUE: page " + std::to_string(page) +
                                    (mapped_[page] ? " is already mapped"
                                                   : " was retired by the allocator's close"));
    }
  }
  const RelaxedCaptureMode relaxed;  // Note [Graph capture beside the mapper]
  const CUresult current = context_.make_current();
  if (current != CUDA_SUCCESS) return BackendResult::failure(driver_.failure(current, "cuCtxSetCurrent"));
  std::vector<std::unique_ptr<PhysicalPage>> memory;
  memory.reserve(count);
  BackendResult result = take_pages(count, memory);
  int range = 0;
  int64_t done_in_range = 0;  // pages of `range` mapped so far
  for (; result.ok && range < num_ranges_; ++range) {
    for (done_in_range = 0; result.ok && done_in_range < count; ++done_in_range) {
      result = map_page(range, first + done_in_range, *memory[done_in_range]);
      if (!result.ok) break;
    }
    if (!result.ok) break;
    if (range == 0) trace::mark(trace::kMapped);
    // One access call for the whole run in this range (Note [CUDA backend]: batching).
    const CUresult access = driver_.cuMemSetAccess(address(range, first), count * page_size_, &access_, 1);
    if (access != CUDA_SUCCESS) {
      result = BackendResult::failure(driver_.failure(
          access, "cuMemSetAccess of " + std::to_string(count) + " page(s) in range " +
                      std::to_string(range)));
      break;
    }
  }
  if (!result.ok) {  // all or nothing: undo every mapping of this call
    for (int r = 0; r <= std::min(range, num_ranges_ - 1); ++r) {
      const int64_t mapped = r < range ? count : done_in_range;
      for (int64_t i = 0; i < mapped; ++i) driver_.cuMemUnmap(address(r, first + i), page_size_);
    }
    give_back(std::move(memory));
    return result;
  }
  for (int64_t i = 0; i < count; ++i) mapped_[first + i] = std::move(memory[i]);
  trace::mark(trace::kAccessDone);
  return result;
}

BackendResult CudaBackend::unmap_run(int range, int64_t first, int64_t count) {
  if (run_unmap_ && count > 1 &&
      driver_.cuMemUnmap(address(range, first), count * page_size_) == CUDA_SUCCESS) {
    return BackendResult::success();
  }
  BackendResult first_error;
  for (int64_t page = first; page < first + count; ++page) {
    const CUresult result = driver_.cuMemUnmap(address(range, page), page_size_);
    if (result != CUDA_SUCCESS && first_error.ok) {
      first_error = BackendResult::failure(driver_.failure(
          result, "cuMemUnmap of page " + std::to_string(page) + " in range " +
                      std::to_string(range)));
    }
  }
  return first_error;
}

BackendResult CudaBackend::unmap(int64_t first, int64_t count) {
  if (first < 0 || count <= 0 || first + count > num_pages_) {
    return BackendResult::failure("CUDA_ERROR_INVALID_VALUE: pages out of range");
  }
  const RelaxedCaptureMode relaxed;  // Note [Graph capture beside the mapper]
  const CUresult current = context_.make_current();
  if (current != CUDA_SUCCESS) return BackendResult::failure(driver_.failure(current, "cuCtxSetCurrent"));
  if (sync_before_unmap_) {  // never change a mapping under running GPU work (DESIGN.md, 6)
    // Note [Bounded device sync]: every stream's work, waited for with a deadline.
    if (!syncer_) syncer_ = std::make_unique<DeviceSyncer>(context_.device());
    const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(unmap_sync_timeout_s_));
    BackendResult synced = syncer_->sync(std::chrono::steady_clock::now() + timeout);
    if (!synced.ok) return synced;
  }
  BackendResult first_error;
  std::vector<std::unique_ptr<PhysicalPage>> freed;
  int64_t page = first;
  while (page < first + count) {  // sub-runs of pages this backend really has mapped
    if (!mapped_[page]) {
      ++page;
      continue;
    }
    int64_t end = page + 1;
    while (end < first + count && mapped_[end]) ++end;
    bool ok = true;
    for (int r = 0; r < num_ranges_; ++r) {
      BackendResult result = unmap_run(r, page, end - page);
      if (!result.ok) {
        ok = false;
        if (first_error.ok) first_error = result;  // keep going: free what we can
      }
    }
    // NOTE: after a failed unmap the page may still be mapped somewhere: keep its memory.
    if (ok) {
      for (int64_t p = page; p < end; ++p) freed.push_back(std::move(mapped_[p]));
    }
    page = end;
  }
  give_back(std::move(freed));
  return first_error;
}

BackendResult CudaBackend::retire(int64_t first, int64_t count,
                                  std::chrono::steady_clock::time_point deadline) {
  if (first < 0 || count <= 0 || first + count > num_pages_) {
    return BackendResult::failure("CUDA_ERROR_INVALID_VALUE: pages out of range");
  }
  const CUresult current = context_.make_current();
  if (current != CUDA_SUCCESS) return BackendResult::failure(driver_.failure(current, "cuCtxSetCurrent"));
  // Note [Views outlive close]: a kernel launched before the close may still use pages that were
  // in use, and no fence says so: wait for all of this process's work on the device, bounded
  // (Note [Bounded device sync]). Past the deadline nothing changes: the pages keep their memory.
  try {
    if (!syncer_) syncer_ = std::make_unique<DeviceSyncer>(context_.device());
  } catch (const std::exception& e) {
    return BackendResult::failure(std::string(e.what()) + " (retiring pages at close)");
  }
  BackendResult synced = syncer_->sync(deadline);
  if (!synced.ok) return synced;
  BackendResult first_error;
  std::vector<std::unique_ptr<PhysicalPage>> freed;
  for (int64_t page = first; page < first + count; ++page) {
    if (!mapped_[page]) continue;
    if (!scratch_) {  // the first page retired keeps its memory: the scratch from now on
      scratch_ = std::move(mapped_[page]);
      retired_[page] = true;
      continue;
    }
    BackendResult result = retire_page(page);
    if (result.ok) freed.push_back(std::move(mapped_[page]));
    else if (first_error.ok) first_error = result;  // keep going: give back what we can
  }
  {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    released_ += static_cast<int64_t>(freed.size());
  }
  freed.clear();    // cuMemRelease now, not into the handle pool: the allocator is closing
  release_spare();  // and the pool's spares with them: the backend may outlive the close
  return first_error;
}

BackendResult CudaBackend::retire_page(int64_t page) {
  // Range by range: the page's own memory out, the scratch page's in, its access set. A step that
  // fails puts the page's own memory back in that range, so that no address is ever left
  // unmapped; the page then keeps its memory until the backend is destroyed.
  const PhysicalPage& own = *mapped_[page];
  retired_[page] = true;  // from the first range switched on: ~CudaBackend unmaps every range
  auto mapped_with = [&](int r, const PhysicalPage& memory) {
    BackendResult result = map_page(r, page, memory);
    if (!result.ok) return result;
    const CUresult access = driver_.cuMemSetAccess(address(r, page), page_size_, &access_, 1);
    if (access == CUDA_SUCCESS) return result;
    driver_.cuMemUnmap(address(r, page), page_size_);
    return BackendResult::failure(driver_.failure(access, "cuMemSetAccess"));
  };
  for (int r = 0; r < num_ranges_; ++r) {
    const std::string where = " retiring page " + std::to_string(page) + " in range " +
                              std::to_string(r) + "; the page keeps its memory";
    const CUresult unmapped = driver_.cuMemUnmap(address(r, page), page_size_);
    if (unmapped != CUDA_SUCCESS) {
      return BackendResult::failure(driver_.failure(unmapped, "cuMemUnmap" + where));
    }
    BackendResult scratch = mapped_with(r, *scratch_);
    if (!scratch.ok) {
      const bool back = mapped_with(r, own).ok;  // the address must not stay unmapped
      return BackendResult::failure(
          scratch.error + " (mapping the scratch page)" + where +
          (back ? "" : "; restoring it failed too: that address is left unmapped"));
    }
  }
  return BackendResult::success();
}

BackendResult CudaBackend::wait_fence(uintptr_t fence,
                                      std::chrono::steady_clock::time_point deadline) {
  context_.make_current();
  auto event = reinterpret_cast<CUevent>(fence);
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    const CUresult result = driver_.cuEventQuery(event);
    if (result == CUDA_SUCCESS) return BackendResult::success();
    if (result != CUDA_ERROR_NOT_READY) {
      return BackendResult::failure(driver_.failure(result, "cuEventQuery of a free(after=) fence"));
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return BackendResult::failure(
          "CUDA_ERROR_NOT_READY: device work using the pages (free(after=...)) was not done by the "
          "unmap's deadline; the pages stay mapped");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min<std::chrono::microseconds>(pause * 2, kFencePollMax);
  }
}

void CudaBackend::release_fence(uintptr_t fence) {
  driver_.cuEventDestroy(reinterpret_cast<CUevent>(fence));
}

uintptr_t CudaBackend::record_fence(int device, uintptr_t stream, uintptr_t after_event) {
  static std::mutex recorders_mutex;
  static std::map<int, std::unique_ptr<FenceRecorder>>* recorders =
      new std::map<int, std::unique_ptr<FenceRecorder>>();  // leaked: outlives every caller
  FenceRecorder* recorder;
  {
    std::lock_guard<std::mutex> lock(recorders_mutex);
    auto& slot = (*recorders)[device];
    if (!slot) slot = std::make_unique<FenceRecorder>(device);
    recorder = slot.get();
  }
  const CudaDriver& driver = checked_driver();
  ScopedContext current(recorder->context);
  CUevent event = nullptr;
  CUresult result = driver.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING);
  if (result != CUDA_SUCCESS) throw BackendError(driver.failure(result, "cuEventCreate"));
  CUstream target = reinterpret_cast<CUstream>(stream);
  if (after_event != 0) {
    target = recorder->stream.get();
    result = driver.cuStreamWaitEvent(target, reinterpret_cast<CUevent>(after_event), 0);
  }
  if (result == CUDA_SUCCESS) result = driver.cuEventRecord(event, target);
  if (result != CUDA_SUCCESS) {
    driver.cuEventDestroy(event);
    throw BackendError(driver.failure(result, "recording the free(after=) fence"));
  }
  return reinterpret_cast<uintptr_t>(event);
}

// ---------------------------------------------------------------------------------------------
// Upkeep, on the mapper thread between jobs: spares created ahead of need, the surplus released.

double CudaBackend::upkeep() {
  std::unique_lock<std::mutex> lock(spare_mutex_);
  const auto quiet = std::chrono::steady_clock::now() - last_activity_;
  // Note [Memory headroom]: read again once maps and unmaps have been quiet for a moment.
  const bool stale = last_activity_ > info_time_ && info_total_ != 0;
  if (stale && quiet >= kMemoryInfoQuiet) {
    lock.unlock();
    const RelaxedCaptureMode relaxed;  // Note [Graph capture beside the mapper]
    ScopedContext current(context_);
    refresh_memory_info();
    return 0;
  }
  const double refresh_in =
      stale ? std::chrono::duration<double>(kMemoryInfoQuiet - quiet).count() : kNoUpkeep;
  const bool work = !to_release_.empty() ||
                    (ahead_ > 0 && static_cast<int64_t>(spare_.size()) < spare_capacity_);
  if (!work) return refresh_in;
  if (quiet < kHandleGrace) {
    return std::min(refresh_in, std::chrono::duration<double>(kHandleGrace - quiet).count());
  }
  if (!to_release_.empty()) {
    std::unique_ptr<PhysicalPage> surplus = std::move(to_release_.back());
    to_release_.pop_back();
    ++released_;
    lock.unlock();
    const RelaxedCaptureMode relaxed;  // Note [Graph capture beside the mapper]
    ScopedContext current(context_);
    surplus.reset();  // cuMemRelease, without the lock
    return 0;
  }
  --ahead_;
  lock.unlock();
  const RelaxedCaptureMode relaxed;  // Note [Graph capture beside the mapper]
  ScopedContext current(context_);
  std::string error;
  std::unique_ptr<PhysicalPage> page;
  if (headroom_check(1).ok) {
    const size_t bytes = static_cast<size_t>(page_size_) * (offset_mapping_ ? num_ranges_ : 1);
    page = PhysicalPage::create(prop_, bytes, offset_mapping_ ? 1 : num_ranges_, error);
  }
  lock.lock();
  if (!page) {
    ahead_ = 0;  // no room or the driver refused: stop until the next map asks again
    return kNoUpkeep;
  }
  ++created_;
  if (static_cast<int64_t>(spare_.size()) < spare_capacity_) spare_.push_back(std::move(page));
  else to_release_.push_back(std::move(page));
  return 0;
}

bool CudaBackend::settle(double timeout_s) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < give_up) {
    const double again = upkeep();
    if (again >= kNoUpkeep) return true;
    if (again > 0) std::this_thread::sleep_for(std::chrono::duration<double>(again));
  }
  return false;
}

HandlePoolStats CudaBackend::handle_stats() const {
  std::lock_guard<std::mutex> lock(spare_mutex_);
  return {static_cast<int64_t>(spare_.size()), spare_capacity_, created_, released_,
          taken_from_pool_, created_on_map_, memory_info_reads_.load(), offset_mapping_, run_unmap_};
}

void CudaBackend::release_spare() {
  std::vector<std::unique_ptr<PhysicalPage>> spares;
  {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    ahead_ = 0;
    spares.swap(spare_);
    released_ += static_cast<int64_t>(spares.size());
  }
  ScopedContext current(context_);
  spares.clear();  // cuMemRelease on the caller's thread, without the lock
}


}  // namespace kvasync
