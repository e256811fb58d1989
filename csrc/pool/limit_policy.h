// LimitPolicy: what the page pool may hold now, and what of it is kept.
//
// Note [Limit policy]
// ~~~~~~~~~~~~~~~~~~~
// Several things change what a pool may hold: the user's limit (set_limit), the operator's
// (`kvasync limit`), a share under pressure (another member short of budget), the reserve's
// watermarks, a sync scheduler retrying alloc_nowait, and trim(). One object, LimitPolicy, takes
// all of them as inputs and makes the two decisions the pool acts on:
//
// 1. The effective limit (limit()): the pages the pool may hold now (mapping, mapped or
//    unmapping). It is the own limit (own_limit(): the operator's when set, else the user's)
//    and, while the share is under pressure, at most the share cap: the member's fair share
//    (its demand-weighted share of the budget; Note [Fair share under pressure] in ledger.h),
//    never below 1 page nor below its guaranteed minimum. The cap goes down at once and up only
//    kRegrowHold after its last step-down (the bound on oscillation), but never stays below the
//    guaranteed minimum in force, the highest of the last kRegrowHold: it rises at once and falls
//    as that peak ages past the hold (a demand that flaps does not move it, nor lift the cap
//    within the hold after a lower one), except to budget / members, at once: the hold is for
//    the member's own demand, and a member joining the share (or a lower budget) is no flap, so
//    a newcomer is not kept waiting by a minimum computed for fewer members. Pressure lifting
//    removes the cap after the same hold.
//    The own limit is a promise: an alloc above it is refused at once (OutOfBlocks); the share
//    cap is temporary, so a request above it waits instead (with its deadline).
//
// 2. What is kept:
//    - The reserve (mapped pages with every block free): reserve_to_keep() pages stay, the
//      highest others are unmapped. It keeps reserve_high pages, or the pages a missed
//      alloc_nowait asked for, whichever is more; nothing while the share is under pressure (it
//      goes back to the member short of budget). The reserve refills between reserve_low and
//      reserve_high, except after trim() until the next alloc (refill_wanted()): demand again.
//    - The nowait hold (was Note [Nowait maps]): a synchronous scheduler cannot await, it
//      retries alloc_nowait. So a miss maps what the request lacks (within the limit, less what
//      refills already bring; charged like any map in a share) into the reserve, held for
//      nobody: any alloc may take those pages. The reserve keeps them only for kNowaitHold after
//      the last miss, so that the retry finds them, and a caller that never comes back costs
//      nothing for long (the idle mapper re-checks, and unmaps them once the hold lapses).
//    - The linger: an engine's load comes in rounds and bursts with short gaps, and a reserve
//      cut to reserve_high at each gap makes the next burst map again what the last one just
//      gave back, while the engine admits requests (on the H200, vLLM's 1B rounds of 1.4 s ran
//      0.865x stock, each growing mapped KV from 2 to 6 GiB: bench/results/2026-12-03.md). With
//      a linger (PoolConfig::linger_s > 0), the pages in use at the recent peak stay mapped for
//      the linger after the peak was last reached (the first unmap decision after it starts
//      the linger), then what is in use then becomes the peak. Nothing lingers under the
//      share's pressure (the pages go to the member short of budget), over a lowered limit (the
//      drain and the unmaps of the pages over it come first), nor through trim(). The idle
//      mapper re-checks, so what lingered goes back within a poll of the linger's end. Off (0)
//      by default.
//    - The drain (was Note [Drain]): a limit lowered below what is mapped can unmap at once only
//      pages that are wholly free, and blocks of a busy engine are spread over many pages that
//      rarely empty by themselves. So the highest mapped pages over the limit drain
//      (plan_drain(), drain_from_page()): no block is handed out from them (allocation takes the
//      lowest pages first, and their free slots do not count as free: not for the fast path,
//      for waiters, nor for available_blocks), one that empties is unmapped at once (even while
//      requests wait: its blocks could not go to them), and drain_from_block() tells a
//      scheduler which blocks to give back. Pages still mapping count at their place (highest
//      first, as if landed): over the limit no waiter counts on them, and they drain when they
//      land, so that a lower page landed before them is not drained (and unmapped) in their
//      stead while a waiter waits for its blocks. So the lowest page held never drains. The
//      drain is re-planned as pages land or leave, and ends when the pool is within its limit
//      again or the limit is raised.
//    - trim() (was Note [Trim]) keeps nothing of the reserve, and its barrier promises: once it
//      completes, no page is mapped-free unless a request mapped it since (or a waiter counts
//      on it). So it cannot look at the reserve alone: a map queued or running when trim() is
//      called lands in the reserve afterwards. Every job gets a sequence number when queued; a
//      trim records the next one, unmaps the reserve at once and again each time a map queued
//      before it lands, and completes when none is left in flight and the unmaps queued up to
//      its last sweep are done (a bounded number of sweeps, even while frees go on). An unmap
//      it waited for that is dropped at its deadline (its pages mapped-free again) makes it
//      sweep again. A refill not yet started is dropped at once, and none is planned until the
//      next alloc.
//
// Invariants:
//   - 1 <= limit() <= own_limit(); limit() changes only through the inputs above.
//   - Under pressure, limit() >= min(own_limit(), max(1, guaranteed)) at every tick.
//   - The share cap rises only when kRegrowHold has passed since it last fell, or to a
//     guaranteed minimum higher than any in the last kRegrowHold (tests/test_share_policy.py).
//   - The guaranteed minimum in force never exceeds budget / members of the current membership.
//   - Pages held (mapping + mapped + unmapping) exceed limit() only after the limit was lowered,
//     and then only pages that are in use or on their way out: no map is planned beyond it, a
//     free page over it is unmapped, and the drain covers the rest.
//   - No block is handed out from a draining page; draining() implies the pool is over limit().
//   - The reserve kept is never a dependency: no waiter counts on a refill or on a hold.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <utility>

