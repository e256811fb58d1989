#include "completion_queue.h"

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

}  // namespace kvasync
