// Mapper: the dedicated thread that runs the page pool's map and unmap jobs.
//
// The thread is pure C++: it never calls Python, never takes the GIL, never owns a Python object.
// After a job it spins for a moment, then idles in poll() on an eventfd with a timeout (Note
// [Spinning wake-up] in wakeup.h; no condition variable), takes the earliest
// deadline job from the pool, runs it against the backend in runs of consecutive pages (one call
// per run, so the driver can batch), and hands the result back to the pool. Between jobs it does
// the backend's upkeep (Backend::upkeep), so it is the only thread that calls the driver.
// Stopping is bounded too: stop_and_join() waits for the thread's exit up to a deadline and
// otherwise abandons it (detaches): a thread stuck in a driver call must not hang shutdown.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "common/wakeup.h"

namespace kvasync {

class PagePool;
struct Job;

class Mapper {
 public:
  Mapper();
  ~Mapper();
  Mapper(const Mapper&) = delete;
  Mapper& operator=(const Mapper&) = delete;

  void start(std::shared_ptr<PagePool> pool);
  void wake();
  // Returns true when the thread was joined, false when it was still busy at the deadline.
  bool stop_and_join(double timeout_s);
  bool joined() const { return joined_; }

  // Runs a job against the backend. Fills `still_mapped` with the pages of unmap runs that
  // failed (a failed map is rolled back whole).
  static BackendResult run_job(Backend& backend, const Job& job,
                               std::vector<int64_t>& still_mapped);
  // Runs a batch and settles each of its jobs with the pool; never throws.
  static void run_batch(PagePool& pool, const std::vector<Job>& batch) noexcept;

 private:
  static void run(std::shared_ptr<PagePool> pool, Mapper* self);

  std::atomic<bool> stopping_{false};
  Wakeup wake_;    // work was queued, or stop
  Wakeup exited_;  // the thread has left its loop
  bool joined_ = false;
  std::thread thread_;
};

}  // namespace kvasync