namespace kvasync {

class LimitPolicy {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int64_t kNoDrain = INT64_MAX;
  // How long the reserve keeps a missed alloc_nowait's pages.
  static constexpr auto kNowaitHold = std::chrono::seconds(1);
  // How long the share cap stays down after a step-down before it may rise again.
  static constexpr auto kRegrowHold = std::chrono::milliseconds(300);
  static constexpr int64_t kNoCap = INT64_MAX;

  LimitPolicy(int64_t limit_pages, int64_t reserve_low, int64_t reserve_high,
              Clock::duration linger = Clock::duration::zero())
      : configured_(limit_pages),
        reserve_low_(reserve_low),
        reserve_high_(reserve_high),
        linger_(linger) {
    update();
  }

  // Inputs. Each returns whether the effective limit changed.
  bool set_configured(int64_t pages);      // the user's limit (set_limit, resize)
  bool set_operator(int64_t pages);        // `kvasync limit`; -1: none (back to configured)
  // Each share tick: pressure, the fair share (-1: no budget), the guaranteed minimum and the
  // equal share (budget / members; what the minimum can be at most), pages.
  bool set_share(bool pressure, int64_t fair_pages, int64_t guaranteed_pages,
                 int64_t equal_share_pages, Clock::time_point now);
  void nowait_missed(int64_t blocks, Clock::time_point now);
  void nowait_served(int64_t blocks);
  bool hold_lapsed(Clock::time_point now);  // true once, when a hold has just lapsed
  // The linger: pages in use rose to `in_use` (called as pages go into use; no clock read). The
  // peak reached again starts its linger again.
  void in_use_rose(int64_t in_use) {
    if (linger_ > Clock::duration::zero() && in_use >= linger_peak_) {
      linger_peak_ = in_use;
      linger_restart_ = true;
    }
  }
  // Before each decision on what to keep: starts the linger after a new peak, ends a lapsed one.
  void observe_in_use(Clock::time_point now, int64_t in_use);
  bool linger_lapsed(Clock::time_point now);  // true once, when a linger has just lapsed
  void trimmed() { refill_paused_ = true; }
  void demanded() { refill_paused_ = false; }

  // Decisions.
  int64_t limit() const { return limit_; }
  int64_t own_limit() const { return operator_ < 0 ? configured_ : operator_; }
  bool pressure() const { return pressure_; }
  int64_t share_cap() const { return share_cap_; }  // kNoCap when none
  // `committed`: pages mapping, mapped or unmapping. Negative when over the limit.
  int64_t headroom(int64_t committed) const { return limit_ - committed; }
  // Pages of the reserve that stay; `min_page_blocks` converts the hold's blocks to pages;
  // `in_use`: pages in use now (what the linger keeps is the recent peak less these).
  int64_t reserve_to_keep(Clock::time_point now, int64_t min_page_blocks, int64_t in_use) const;
  // Pages a refill should map now, given the reserve (`have`: free pages and refills in flight).
  int64_t refill_wanted(int64_t have, int64_t headroom) const;

