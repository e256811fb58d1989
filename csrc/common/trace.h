// Trace: when the last cold request passed each step of its way through the core.
//
// bench/bench_map.py reads these to show where the time of an awaited alloc that needs a fresh
// page goes (queued -> mapper awake -> driver calls -> completion pushed). Each point is one
// relaxed store of a CLOCK_MONOTONIC reading (std::chrono::steady_clock, the clock of Python's
// time.monotonic_ns), written by whichever thread passes it; a reader sees the latest pass of
// every point, which is one request's timeline when one request is in flight.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvasync::trace {

enum Point : int {
  kJobQueued,     // a job was queued and the mapper notified (caller's thread)
  kMapperAwake,   // the mapper left its wait
  kBatchTaken,    // the mapper took the job from the pool
  kHeadroomDone,  // cuda: the memory headroom is known (cached, or cuMemGetInfo)
  kCreated,       // cuda: the physical handles exist (pooled, or cuMemCreate)
  kMapped,        // cuda: cuMemMap of every handle done
  kAccessDone,    // cuda: cuMemSetAccess done
  kBackendDone,   // the backend call returned
  kCompleted,     // the completion record was pushed (the eventfd written)
  kNumPoints
};

inline constexpr const char* kNames[kNumPoints] = {
    "job_queued", "mapper_awake", "batch_taken", "headroom_done", "created",
    "mapped",     "access_done",  "backend_done", "completed"};

inline std::atomic<int64_t> points[kNumPoints];

inline void mark(Point point) {
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  points[point].store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(),
                      std::memory_order_relaxed);
}

}  // namespace kvasync::trace
