// Note [Bounded device sync] in cuda_device_sync.h.
#include "backends/cuda_device_sync.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "backends/cuda_backend.h"
#include "backends/cuda_driver.h"
#include "common/wakeup.h"

namespace kvasync {

using Clock = std::chrono::steady_clock;

struct DeviceSyncer::State {
  explicit State(int device) : context(device) {}
  PrimaryContext context;
  Wakeup requests;  // the sync thread waits here
  Wakeup replies;   // a caller waits here (in slices: several callers may share it)
  std::atomic<uint64_t> requested{0};
  std::atomic<uint64_t> completed{0};  // the newest request a finished sync covers
  std::atomic<int> last_error{0};      // the CUresult of the newest sync that failed
  std::atomic<uint64_t> failed{0};     // the newest request whose sync failed
  std::atomic<bool> stop{false};
};

namespace {

// How long the sync thread sleeps between looks at `stop` when nothing is asked of it.
constexpr auto kIdleSlice = std::chrono::milliseconds(100);
// How long a caller sleeps between looks at `completed`: replies has one flag, which one caller
// may take while another waits; the slice bounds what the other loses.
constexpr auto kReplySlice = std::chrono::milliseconds(1);

// The gate of Note [Graph capture beside the mapper] (in the header). A leaf lock, held only to
// read and change the two counts, never across a driver call.
struct CaptureGate {
  std::mutex mutex;
  int captures = 0;  // graphs being captured in this process
  int syncing = 0;   // cuCtxSynchronize calls in the driver now
};

CaptureGate& capture_gate() {
  static CaptureGate gate;
  return gate;
}

// A sync that a capture under way forbids: the driver's own code for it.
constexpr cuda::CUresult kCaptureInProgress = 900;  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED

cuda::CUresult gated_sync(const cuda::CudaDriver& driver) {
  CaptureGate& gate = capture_gate();
  {
    std::lock_guard<std::mutex> lock(gate.mutex);
    if (gate.captures > 0) return kCaptureInProgress;
    ++gate.syncing;
  }
  const cuda::CUresult result = driver.cuCtxSynchronize();
  std::lock_guard<std::mutex> lock(gate.mutex);
  --gate.syncing;
  return result;
}

void run(const std::shared_ptr<DeviceSyncer::State>& state) {
  const cuda::CudaDriver& driver = cuda::CudaDriver::get();
  const cuda::CUresult current = state->context.make_current();
  while (!state->stop.load()) {
    if (!state->requests.wait_for(kIdleSlice)) continue;
    // Read after the wake-up: this sync starts after every request up to `target` was posted.
    const uint64_t target = state->requested.load();
    cuda::CUresult result = current;
    if (result == cuda::CUDA_SUCCESS) {
      // Note [Graph capture beside the mapper]: not while a graph is captured (the gate); a sync
      // refused fails the unmap, whose pages stay mapped.
      const RelaxedCaptureMode relaxed;
      result = gated_sync(driver);
    }
    if (result != cuda::CUDA_SUCCESS) {
      state->last_error.store(static_cast<int>(result));
      state->failed.store(target);
    }
    state->completed.store(target);
    state->replies.notify();
  }
}

}  // namespace

bool begin_graph_capture(Clock::time_point deadline) {
  CaptureGate& gate = capture_gate();
  for (bool first = true;; first = false) {
    {
      std::lock_guard<std::mutex> lock(gate.mutex);
      if (first) ++gate.captures;  // from here no sync starts
      if (gate.syncing == 0) return true;
      if (Clock::now() >= deadline) {
        --gate.captures;
        return false;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void end_graph_capture() {
  CaptureGate& gate = capture_gate();
  std::lock_guard<std::mutex> lock(gate.mutex);
  if (gate.captures > 0) --gate.captures;
}

int graph_captures_in_progress() {
  CaptureGate& gate = capture_gate();
  std::lock_guard<std::mutex> lock(gate.mutex);
  return gate.captures;
}

DeviceSyncer::DeviceSyncer(int device) : state_(std::make_shared<State>(device)) {
  std::thread([state = state_] { run(state); }).detach();
}

DeviceSyncer::~DeviceSyncer() {
  // The thread holds the state; it sees `stop` within kIdleSlice, or when its driver call
  // returns.
  state_->stop.store(true);
  state_->requests.notify();
}

BackendResult DeviceSyncer::sync(Clock::time_point deadline) {
  State& state = *state_;
  const uint64_t request = state.requested.fetch_add(1) + 1;
  state.requests.notify();
  for (;;) {
    if (state.completed.load() >= request) {
      if (state.failed.load() >= request) {
        const auto error = static_cast<cuda::CUresult>(state.last_error.load());
        return BackendResult::failure(
            cuda::CudaDriver::get().failure(error, "cuCtxSynchronize before an unmap"));
      }
      return BackendResult::success();
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      return BackendResult::failure(
          "CUDA_ERROR_NOT_READY: this process's work on the device was not done by the unmap's "
          "deadline (Note [Bounded device sync]); the pages stay mapped");
    }
    state.replies.wait_for(std::min<Clock::duration>(kReplySlice, deadline - now));
  }
}

}  // namespace kvasync
