// Host backend: a real virtual-memory backend on the CPU (memfd + mmap).
//
// Note [Host backend]
// ~~~~~~~~~~~~~~~~~~~
// Rationale: CI and CPU-only users need the allocator's real behaviour -- reservations, page maps,
// faults on unmapped memory, memory given back -- without a GPU.
// Approach: each range is reserved with mmap(PROT_NONE, MAP_NORESERVE) and backed by its own memfd
// of the same (sparse) size. Mapping page p allocates the memfd's pages (fallocate, so running out
// of memory is an error value, not a SIGBUS later) and maps them over the reservation with
// MAP_FIXED | MAP_POPULATE, as the CUDA backend maps physical handles into a reserved device range.
// Unmapping puts a PROT_NONE mapping back and punches a hole in the memfd, which returns the memory
// to the OS. Touching an unmapped block faults, as on a GPU. At close, retire() puts readable and
// writable private anonymous memory there instead (Note [Views outlive close] in backend.h).
// Limitations: page_size must be a multiple of the OS page size.
#pragma once

#include <vector>

#include "backends/backend.h"

namespace kvasync {

class HostBackend final : public Backend {
 public:
  HostBackend(int num_ranges, int64_t num_pages, int64_t page_size);
  ~HostBackend() override;

  const char* name() const override { return "host"; }
  int64_t page_size() const override { return page_size_; }
  int num_ranges() const override { return static_cast<int>(ranges_.size()); }
  int64_t num_pages() const override { return num_pages_; }
  uintptr_t range_base(int range) const override;
  const char* out_of_memory_name() const override { return "ENOMEM"; }

  BackendResult map(int64_t first, int64_t count) override;
  BackendResult unmap(int64_t first, int64_t count) override;
  BackendResult retire(int64_t first, int64_t count,
                       std::chrono::steady_clock::time_point deadline) override;

 private:
  struct Range {
    char* base = nullptr;
    int memfd = -1;
  };
  BackendResult map_one(const Range& range, int64_t offset, int64_t length);
  // Puts `protection` anonymous memory (PROT_NONE: a hole that faults) over the bytes and
  // punches them out of the memfd.
  BackendResult unmap_one(const Range& range, int64_t offset, int64_t length, int protection);
  BackendResult unmap_with(int64_t first, int64_t count, int protection);

  int64_t num_pages_;
  int64_t page_size_;
  std::vector<Range> ranges_;
};

}  // namespace kvasync
