// Fault injection: wraps any backend and delays, hangs or fails its calls inside the mapper thread.
//
// Note [Fault injection]
// ~~~~~~~~~~~~~~~~~~~~~~
// The hangs this project exists to survive come from a driver call that stalls (contention while
// another engine initialises) or fails (out of memory). FaultBackend reproduces both where they
// happen -- in the mapper thread, between the pool's bookkeeping and the real driver call -- so
// tests exercise the real deadline, cancellation and error paths.
//  - delay: every map and unmap sleeps that long first (at most kMaxHangSeconds, like a hang: a
//    delay of 1e10 s must not overflow the int64 nanoseconds; release() ends a delay under way).
//  - hang: every map blocks until release(). NOTE: a simulated hang is still bounded by
//    kMaxHangSeconds so that an abandoned mapper thread in a test process ends eventually;
//    nothing in the pool relies on that bound.
//  - fail(count): the next `count` maps fail with the wrapped driver's out-of-memory error.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>

#include "backends/backend.h"

namespace kvasync {

struct FaultState {
  static constexpr double kMaxHangSeconds = 600.0;
  std::atomic<int64_t> delay_ns{0};
  std::atomic<bool> hang{false};
  std::atomic<int64_t> fail_count{0};
  std::atomic<int64_t> hung_maps{0};  // maps currently blocked by hang (lets tests wait for it)

  void set_delay(double seconds) {
    // Clamped before the conversion: 1e10 s in int64 nanoseconds would overflow (NaN reads as 0).
    const double clamped = seconds > 0 ? std::min(seconds, kMaxHangSeconds) : 0.0;
    delay_ns = static_cast<int64_t>(clamped * 1e9);
  }

  void release() {
    hang = false;
    delay_ns = 0;
    fail_count = 0;
  }
};

class FaultBackend final : public Backend {
 public:
  FaultBackend(std::shared_ptr<Backend> inner, std::shared_ptr<FaultState> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  const char* name() const override { return inner_->name(); }
  int64_t page_size() const override { return inner_->page_size(); }
  int num_ranges() const override { return inner_->num_ranges(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  uintptr_t range_base(int range) const override { return inner_->range_base(range); }
  const char* out_of_memory_name() const override { return inner_->out_of_memory_name(); }

  BackendResult wait_fence(uintptr_t fence, std::chrono::steady_clock::time_point deadline) override {
    return inner_->wait_fence(fence, deadline);
  }
  void release_fence(uintptr_t fence) override { inner_->release_fence(fence); }
  void release_cached() override { inner_->release_cached(); }
  double upkeep() override { return inner_->upkeep(); }

  BackendResult map(int64_t first, int64_t count) override;
  BackendResult unmap(int64_t first, int64_t count) override;
  // Delayed as unmap() is (a slow close), never failed: Note [Views outlive close].
  BackendResult retire(int64_t first, int64_t count,
                       std::chrono::steady_clock::time_point deadline) override;

 private:
  void apply_delay() const;
  void wait_while_hung() const;

  std::shared_ptr<Backend> inner_;
  std::shared_ptr<FaultState> faults_;
};

}  // namespace kvasync
