// DeviceSyncer: "wait for all of this process's work on the device", with a deadline.
//
// Note [Bounded device sync]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor-parallel rank's backend (vLLM's worker process) unmaps pages the scheduler freed in
// another process, which records no fence of this process's GPU work; kernels on any stream
// (vLLM runs some on streams of their own) may still read the pages. The one driver call that
// covers every stream is cuCtxSynchronize, and it has no timeout: a stuck kernel or collective
// would park the rank's mapper thread for ever, and every job behind it in the rank's ring with
// it (DESIGN.md: no unbounded wait). So the sync runs on a thread of its own, and the mapper
// waits for it with a deadline:
//
//   - sync(deadline) posts a request (a generation number) and waits, in bounded slices, until a
//     cuCtxSynchronize that *started after the request* has returned. A sync that began before
//     the request does not count: work submitted before the request may have been launched after
//     that sync started.
//   - Past the deadline the caller gets a failure and leaves the pages mapped (a failed unmap
//     changes nothing); the sync thread stays in the driver and serves the next request when it
//     returns.
//   - The thread owns its state (a shared_ptr): the backend that started it may be destroyed
//     while it is stuck in the driver; it is then detached and ends when the call returns.
#pragma once

#include <chrono>
#include <memory>

#include "backends/backend.h"

namespace kvasync {

// Note [Graph capture beside the mapper] (cuda_backend.h): a cuCtxSynchronize while any stream of
// the process captures a CUDA graph invalidates that capture, whatever the syncing thread's capture
// mode (measured on an H200: bench/probes/capture_probe.py; the VMM calls do not). So the syncs
// are gated: begin_graph_capture() closes the gate and waits for a sync in flight to return (until
// `deadline`: false if one is still in the driver then, and the gate stays open); while it is
// closed a sync fails at once (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: the unmap fails and its pages
// stay mapped); end_graph_capture() opens it again. Process-wide, counted: captures may nest or
// run on several threads.
bool begin_graph_capture(std::chrono::steady_clock::time_point deadline);
void end_graph_capture();
int graph_captures_in_progress();

class DeviceSyncer {
 public:
  // Starts the sync thread for `device` (retains its primary context). Throws BackendError.
  explicit DeviceSyncer(int device);
  ~DeviceSyncer();  // stops the thread, or detaches it while it is in the driver
  DeviceSyncer(const DeviceSyncer&) = delete;
  DeviceSyncer& operator=(const DeviceSyncer&) = delete;

  // Returns once every piece of work this process queued on the device before the call is done,
  // or a failure at `deadline` (or when the driver reports an error).
  BackendResult sync(std::chrono::steady_clock::time_point deadline);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kvasync
