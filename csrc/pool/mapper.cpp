#include "pool/mapper.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>

#include "pool/page_pool.h"
#include "common/trace.h"

namespace kvasync {
namespace {

constexpr auto kIdlePoll = std::chrono::milliseconds(100);  // how often an idle mapper re-checks
// After a job the mapper spins this long before it sleeps (Note [Spinning wake-up] in wakeup.h):
// the next job of a burst (a request's map right after a trim or another request's map) then
// starts without a sleeping thread's wake-up, tens of microseconds on a VM. Bounded, so an idle
// allocator costs no CPU.
constexpr auto kSpinAfterWork = std::chrono::microseconds(1000);

// On one CPU a spinning thread only delays the thread it waits for: sleep at once there.
bool can_spin() {
  static const bool several = std::thread::hardware_concurrency() > 1;
  return several;
}

// A backend call whose exception becomes a failure (DESIGN.md: failures are values): run_job
// then always knows which runs are mapped, and rolls back or reports them.
template <class Call>
BackendResult guarded(Call&& call) {
  try {
    return call();
  } catch (const std::exception& e) {
    return BackendResult::failure(std::string("EXCEPTION: ") + e.what());
  } catch (...) {
    return BackendResult::failure("EXCEPTION: unknown");
  }
}

}  // namespace

Mapper::Mapper() = default;

Mapper::~Mapper() {
  if (thread_.joinable()) {
    // Only reached when the abandoned thread itself drops the last reference to the pool.
    thread_.detach();
  }
}

void Mapper::start(std::shared_ptr<PagePool> pool) {
  thread_ = std::thread(&Mapper::run, std::move(pool), this);
}

void Mapper::wake() { wake_.notify(); }

bool Mapper::stop_and_join(double timeout_s) {
  if (joined_) return true;
  if (!thread_.joinable()) return false;  // abandoned before
  stopping_ = true;
  wake();
  if (!exited_.wait_for(std::chrono::duration<double>(std::max(timeout_s, 0.0)))) {
    // NOTE: the thread is stuck in a backend call. It holds a reference to the pool (and so the
    // backend) and ends by itself when that call returns; shutdown does not wait for it.
    thread_.detach();
    return false;
  }
  thread_.join();  // it has signalled its exit: this returns at once
  joined_ = true;
  return true;
}

BackendResult Mapper::run_job(Backend& backend, const Job& job,
                              std::vector<int64_t>& still_mapped) {
  // One backend call per run of consecutive pages, so the driver sees batches.
  const bool mapping = job.kind != JobKind::kUnmap;
  for (uintptr_t fence : job.fences) {  // Note [Unmap safety]
    BackendResult idle = guarded([&] { return backend.wait_fence(fence, job.deadline); });
    if (!idle.ok) {
      still_mapped = job.pages;  // nothing was touched
      return idle;
    }
  }
  BackendResult first_error;
  std::string warning;  // the last run's (BackendResult::warning): reported, not a failure
  size_t start = 0;
  std::vector<std::pair<int64_t, int64_t>> done;
  // Allocated before the first backend call: out of memory after it would leave the runs done
  // so far unknown to the pool (mapped, yet counted unmapped).
  done.reserve(job.pages.size());
  still_mapped.reserve(job.pages.size());
  while (start < job.pages.size()) {
    size_t end = start + 1;
    while (end < job.pages.size() && job.pages[end] == job.pages[end - 1] + 1) ++end;
    const int64_t first = job.pages[start], count = static_cast<int64_t>(end - start);
    BackendResult result = guarded([&] {
      return mapping ? backend.map(first, count) : backend.unmap(first, count);
    });
    if (!result.ok) {
      if (mapping) {
        // All or nothing for the job. A run whose rollback fails stays mapped: say so, or the
        // pool would count mapped pages as unmapped (and map over them later).
        for (auto [f, c] : done) {
          if (guarded([&] { return backend.unmap(f, c); }).ok) continue;
          for (int64_t page = f; page < f + c; ++page) still_mapped.push_back(page);
        }
        return result;
      }
      if (first_error.ok) first_error = result;
      for (int64_t page = first; page < first + count; ++page) still_mapped.push_back(page);
    } else if (!result.warning.empty()) {
      warning = std::move(result.warning);
    }
    done.emplace_back(first, count);
    start = end;
  }
  // A trim or a lowered limit (an unmap with a barrier) means "give the memory back now": drop
  // whatever the backend keeps for quick re-mapping too.
  if (!mapping && job.request_id != 0 && !job.keep_cached) {
    guarded([&] {
      backend.release_cached();  // an optimisation: a failure leaves the handles pooled
      return BackendResult::success();
    });
  }
  if (first_error.ok && !warning.empty()) return BackendResult::success_with_warning(warning);
  return first_error;
}

void Mapper::run_batch(PagePool& pool, const std::vector<Job>& batch) noexcept {
  // Every exception ends here (DESIGN.md: failures are values; one escaping this thread would end
  // the process through std::terminate). The backend's are already failures (guarded); what is
  // left is running out of memory in the bookkeeping.
  std::vector<int64_t> still_mapped;
  BackendResult result;
  const auto started = std::chrono::steady_clock::now();
  int64_t num_pages = 0;
  try {
    // Several maps run as one (all or nothing together); each job is then settled on its own.
    if (batch.size() == 1) {
      num_pages = static_cast<int64_t>(batch.front().pages.size());
      result = run_job(pool.mutable_backend(), batch.front(), still_mapped);
    } else {
      const Job merged = merge_jobs(batch);
      num_pages = static_cast<int64_t>(merged.pages.size());
      result = run_job(pool.mutable_backend(), merged, still_mapped);
    }
  } catch (const std::exception& e) {
    try {
      result = BackendResult::failure(std::string("EXCEPTION: ") + e.what());
      // NOTE: an unmap whose runs are unknown is reported as still mapped: the pages stay
      // accounted (and are retried) rather than handed out unmapped.
      still_mapped = batch.front().kind == JobKind::kUnmap ? batch.front().pages
                                                           : std::vector<int64_t>{};
    } catch (...) {
      result.ok = false;
    }
  } catch (...) {
    result.ok = false;
  }
  trace::mark(trace::kBackendDone);
  if (result.ok) {
    try {  // what the spinning waits expect a job to take (Note in wakeup.h)
      pool.record_job_time(
          batch.front().kind,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
          num_pages);
    } catch (...) {
    }
  }
  for (const Job& job : batch) {
    try {
      pool.finish_job(job, result, still_mapped);
    } catch (...) {
      // Out of memory in the bookkeeping: this job's pages stay in flight (unusable, but
      // accounted), its waiter times out at its deadline. The thread keeps serving.
    }
  }
}

void Mapper::run(std::shared_ptr<PagePool> pool, Mapper* self) {
  auto last_work = std::chrono::steady_clock::now() - kSpinAfterWork;
  while (!self->stopping_.load()) {
    std::vector<Job> batch;
    try {
      batch = pool->next_batch();
    } catch (...) {
      // Out of memory choosing the next jobs: wait a little (bounded) and try again.
      self->wake_.wait_for(kIdlePoll);
      continue;
    }
    if (batch.empty()) {
      // Idle: the backend's upkeep (one driver call at a time, so a job that arrives waits for
      // at most one), then a bounded wait for work.
      double again = Backend::kNoUpkeep;
      try {
        again = pool->mutable_backend().upkeep();
      } catch (const std::exception&) {
        // Upkeep is an optimisation: a failure leaves the next map to do the work itself.
      }
      if (again <= 0) continue;
      const auto spin = can_spin() ? kSpinAfterWork - (std::chrono::steady_clock::now() - last_work)
                                   : std::chrono::steady_clock::duration::zero();
      if (self->wake_.wait_for(std::min<std::chrono::duration<double>>(
                                   kIdlePoll, std::chrono::duration<double>(again)),
                               std::max(spin, std::chrono::steady_clock::duration::zero()))) {
        trace::mark(trace::kMapperAwake);
      }
      continue;
    }
    trace::mark(trace::kBatchTaken);
    try {
      pool->charge_pending(batch);  // Note [Budget off the caller's thread] in page_pool.h
    } catch (...) {
      // Out of memory settling the charge: the batch fails as a map would (its pages go back,
      // its waiters are told), rather than reach the backend uncharged.
      const BackendResult failed = BackendResult::failure("charging the share's ledger failed");
      for (const Job& job : batch) {
        try {
          pool->finish_job(job, failed, {});
        } catch (...) {
        }
      }
      continue;
    }
    if (batch.empty()) continue;  // nothing granted
    run_batch(*pool, batch);
    trace::mark(trace::kCompleted);
    last_work = std::chrono::steady_clock::now();
  }
  self->exited_.notify();
  // `pool` is released here; when the thread was abandoned it may be the last reference.
}

}  // namespace kvasync
