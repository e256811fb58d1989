// PagePool's side of a device share (Note [Share ledger] in ledger.h): charging maps to the
// share's budget (Note [Budget off the caller's thread] in page_pool.h), publishing demand, and
// the watcher's tick that applies the fair share (Note [Fair share under pressure]). The rest of
// the pool is in page_pool.cpp.
#include "pool/page_pool.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace kvasync {

bool PagePool::try_charge_share(std::vector<int64_t>& pages, bool refill) {
  if (!share_ || pages.empty()) return true;
  // Note [Budget off the caller's thread]: under mutex_, the ledger's lock is only tried.
  const ShareMember::Grant grant =
      share_->grant(static_cast<int64_t>(pages.size()), refill, Clock::now());
  // Not granting now for another reason than the budget (a file settling, removed, damaged:
  // Note [Ledger file identity]): as a busy lock, no shortage; the watcher's next tick plans again.
  if (grant.lock_busy || grant.held) {
    ledger_busy_pid_ = grant.held ? 0 : grant.holder_pid != 0 ? grant.holder_pid : -1;
    return false;
  }
  ledger_busy_pid_ = 0;
  // Pages the share's budget does not allow go back unmapped (they were never charged).
  const int64_t granted = grant.granted;
  while (static_cast<int64_t>(pages.size()) > granted) {
    set_state(pages.back(), PageState::kUnmapped);
    pages.pop_back();
  }
  return true;
}

void PagePool::charge_pending(std::vector<Job>& batch) {
  if (!share_) return;
  int64_t wanted = 0;
  Clock::time_point deadline = Clock::now() + ShareMember::kGrantLockTimeout;
  for (const Job& job : batch) {
    if (!job.charge_pending) continue;
    wanted += static_cast<int64_t>(job.pages.size());
    deadline = std::min(deadline, job.deadline);
  }
  if (wanted == 0) return;
  // mutex_ is not held: waiting for the ledger's lock here holds up no caller.
  const ShareMember::Grant grant = share_->grant(wanted, false, deadline);
  // Held (Note [Ledger file identity]) is no shortage either: nobody is marked blocked.
  const bool lock_free = !grant.lock_busy && !grant.held;
  const int64_t got = grant.granted;
  int64_t granted = got;
  const int32_t holder = !grant.lock_busy ? 0 : (grant.holder_pid != 0 ? grant.holder_pid : -1);
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_busy_pid_ = holder;
  for (Job& job : batch) {
    if (!job.charge_pending) continue;
    job.charge_pending = false;
    uncharged_pages_ -= static_cast<int64_t>(job.pages.size());
    const int64_t keep = std::min<int64_t>(granted, static_cast<int64_t>(job.pages.size()));
    granted -= keep;
    for (size_t k = static_cast<size_t>(keep); k < job.pages.size(); ++k) {
      const int64_t page = job.pages[k];
      set_state(page, PageState::kUnmapped);
      if (job.kind == JobKind::kMapForRequest) incoming_for_waiters_ -= pages_[page].num_blocks;
      if (job.kind == JobKind::kRefill) --refill_pages_;
    }
    job.pages.resize(static_cast<size_t>(keep));
    if (job.pages.empty()) job_left_flight(job);
  }
  batch.erase(std::remove_if(batch.begin(), batch.end(),
                             [](const Job& job) { return job.pages.empty(); }),
              batch.end());
  // Short of budget (the lock was had): the waiters are blocked, as when planned (plan_maps).
  // A lock that stayed busy is no shortage. Either way the watcher's next tick plans again.
  if (lock_free && !closed_) {
    share_->set_blocked(got < wanted ? static_cast<int64_t>(waiters_.size()) : 0);
  }
  if (batch.empty()) {
    current_job_.reset();
  } else {
    current_job_ = batch.size() == 1 ? batch.front() : merge_jobs(batch);
  }
}

int64_t PagePool::demand_pages(Clock::time_point now) const {
  // Note [Fair share under pressure]: what this pool holds and its waiters ask for, or what its
  // engine reported (until the report lapses, and its claim beyond the former only while
  // requests follow it: Note [Demand claims]), in pages of the fewest blocks a page holds.
  const int64_t bpp = std::max<int64_t>(min_page_blocks_, 1);
  int64_t blocks = used_blocks_ + waiting_blocks_;
  if (now < reported_until_ && claim_.counts(now)) blocks = std::max(blocks, reported_demand_);
  const int64_t pages = (blocks + bpp - 1) / bpp;
  return std::min({pages, policy_.own_limit(), static_cast<int64_t>(pages_.size())});
}

