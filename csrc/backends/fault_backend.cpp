#include "backends/fault_backend.h"

#include <chrono>
#include <string>
#include <thread>

namespace kvasync {

void FaultBackend::apply_delay() const {
  // Sliced and re-read: release() (delay 0) or a shorter delay ends a long one at once, so a
  // test can always get the mapper back.
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const auto left = std::chrono::nanoseconds(faults_->delay_ns.load()) -
                      (std::chrono::steady_clock::now() - start);
    if (left.count() <= 0) return;
    std::this_thread::sleep_for(
        std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(1)));
  }
}

void FaultBackend::wait_while_hung() const {
  if (!faults_->hang.load()) return;
  faults_->hung_maps.fetch_add(1);
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(FaultState::kMaxHangSeconds);
  // A polled flag rather than a condition variable: the simulated driver stall must not be woken
  // by anything but release(), and every wait here keeps a bound.
  while (faults_->hang.load() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  faults_->hung_maps.fetch_sub(1);
}

BackendResult FaultBackend::map(int64_t first, int64_t count) {
  apply_delay();
  wait_while_hung();
  int64_t left = faults_->fail_count.load();
  while (left > 0 && !faults_->fail_count.compare_exchange_weak(left, left - 1)) {
  }
  if (left > 0) {
    return BackendResult::failure(std::string(inner_->out_of_memory_name()) +
                                  ": injected fault mapping " + std::to_string(count) + " page(s)");
  }
  return inner_->map(first, count);
}

BackendResult FaultBackend::unmap(int64_t first, int64_t count) {
  apply_delay();
  return inner_->unmap(first, count);
}

BackendResult FaultBackend::retire(int64_t first, int64_t count,
                                   std::chrono::steady_clock::time_point deadline) {
  apply_delay();
  return inner_->retire(first, count, deadline);
}

}  // namespace kvasync
