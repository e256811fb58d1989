// CUDA backend: physical handles mapped into reserved device ranges (CUDA virtual memory).
//
// Note [CUDA backend]
// ~~~~~~~~~~~~~~~~~~~
// Rationale: a KV cache that grows and shrinks page by page, at a cost close to the driver's floor
// (DESIGN.md, "Measured limits": create 8 us, map 0.6 us, set-access ~25 us per *call*, unmap
// 16 us), with every driver failure a value and never an abort().
// Approach:
//  - The driver is dlopen'ed (Note [Loading the driver] in cuda_driver.h). Everything runs in the
//    primary context of the configured device (the one PyTorch uses), retained once here and made
//    current on whichever thread calls in (the mapper thread, the destructor, a fence record).
//  - Page memory: one PhysicalPage per mapped page id. With R ranges it is one handle of
//    R * page_size bytes mapped at offset r * page_size into range r (cuMemMap's offset), so the
//    handle pool is keyed by page id, not by range. Drivers that refuse a non-zero offset (cuda.h
//    still documents "must be zero") are detected by a probe at construction; then a PhysicalPage
//    holds R handles of page_size. The contiguous layout is R = 1: one handle, one map, one access.
//  - Batching: map() maps a run of consecutive pages and calls cuMemSetAccess once per range for
//    the whole run. unmap() unmaps a run with one cuMemUnmap per range when the driver accepts a
//    range spanning several mappings (probed too), else page by page.
//  - Handle pool: unmapped PhysicalPages are kept as spares, up to `spare_pages` (the reserve's
//    high watermark), instead of being released; a map takes spares first. upkeep(), run by the
//    mapper thread between jobs, creates replacements ahead of need for the spares maps consume
//    and releases the surplus, one driver call at a time, so a map usually pays only cuMemMap +
//    cuMemSetAccess (+ cuMemUnmap). It waits until maps and unmaps have been quiet for a few ms:
//    an unmap that follows a map closely refills the pool itself. No thread of its own: nothing
//    to join at destruction, and no second thread contending for the driver.
//  - Memory headroom: every cuMemCreate (a map or upkeep) first checks that the device
//    stays at or below gpu_utilization * total, from cuMemGetInfo (a reading at most
//    kMemoryInfoMaxAge old, refreshed off the map's path: Note [Memory headroom] in the .cpp) in
//    signed int64 arithmetic: a nearly full device gives a negative headroom, i.e. none. A map that would cross it fails with
//    "CUDA_ERROR_OUT_OF_MEMORY: ... would exceed gpu_utilization ...". The backend cannot tell a
//    reserve refill from a request, so the guard applies to both (a request then gets MapError).
//  - Fences are CUevents (Note [Unmap safety] in page_pool.h): wait_fence polls cuEventQuery with
//    short sleeps until the deadline; release_fence destroys the event. No device-wide sync.
//  - Close: retire() (Note [Views outlive close] in backend.h) waits for the device's work with a
//    deadline (Note [Bounded device sync]), then keeps the first retired page's memory as scratch
//    and maps it in place of every other page mapped at close, so that a torch view taken before
//    close never meets an unmapped address; the rest of the memory is released at once. The
//    scratch page and those mappings go with the backend.
// Invariants:
//  - map() is all or nothing: on any failure, every cuMemMap of the call is undone and its
//    PhysicalPages go back to the pool. No driver error aborts; each is "<CUDA_ERROR_NAME>: ...".
//  - mapped_ is touched only by the mapper thread (and the destructor); the spare pool is also
//    read by Python (stats, release_spare) under spare_mutex_, never held across a driver call.
//  - Spare handles are physical memory in use on the device: at most `spare_pages` page ids of it.
//    release_spare() gives them back (and stops creating ahead until the next map).
// lock order: PagePool::mutex_ is never held here; spare_mutex_ is a leaf.
// Limitations: one device per backend; handles are not exportable (no IPC).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda_device_sync.h"
#include "backends/cuda_driver.h"

namespace kvasync {

// The device's primary context, retained for the backend's lifetime.
class PrimaryContext {
 public:
  explicit PrimaryContext(int device);  // throws BackendError
  ~PrimaryContext();
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  PrimaryContext(PrimaryContext&&) = delete;
  PrimaryContext& operator=(PrimaryContext&&) = delete;

  cuda::CUresult make_current() const;
  int device() const { return device_; }
  cuda::CUdevice handle() const { return handle_; }

 private:
  int device_;
  cuda::CUdevice handle_ = 0;
  cuda::CUcontext context_ = nullptr;
};

// Makes a context current for a scope and restores the caller's afterwards.
class ScopedContext {
 public:
  explicit ScopedContext(const PrimaryContext& context);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ScopedContext(ScopedContext&&) = delete;
  ScopedContext& operator=(ScopedContext&&) = delete;
  cuda::CUresult status() const { return status_; }

