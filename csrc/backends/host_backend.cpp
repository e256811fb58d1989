#include "backends/host_backend.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/errors.h"

namespace kvasync {
namespace {

std::string errno_failure(const char* what, int err) {
  // strerrorname_np needs glibc 2.32; name the errors a map can really meet, number the rest.
  const char* name = err == ENOMEM ? "ENOMEM" : err == ENOSPC ? "ENOSPC" : err == EINVAL ? "EINVAL"
                     : err == EPERM ? "EPERM" : nullptr;
  std::string out = name ? name : "errno " + std::to_string(err);
  return out + ": " + what + " failed (" + std::strerror(err) + ")";
}

}  // namespace

HostBackend::HostBackend(int num_ranges, int64_t num_pages, int64_t page_size)
    : num_pages_(num_pages), page_size_(page_size) {
  const long os_page = sysconf(_SC_PAGESIZE);
  if (num_ranges <= 0 || num_pages <= 0) throw std::invalid_argument("host backend: empty range");
  if (page_size <= 0 || page_size % os_page != 0) {
    throw std::invalid_argument("host backend: page_size " + std::to_string(page_size) +
                                " must be a positive multiple of the OS page size " +
                                std::to_string(os_page));
  }
  int64_t bytes = 0;  // checked: num_pages * page_size is a signed overflow otherwise
  if (__builtin_mul_overflow(num_pages, page_size, &bytes)) {
    throw std::invalid_argument("host backend: " + std::to_string(num_pages) + " pages of " +
                                std::to_string(page_size) +
                                " bytes overflow a 64-bit range; lower max_blocks");
  }
  try {
    for (int r = 0; r < num_ranges; ++r) {
      Range range;
      void* base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base == MAP_FAILED) {
        throw BackendError(errno_failure("mmap reserve", errno) + ": reserving " +
                           std::to_string(bytes) + " bytes of address space for " +
                           std::to_string(num_pages) + " pages; lower max_blocks");
      }
      range.base = static_cast<char*>(base);
      range.memfd = memfd_create("kvasync-kv", MFD_CLOEXEC);
      if (range.memfd < 0 || ftruncate(range.memfd, bytes) != 0) {
        const int err = errno;
        if (range.memfd >= 0) close(range.memfd);
        munmap(base, bytes);
        throw BackendError(errno_failure("memfd_create/ftruncate", err));
      }
      ranges_.push_back(range);
    }
  } catch (...) {
    for (const Range& range : ranges_) {
      munmap(range.base, bytes);
      close(range.memfd);
    }
    throw;
  }
}

HostBackend::~HostBackend() {
  const int64_t bytes = num_pages_ * page_size_;
  for (const Range& range : ranges_) {
    munmap(range.base, bytes);  // releases the reservation and any page still mapped
    close(range.memfd);         // the memfd's memory goes with its last reference
  }
}

uintptr_t HostBackend::range_base(int range) const {
  return reinterpret_cast<uintptr_t>(ranges_.at(range).base);
}

BackendResult HostBackend::map_one(const Range& range, int64_t offset, int64_t length) {
  // Allocate first: a full machine is then ENOMEM/ENOSPC here rather than a SIGBUS on first touch.
  if (fallocate(range.memfd, 0, offset, length) != 0) {
    return BackendResult::failure(errno_failure("fallocate", errno));
  }
  void* want = range.base + offset;
  void* got = mmap(want, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE,
                   range.memfd, offset);
  if (got == MAP_FAILED) {
    const int err = errno;
    fallocate(range.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length);
    return BackendResult::failure(errno_failure("mmap MAP_FIXED", err));
  }
  return BackendResult::success();
}

BackendResult HostBackend::unmap_one(const Range& range, int64_t offset, int64_t length,
                                     int protection) {
  void* want = range.base + offset;
  // One call replaces the memfd's pages: a thread reading there sees the old pages or the new
  // ones, never a hole (mmap with MAP_FIXED swaps the mapping under the process's mmap lock).
  void* got = mmap(want, length, protection,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED) {
    return BackendResult::failure(errno_failure(
        protection == PROT_NONE ? "mmap PROT_NONE" : "mmap of the scratch memory", errno));
  }
  if (fallocate(range.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0) {
    return BackendResult::failure(errno_failure("fallocate punch hole", errno));
  }
  return BackendResult::success();
}

BackendResult HostBackend::map(int64_t first, int64_t count) {
  if (first < 0 || count <= 0 || first + count > num_pages_) {
    return BackendResult::failure("EINVAL: pages out of range");
  }
  const int64_t offset = first * page_size_, length = count * page_size_;
  for (size_t r = 0; r < ranges_.size(); ++r) {
    BackendResult result = map_one(ranges_[r], offset, length);
    if (!result.ok) {
      for (size_t done = 0; done < r; ++done) {
        unmap_one(ranges_[done], offset, length, PROT_NONE);  // roll back
      }
      return result;
    }
  }
  return BackendResult::success();
}

BackendResult HostBackend::unmap(int64_t first, int64_t count) {
  return unmap_with(first, count, PROT_NONE);
}

BackendResult HostBackend::retire(int64_t first, int64_t count,
                                  std::chrono::steady_clock::time_point /*deadline*/) {
  // Note [Views outlive close]: private anonymous memory, read as zeros (the shared zero page)
  // and allocated only where a stale view writes; no device work to wait for on the CPU.
  return unmap_with(first, count, PROT_READ | PROT_WRITE);
}

BackendResult HostBackend::unmap_with(int64_t first, int64_t count, int protection) {
  if (first < 0 || count <= 0 || first + count > num_pages_) {
    return BackendResult::failure("EINVAL: pages out of range");
  }
  BackendResult first_error;
  for (const Range& range : ranges_) {
    BackendResult result = unmap_one(range, first * page_size_, count * page_size_, protection);
    if (!result.ok && first_error.ok) first_error = result;  // keep going: free what we can
  }
  return first_error;
}

}  // namespace kvasync
