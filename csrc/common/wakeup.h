// Wakeup: a flag that a thread waits on with a timeout, and others signal.
//
// Used instead of a condition variable (DESIGN.md: no condition variable, no unbounded wait): a
// wait always has a timeout, needs no mutex, and a signal sent before the wait is never lost.
//
// Note [Spinning wake-up]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Waking a thread that sleeps in the kernel costs tens of microseconds on a VM (an interrupt to
// a halted vCPU), more than the driver's map of a page. So a waiter may first spin on an atomic
// flag for a bounded time, and only then sleep in poll() on an eventfd. notify() sets the flag
// and writes the eventfd only when the waiter is asleep: a spinning waiter is woken without a
// system call on either side. The two flags form a Dekker pair (both seq_cst): the notifier
// stores `signalled_` then reads `sleeping_`; the waiter stores `sleeping_` then reads
// `signalled_`; at least one of them sees the other, so no signal is lost.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
    signalled_.store(true);
    if (sleeping_.load()) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t written = write(fd_, &one, sizeof one);
    }
  }

  // Waits until notified or `timeout` passes, spinning for at most `spin` of it first (Note
  // [Spinning wake-up]); returns true when notified (and clears it).
  template <class Duration, class Spin = std::chrono::nanoseconds>
  bool wait_for(Duration timeout, Spin spin = Spin::zero()) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto spin_for = std::min<Clock::duration>(
        std::chrono::duration_cast<Clock::duration>(spin),
        std::chrono::duration_cast<Clock::duration>(timeout));
    if (spin_for > Clock::duration::zero()) {
      const auto spin_until = start + spin_for;
      do {
        if (signalled_.load(std::memory_order_relaxed) && signalled_.exchange(false)) return true;
        cpu_relax();
      } while (Clock::now() < spin_until);
    }
    sleeping_.store(true);
    if (signalled_.exchange(false)) {
      sleeping_.store(false);
      clear_fd();
      return true;
    }
    // Clamped to poll's int range (~24.8 days): a longer timeout must not wrap to "forever".
    const auto left = std::chrono::duration_cast<std::chrono::duration<double, std::milli>>(
        timeout - (Clock::now() - start));
    const double ms = std::min(left.count(), 2e9);
    pollfd ready{fd_, POLLIN, 0};
    poll(&ready, 1, ms <= 0 ? 0 : static_cast<int>(std::ceil(ms)));
    sleeping_.store(false);
    clear_fd();
    return signalled_.exchange(false);
  }

  // True when notified since the last wait, without waiting or clearing.
  bool notified() const { return signalled_.load(); }

 private:
  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void clear_fd() {
    uint64_t count;
    [[maybe_unused]] ssize_t got = read(fd_, &count, sizeof count);  // EAGAIN when not set
  }

  int fd_;
  std::atomic<bool> signalled_{false};
  std::atomic<bool> sleeping_{false};
};

}  // namespace kvasync