 private:
  cuda::CUcontext previous_ = nullptr;
  cuda::CUresult status_;
};

// Note [Graph capture beside the mapper]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An engine captures CUDA graphs (vLLM at start, with torch.cuda.graph, in the default global
// capture mode) while kvasync's own threads call the driver: the mapper maps, unmaps, creates and
// releases handles, and a tensor-parallel rank's sync thread calls cuCtxSynchronize before an
// unmap (Note [Bounded device sync]). Measured on an H200, driver 580.159 (2026-12-02,
// bench/probes/capture_probe.py: another thread's call in the middle of a global capture):
//  - cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease succeed and the capture
//    survives, whether the calling thread's capture mode is global or relaxed;
//  - cuCtxSynchronize fails (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates the capture,
//    in either mode: the engine's start dies.
// So: (1) syncs are gated (cuda_device_sync.h): a capture closes the gate (kvasync's wrapper of
// torch.cuda.CUDAGraph.capture_begin/_end, installed by the ranks that sync), waiting for a sync
// already in the driver; a sync asked for meanwhile fails at once, the unmap with it, and its
// pages stay mapped (a later trim unmaps them). (2) Every kvasync thread's driver calls still run
// in the relaxed capture mode for their scope (restored after: the mode is per thread, so the
// engine's own threads keep theirs), so that a driver that deems a VMM call unsafe during capture
// fails that call instead of invalidating the engine's capture.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode(RelaxedCaptureMode&&) = delete;
  RelaxedCaptureMode& operator=(RelaxedCaptureMode&&) = delete;

 private:
  int previous_ = 0;
  bool exchanged_ = false;
};

// One reserved virtual range.
class AddressReservation {
 public:
  AddressReservation(size_t bytes, size_t alignment);  // throws BackendError
  ~AddressReservation();
  AddressReservation(const AddressReservation&) = delete;
  AddressReservation& operator=(const AddressReservation&) = delete;
  AddressReservation(AddressReservation&&) = delete;
  AddressReservation& operator=(AddressReservation&&) = delete;
  cuda::CUdeviceptr base() const { return base_; }

 private:
  cuda::CUdeviceptr base_ = 0;
  size_t bytes_;
};

// The physical memory of one page id: one handle (offset mapping) or one handle per range.
class PhysicalPage {
 public:
  // Returns the page, or nullptr with `error` set ("<CUDA_ERROR_NAME>: cuMemCreate ...").
  static std::unique_ptr<PhysicalPage> create(const cuda::CUmemAllocationProp& prop,
                                              size_t handle_bytes, int num_handles,
                                              std::string& error);
  ~PhysicalPage();
  PhysicalPage(const PhysicalPage&) = delete;
  PhysicalPage& operator=(const PhysicalPage&) = delete;
  PhysicalPage(PhysicalPage&&) = delete;
  PhysicalPage& operator=(PhysicalPage&&) = delete;
  cuda::CUmemGenericAllocationHandle handle(int index) const { return handles_[index]; }

 private:
  PhysicalPage() = default;
  std::vector<cuda::CUmemGenericAllocationHandle> handles_;
};

// A non-blocking stream of the device's primary context (fences recorded after an event).
class Stream {
 public:
  explicit Stream(const PrimaryContext& context);  // throws BackendError
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&&) = delete;
  Stream& operator=(Stream&&) = delete;
  cuda::CUstream get() const { return stream_; }

 private:
  cuda::CUstream stream_ = nullptr;
};

struct HandlePoolStats {
  int64_t spare_pages, spare_capacity, created, released, taken_from_pool, created_on_map,
      memory_info_reads;
  bool offset_mapping, run_unmap;
};

class CudaBackend final : public Backend {
 public:
  // Throws std::invalid_argument (bad sizes) or BackendError (no driver, reserve failed).
  CudaBackend(int device, int num_ranges, int64_t num_pages, int64_t page_size,
              int64_t spare_pages, double gpu_utilization);
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  int64_t page_size() const override { return page_size_; }
  int num_ranges() const override { return num_ranges_; }
  int64_t num_pages() const override { return num_pages_; }
  uintptr_t range_base(int range) const override;
  const char* out_of_memory_name() const override { return "CUDA_ERROR_OUT_OF_MEMORY"; }

  BackendResult map(int64_t first, int64_t count) override;
  BackendResult unmap(int64_t first, int64_t count) override;
  BackendResult retire(int64_t first, int64_t count,
                       std::chrono::steady_clock::time_point deadline) override;
  BackendResult wait_fence(uintptr_t fence, std::chrono::steady_clock::time_point deadline) override;
  void release_fence(uintptr_t fence) override;

