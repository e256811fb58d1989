// Backend: the virtual-memory driver under the page pool.
//
// Note [Backends]
// ~~~~~~~~~~~~~~~
// A backend owns `num_ranges()` reserved virtual ranges of `num_pages() * page_size()` bytes each
// (one per (layer, K/V) buffer, or a single range for the contiguous layout). Page id `p` names the
// bytes [p * page_size, (p + 1) * page_size) in *every* range: mapping page p maps it in all of
// them at once, so one page id is one unit of physical memory of `page_size * num_ranges` bytes.
//
// Invariants:
//  - map() and unmap() are called only by the mapper thread (and by close() once that thread has
//    been joined), never with the pool lock held, and never call into Python.
//  - map() is all-or-nothing: on failure no page of the call stays mapped in any range.
//  - Failures are values (BackendResult), never abort(): the error string starts with the driver's
//    error name (CUDA_ERROR_OUT_OF_MEMORY, ENOMEM, ...).
//
// Note [Views outlive close]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rationale: Python holds torch views over the ranges (Allocator.layer, the block operations),
// and each view holds the backend (range_view's capsule, the cuda DLPack tensor's deleter), so
// the reservation lives as long as any view does. A view taken before close may still be used
// after it: a model step still running when the engine shuts its cache down, a tensor kept in a
// list. If close unmapped the pages under it, reading it would kill the process (SIGSEGV on host)
// or, on a GPU, fault with an illegal address that poisons the CUDA context for good.
// Rule: close never turns an address that was mapped into an unmapped one while the backend
// lives. It gives the pages' memory back (to the OS or the driver, and to the share's budget) as
// before, but retire() puts scratch memory under each of them instead of nothing, and that
// stays until the backend is destroyed, i.e. until the allocator and the last view are gone.
// A view of the whole range touches after close exactly what it could touch at close: the pages
// mapped then read and write the scratch memory (what they read is garbage, what they write is
// lost), the pages never mapped (or unmapped before) still fault, as they did before the close.
// What the scratch memory costs is bounded and not charged to any budget:
//  - host: a private anonymous mapping (MAP_NORESERVE). Reading it maps the kernel's shared
//    zero page and costs nothing; writing allocates process memory, at most what was mapped at
//    close and only as much as is written.
//  - cuda: one page: the physical memory of the first page retired is kept and mapped in place
//    of every other retired page (cuMemMap of one handle at many addresses). Before changing
//    the mappings retire waits, with its deadline, for the device's work (Note [Bounded device
//    sync]): a kernel launched before close may still use the pages. Past the deadline the
//    pages keep their own memory until the backend is destroyed (uncharged too, as the pages
//    of a close whose free(after=) fences did not complete in time).
// Python raises AllocatorClosed from layer() and the block operations once close has begun, so
// no new view or kernel launch reaches the ranges through the allocator; the rule covers the
// views taken before.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

namespace kvasync {

struct BackendResult {
  bool ok = true;
  std::string error;  // "<ERROR_NAME>: what failed", empty when ok
  // Done, with something the pool should report (its stats' last_error) though the call did
  // what the pool relies on: a tensor-parallel rank that kept pages the others unmapped.
  std::string warning;

  static BackendResult success() { return {}; }
  static BackendResult failure(std::string error) { return {false, std::move(error), {}}; }
  static BackendResult success_with_warning(std::string warning) {
    return {true, {}, std::move(warning)};
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const char* name() const = 0;
  virtual int64_t page_size() const = 0;
  virtual int num_ranges() const = 0;
  virtual int64_t num_pages() const = 0;
  virtual uintptr_t range_base(int range) const = 0;
  // The name this backend's driver gives to "out of physical memory" (used by fault injection).
  virtual const char* out_of_memory_name() const = 0;

  // Map pages [first, first + count) in every range, readable and writable. All or nothing.
  virtual BackendResult map(int64_t first, int64_t count) = 0;
  // Unmap pages [first, first + count) in every range and give their memory back.
  virtual BackendResult unmap(int64_t first, int64_t count) = 0;
  // Note [Views outlive close]: gives back the memory of mapped pages [first, first + count) as
  // unmap() does, but leaves each of their addresses mapped to scratch memory until the backend
  // is destroyed. Called by the pool's close only, once the mapper is joined, for pages that are
  // mapped; a retired page is never mapped again. Device work still using the pages is waited
  // for until `deadline`; past it (or on any failure) a page keeps its own memory, still mapped.
  virtual BackendResult retire(int64_t first, int64_t count,
                               std::chrono::steady_clock::time_point deadline) = 0;

  // Fences: opaque handles of device work that used some pages (a CUevent on cuda), handed to
  // free(). The pool owns each fence it is given and calls release_fence() once when no page
  // holds it any more. Before unmapping a page the mapper waits for its fences, polling until
  // `deadline` (Note [Unmap safety] in page_pool.h). Backends without device work have none.
  virtual BackendResult wait_fence(uintptr_t /*fence*/,
                                   std::chrono::steady_clock::time_point /*deadline*/) {
    return BackendResult::success();
  }
  virtual void release_fence(uintptr_t /*fence*/) {}

  // Gives back physical memory the backend keeps for quick re-mapping (the cuda handle pool).
  // Called by the mapper after a trim's unmaps.
  virtual void release_cached() {}

  // One step of background upkeep (cuda: create a handle ahead of need, or release a surplus
  // one), done by the mapper thread only while no job waits. Returns the seconds until it wants
  // to be called again: 0 for at once (it did something), a large value for "nothing to do".
  virtual double upkeep() { return kNoUpkeep; }
  static constexpr double kNoUpkeep = 1e9;
};

}  // namespace kvasync