  // The drain: the lowest draining page, or kNoDrain. `mapped(page)` says whether a page is
  // held and not leaving (mapping, free or in use); pages are scanned from `num_pages - 1` down.
  template <class Mapped>
  void plan_drain(int64_t over, int64_t num_pages, Mapped&& mapped) {
    drain_from_ = kNoDrain;
    for (int64_t page = num_pages - 1; page >= 0 && over > 0; --page) {
      if (!mapped(page)) continue;
      drain_from_ = page;
      --over;
    }
  }
  bool draining(int64_t headroom) const { return drain_from_ != kNoDrain && headroom < 0; }
  bool drain_planned() const { return drain_from_ != kNoDrain; }
  int64_t drain_from_page() const { return drain_from_; }

 private:
  bool update();

  int64_t configured_;
  int64_t operator_ = -1;
  bool pressure_ = false;
  int64_t share_cap_ = kNoCap;
  Clock::time_point stepped_down_at_{};
  int64_t floor_ = 1;  // the guaranteed minimum in force (pages): the highest in minima_
  // The guaranteed minima of the last kRegrowHold that no later one reached, oldest first
  // (strictly decreasing): at most one per share tick of the hold.
  std::deque<std::pair<Clock::time_point, int64_t>> minima_;
  int64_t limit_ = 0;
  int64_t reserve_low_, reserve_high_;
  int64_t hold_blocks_ = 0;
  Clock::time_point hold_until_{};
  Clock::duration linger_;
  int64_t linger_peak_ = 0;  // pages in use at the recent peak
  bool linger_restart_ = false;  // a new peak, its linger not started yet
  bool linger_armed_ = false;  // pages linger now: the idle mapper must re-check at the end
  Clock::time_point linger_until_{};
  bool refill_paused_ = false;
  int64_t drain_from_ = kNoDrain;
};

// Note [Demand claims]
// ~~~~~~~~~~~~~~~~~~~~
// A share divides its budget by demand (Note [Fair share under pressure] in ledger.h), and part
// of a pool's demand is self-reported: Allocator.set_demand, an engine's count of what its
// requests are about to ask for. A report above what the pool holds and waits for is a *claim*:
// budget kept for this member before it asks. Nothing checks it, and a report can be renewed at
// will, so a member that only claims (a stuck scheduler, a misbehaving client) would keep the
// budget from the others for ever. So a claim is believed only while requests follow it:
//   - the first claim, and the first claim after a request, counts for kClaimHold;
//   - a request that needs pages (an alloc that waits, an alloc_nowait that misses and maps)
//     makes the claim count for kClaimHold after it, and a request still waiting keeps it
//     counting (the pool renews it as it publishes its demand, at least every watcher tick);
//   - a report renews nothing: reporting the claim again, or reporting what the pool holds and
//     reporting the claim anew, does not make it count again. Only a request does.
// What the pool holds and waits for is demand that needs no belief: it always counts.
// The bound: a claim not followed by a request stops counting kClaimHold after it was made, and
// the others see it gone at the claimer's next watcher tick (kTick, 100 ms) or sooner: within
// kClaimHold + kTick (tests/test_share_policy.py). A claim never keeps free budget from a member
// below its guaranteed minimum in the first place (ShareMember::grant); the hold only bounds how
// long a member above it waits on a claim nobody acts on.
class DemandClaim {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kClaimHold = std::chrono::seconds(1);

  // A report; `claim`: it is above what the pool holds and waits for.
  void reported(bool claim, Clock::time_point now) {
    if (!claim || !renewable_) return;
    until_ = std::max(until_, now + kClaimHold);
    renewable_ = false;
  }
  // A request that needs pages mapped, or one still waiting.
  void requested(Clock::time_point now) {
    until_ = std::max(until_, now + kClaimHold);
    renewable_ = true;
  }
  bool counts(Clock::time_point now) const { return now < until_; }

 private:
  Clock::time_point until_{};
  bool renewable_ = true;  // no claim was believed since the last request (or ever)
};

}  // namespace kvasync