  int device() const { return context_.device(); }
  int64_t granularity() const { return granularity_; }
  HandlePoolStats handle_stats() const;
  // Releases every spare handle and stops creating ahead until the next map.
  void release_spare();
  void release_cached() override { release_spare(); }
  double upkeep() override;
  // Runs upkeep until nothing is left to create or release (for a backend used without a
  // pool, in tests and benchmarks). Returns false if `timeout_s` passed first.
  bool settle(double timeout_s);
  // A tensor-parallel rank's backend (vLLM's worker process): each unmap first waits for all
  // the work of this process on the device, since the scheduler that frees the blocks is in
  // another process and records no fence here; the wait has a deadline of
  // `unmap_sync_timeout` seconds, past which the unmap fails and the pages stay mapped (Note
  // [Bounded device sync] in cuda_device_sync.h). Set before the backend is used.
  void set_sync_before_unmap(bool sync) { sync_before_unmap_ = sync; }
  bool sync_before_unmap() const { return sync_before_unmap_; }
  void set_unmap_sync_timeout(double seconds) { unmap_sync_timeout_s_ = seconds; }
  double unmap_sync_timeout() const { return unmap_sync_timeout_s_; }

  // The driver's minimum allocation granularity of `device`. Throws BackendError.
  static int64_t device_granularity(int device);
  // The device of the live CudaBackend whose range 0 starts at `base`, or -1.
  static int device_of_range(uintptr_t base);
  // A new CUevent (owned by the caller, to be handed to the pool) recorded on `stream`, or, when
  // `after_event` is not 0, completing after that event (recorded on a private stream that waits
  // for it). Runs on the caller's thread; throws BackendError.
  static uintptr_t record_fence(int device, uintptr_t stream, uintptr_t after_event);

 private:
  cuda::CUdeviceptr address(int range, int64_t page) const {
    return ranges_[range]->base() + static_cast<cuda::CUdeviceptr>(page * page_size_);
  }
  void probe_driver();
  BackendResult headroom_check(int64_t pages);
  cuda::CUresult refresh_memory_info();
  BackendResult take_pages(int64_t count, std::vector<std::unique_ptr<PhysicalPage>>& out);
  void give_back(std::vector<std::unique_ptr<PhysicalPage>> pages);
  BackendResult map_page(int range, int64_t page, const PhysicalPage& memory);
  BackendResult unmap_run(int range, int64_t first, int64_t count);
  BackendResult retire_page(int64_t page);

  const cuda::CudaDriver& driver_;
  PrimaryContext context_;
  int num_ranges_;
  int64_t num_pages_;
  int64_t page_size_;
  int64_t granularity_ = 0;
  bool sync_before_unmap_ = false;
  double unmap_sync_timeout_s_ = 5.0;
  std::unique_ptr<DeviceSyncer> syncer_;  // started by the first unmap that syncs
  double gpu_utilization_;
  cuda::CUmemAllocationProp prop_{};
  cuda::CUmemAccessDesc access_{};
  bool offset_mapping_ = true;  // one handle per page id (else one per range)
  bool run_unmap_ = true;       // cuMemUnmap accepts a run of several mappings
  std::vector<std::unique_ptr<AddressReservation>> ranges_;
  std::vector<std::unique_ptr<PhysicalPage>> mapped_;  // by page id; mapper thread only
  // Note [Views outlive close]: the memory mapped in place of every retired page (the first
  // page retired keeps its own), and which pages are so mapped. Mapper thread (close) only.
  std::unique_ptr<PhysicalPage> scratch_;
  std::vector<bool> retired_;

  // Handle pool (Note above).
  const int64_t spare_capacity_;
  mutable std::mutex spare_mutex_;
  std::vector<std::unique_ptr<PhysicalPage>> spare_;
  std::vector<std::unique_ptr<PhysicalPage>> to_release_;
  int64_t ahead_ = 0;  // spares upkeep should create
  std::chrono::steady_clock::time_point last_activity_{};  // last map or unmap (kHandleGrace)
  int64_t created_ = 0, released_ = 0, taken_from_pool_ = 0, created_on_map_ = 0;

  // The device's memory as cuMemGetInfo last read it, plus what this backend created since
  // (Note [Memory headroom] in cuda_backend.cpp). Mapper thread only.
  int64_t info_used_ = 0, info_total_ = 0, created_since_info_ = 0;
  std::chrono::steady_clock::time_point info_time_{};
  std::atomic<int64_t> memory_info_reads_{0};  // read by stats from any thread
};

}  // namespace kvasync
