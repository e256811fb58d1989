#include "pool/completion_queue.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvasync {

CompletionQueue::CompletionQueue() : event_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (event_fd_ < 0) throw std::runtime_error(std::string("eventfd failed: ") + std::strerror(errno));
}

CompletionQueue::~CompletionQueue() { close(event_fd_); }

void CompletionQueue::push(Completion completion) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.push_back(std::move(completion));
    pushed_.fetch_add(1);
  }
  const uint64_t one = 1;
  // Non-blocking; the counter cannot overflow in practice (2^64 - 2 writes without a read).
  [[maybe_unused]] ssize_t written = write(event_fd_, &one, sizeof one);
}

std::vector<Completion> CompletionQueue::drain() {
  uint64_t count;
  [[maybe_unused]] ssize_t got = read(event_fd_, &count, sizeof count);  // EAGAIN when not set
  std::vector<Completion> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.swap(records_);
  return out;
}

std::optional<Completion> CompletionQueue::take(int64_t request_id,
                                                std::chrono::steady_clock::time_point until) {
  uint64_t seen = pushed_.load() - 1;  // look at once
  for (;;) {
    const uint64_t pushed = pushed_.load();
    if (pushed != seen) {
      seen = pushed;
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = records_.begin(); it != records_.end(); ++it) {
        if (it->request_id == request_id) {
          Completion found = std::move(*it);
          records_.erase(it);
          return found;
        }
      }
    }
    if (std::chrono::steady_clock::now() >= until) return std::nullopt;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace kvasync
