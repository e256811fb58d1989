#include "group/group_file.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace kvasync {
namespace group_detail {

void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
          0);
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, Clock::duration timeout) {
  // A non-private futex: the word is in a MAP_SHARED file mapped by several processes. The
  // timeout is relative (FUTEX_WAIT measures it on CLOCK_MONOTONIC).
  const auto ns = std::max<int64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count(), 0);
  timespec rel;
  rel.tv_sec = static_cast<time_t>(ns / 1000000000);
  rel.tv_nsec = static_cast<long>(ns % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &rel, nullptr, 0);
}

void copy_text(char* out, size_t size, const std::string& text) {
  size_t n = std::min(text.size(), size - 1);
  // Never keep a character's lead bytes without its continuation bytes (10xxxxxx).
  while (n > 0 && n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

std::string read_text(const char* in, size_t size) { return std::string(in, strnlen(in, size)); }

Clock::time_point deadline_after(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    throw std::invalid_argument("timeout must be a finite number of seconds >= 0, got " +
                                std::to_string(seconds));
  }
  constexpr double kFarAway = 1e9;  // about 31 years: saturates instead of overflowing
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::min(seconds, kFarAway)));
}

GroupFile* map_file(int fd, const std::string& path) {
  void* data = mmap(nullptr, sizeof(GroupFile), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    throw GroupError("cannot map the group file " + path + ": " + std::strerror(errno));
  }
  return static_cast<GroupFile*>(data);
}

void unmap_file(GroupFile* file) {
  if (file != nullptr) munmap(file, sizeof(GroupFile));
}

std::string describe_pages(int64_t first, int64_t count) {
  return count == 1 ? "page " + std::to_string(first)
                    : "pages [" + std::to_string(first) + ", " + std::to_string(first + count) +
                          ")";
}

}  // namespace group_detail
}  // namespace kvasync
