// Wakeup: an eventfd that a thread waits on with a timeout, and others signal.
//
// Used instead of a condition variable (DESIGN.md: no condition variable, no unbounded wait): a
// wait always has a timeout, needs no mutex, and a signal sent before the wait is never lost (the
// eventfd stays readable until the waiter clears it).
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace kvasync {

class Wakeup {
 public:
  Wakeup() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw std::runtime_error("eventfd failed");
  }
  ~Wakeup() { close(fd_); }
  Wakeup(const Wakeup&) = delete;
  Wakeup& operator=(const Wakeup&) = delete;

  void notify() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t written = write(fd_, &one, sizeof one);
  }

  // Waits until notified or `timeout` passes; returns true when notified (and clears it).
  template <class Duration>
  bool wait_for(Duration timeout) {
    // Clamped to poll's int range (~24.8 days): a longer timeout must not wrap to "forever".
    const double ms = std::min(std::chrono::duration<double, std::milli>(timeout).count(), 2e9);
    pollfd ready{fd_, POLLIN, 0};
    const int n = poll(&ready, 1, ms <= 0 ? 0 : static_cast<int>(std::ceil(ms)));
    if (n <= 0) return false;
    uint64_t count;
    [[maybe_unused]] ssize_t got = read(fd_, &count, sizeof count);
    return true;
  }

  // True when notified since the last wait, without waiting or clearing.
  bool notified() const {
    pollfd ready{fd_, POLLIN, 0};
    return poll(&ready, 1, 0) > 0;
  }

 private:
  int fd_;
};

}  // namespace kvasync