void PagePool::publish_demand(Clock::time_point now) {
  // Note [Demand claims]: a request still waiting keeps the claim counting.
  if (!waiters_.empty()) claim_.requested(now);
  // A new figure wakes every watcher: the others step down (or stop stepping down) now.
  if (share_ && share_->set_demand(demand_pages(now))) share_->notify();
}

void PagePool::set_demand(int64_t blocks) {
  if (blocks < 0) {
    throw std::invalid_argument("demand must be a number of blocks >= 0, got " +
                                std::to_string(blocks));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  const Clock::time_point now = Clock::now();
  reported_demand_ = blocks;
  reported_until_ = now + kDemandTtl;
  claim_.reported(blocks > used_blocks_ + waiting_blocks_, now);  // Note [Demand claims]
  publish_demand(now);
}

void PagePool::release_share(int64_t pages) {
  if (!share_ || pages <= 0) return;
  share_->release(pages);
  share_->notify();  // a waiter of another process may fit now
}

void PagePool::limit_changed(bool fail_above_own) {
  // As set_limit_pages, without a barrier: nobody awaits a limit set from outside.
  plan_drain();
  if (!fail_above_own) return;
  // Only the own limit is a promise (Note [Limit policy]): a waiter above the fair share waits.
  const int64_t limit = limit_blocks(policy_.own_limit());
  std::vector<int64_t> too_big;
  for (const Waiter& w : waiters_) {
    if (w.n > limit) too_big.push_back(w.id);
  }
  for (int64_t id : too_big) {
    fail_waiter(id, CompletionStatus::kOutOfBlocks,
                "the share's operator lowered this allocator's limit to " +
                    std::to_string(limit) + " blocks, fewer than this request needs");
  }
}

void PagePool::on_share_tick(ShareMember& member) {
  // Note [Fair share under pressure]: under pressure the backend's cached handles (cuda's spare
  // physical pages, kept for quick re-mapping and not charged to the share) go back too, once
  // mutex_ is released (a driver call). The unmaps this tick queues land within the mapper's
  // job time and wake every watcher (release_share): their handles go at that next tick.
  if (share_tick_locked(member)) backend_->release_cached();
}

bool PagePool::share_tick_locked(ShareMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return false;
  const int64_t requested = member.take_requested_limit();
  const int64_t pages = static_cast<int64_t>(pages_.size());
  if (requested >= 0) {
    policy_.set_operator(
        requested == 0 ? -1 : std::clamp<int64_t>(requested / member.page_bytes(), 1, pages));
  }
  // Note [Limit policy]: under the share's pressure this pool is held to its demand-weighted
  // fair share (Note [Fair share under pressure] in ledger.h).
  const Clock::time_point now = Clock::now();
  publish_demand(now);
  const ShareMember::Fair fair = member.fair_share();
  const bool changed = policy_.set_share(fair.pressure, fair.fair, fair.guaranteed, fair.equal_share, now);
  if (changed || requested >= 0) limit_changed(/*fail_above_own=*/requested >= 0);
  // Memory may have been released elsewhere in the share: serve, map, give back, refill.
  serve_waiters();
  plan_maps();
  plan_unmaps();
  plan_refill();
  const int64_t page_bytes = member.page_bytes();
  // Note [Blocks and pages]: pages may hold different numbers of blocks; used bytes are counted
  // at the fewest a page holds (an upper bound).
  const int64_t bpp = std::max<int64_t>(min_page_blocks_, 1);
  std::string op;
  double age = 0.0;
  if (current_job_) {
    op = std::string(job_name(current_job_->kind)) + " of " +
         std::to_string(current_job_->pages.size()) + " page(s)";
    age = std::chrono::duration<double>(Clock::now() - current_job_start_).count();
  }
  member.publish(
      (count_[(int)PageState::kFree] + count_[(int)PageState::kInUse]) * page_bytes,
      count_[(int)PageState::kFree] * page_bytes, used_blocks_ * page_bytes / bpp,
      std::min<int64_t>(policy_.limit(), static_cast<int64_t>(pages_.size())) * page_bytes,
      static_cast<int64_t>(pages_.size()) * page_bytes, static_cast<int64_t>(waiters_.size()), op,
      age);
  return policy_.pressure();
}

}  // namespace kvasync
