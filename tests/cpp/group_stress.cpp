// group_stress: a tensor-parallel group (csrc/group) driven from several threads in one process.
//
// Note [Group stress]
// ~~~~~~~~~~~~~~~~~~~
// Rationale: the group's contract (Note [Tensor parallel group] in group_file.h) is about races --
// an alloc completes only when every rank has mapped, a failed map is undone everywhere, every
// wait has a deadline, ranks and the group and the pool close while maps are in flight -- and the
// Python tests (tests/test_tensor_parallel.py) run one scenario per test in real processes. This
// program races them all in one process, built under ThreadSanitizer and under AddressSanitizer
// + UBSan (`make sanitize`), so a data race, a use after free, a leak or a bad mapping fails
// `make test`. Processes are not needed for that: the ring, the futexes and the file are the same
// when the scheduler and its ranks are threads of one process.
// Approach: rounds of a fraction of a second. Each opens a group of 1-4 ranks in /dev/shm and
//   PagePool -> Observer (this file: checks every map and unmap as the pool sees it returned)
//     -> GroupBackend (map_local true or false) -> Device (this file) -> HostBackend
// and per rank a RankMapper on
//   FaultBackend (delays, hangs, map failures; on most ranks) -> Device -> HostBackend,
// where Device is the real host backend, watched: the pages it really holds, and when each was
// last mapped and unmapped (an event counter), with unmap failures injected on ranks. A rank may
// start late. Then at once: workers (alloc with deadlines, alloc_nowait, free, trim,
// set_limit_pages), a drainer (the completion records), a chaos thread (each rank's faults on and
// off; the group's views read meanwhile, never more jobs done than posted), a watcher (each
// rank's committed pages, listed as a rank's process would use them), and an events thread
// that, at random moments, closes a rank (it leaves mid-map), closes the group while maps are in
// flight, and closes the pool.
// Checks, failing the run at once (exit 1) with what broke:
//  - an alloc that completes has its pages mapped on every rank still in the group (the rank's
//    mapped_page_ids() and its device hold them), and on the scheduler's device when map_local;
//    each block is written through every such range base (a bad mapping faults, which the
//    sanitizers report) and its mark is read back intact when it is freed (no page was unmapped
//    or remapped under a holder);
//  - a map the group reports done was held by every rank's device at some moment after it was
//    asked for, and every rank still in the group holds its pages committed (its process may use
//    them); a failed map leaves its pages on no rank still in the group (nor locally), unless
//    its error says the rollback is pending, and no rank listed them committed at any moment
//    after its device mapped them; an unmap that fails leaves its pages mapped on every device
//    still in the group (the pool keeps them, and hands their blocks out again);
//  - no device maps a page it holds or unmaps one it does not, and its calls never overlap;
//  - every wait returns by its deadline plus kSlack: GroupBackend::map and unmap (the group's
//    timeouts), RankMapper::close and wait_left, SchedulerGroup::wait_ready, PagePool::close, a
//    request's record once cancel() said it was queued;
//  - at the end: every rank has left and holds no page (unless its close abandoned a stuck
//    mapper thread, which then ends by itself), the group's file is gone, every object is freed
//    (ASan's leak check at exit).
// Limitations: one process, so the liveness paths (a rank or scheduler killed, pid reuse) are the
// Python tests' business. --seed repeats each thread's choices, not the interleaving.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backends/fault_backend.h"
#include "backends/host_backend.h"
#include "common/errors.h"
#include "group/group_backend.h"
#include "group/rank_mapper.h"
#include "pool/page_pool.h"
#include "stress_check.h"

namespace {

using kvasync::BackendResult;
using kvasync::Clock;
using stress::fail;
using stress::monotonic_s;
using stress::Seconds;

Clock::time_point after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(s));
}
double since(Clock::time_point start) { return Seconds(Clock::now() - start).count(); }

// Sanitizers slow everything down several times, on a shared machine: generous, still bounded.
constexpr double kSlack = 2.0;
constexpr int64_t kPageSize = 4096;

struct Counts {
  std::atomic<int64_t> rounds{0}, local_rounds{0}, ranks{0}, faulted_ranks{0}, late_ranks{0},
      allocs_now{0}, allocs_waited{0}, allocs_failed{0}, alloc_timeouts{0}, nowaits{0},
      frees{0}, trims{0}, resizes{0}, closed_errors{0}, out_of_blocks{0}, block_checks{0},
      group_maps_ok{0}, group_maps_failed{0}, rollbacks_pending{0}, group_unmaps_ok{0},
      group_unmaps_failed{0}, device_maps{0}, device_unmaps{0}, injected_unmap_failures{0},
      fault_changes{0}, rank_closes{0}, rank_closes_abandoned{0}, group_closes_racing{0},
      pool_closes_racing{0}, pool_closes_abandoned{0}, joins_refused{0}, wait_ready_failed{0};
};
Counts counts;

// Orders a map's start (Observer) against the backend calls it causes on each device.
std::atomic<uint64_t> event_clock{1};

// -----------------------------------------------------------------------------------------------
// Device: the host backend of one device (a rank's, or the scheduler's), watched.

class Device final : public stress::WrappingBackend<kvasync::HostBackend> {
 public:
  Device(std::string who, int num_ranges, int64_t num_pages, uint64_t seed)
      : WrappingBackend(std::make_shared<kvasync::HostBackend>(num_ranges, num_pages, kPageSize)),
        who_(std::move(who)),
        held_(static_cast<size_t>(num_pages), 0),
        mapped_at_(static_cast<size_t>(num_pages), 0),
        unmapped_at_(static_cast<size_t>(num_pages), 0),
        rng_(seed) {}

  const char* name() const override { return "device"; }

  BackendResult map(int64_t first, int64_t count) override { return call(true, first, count); }
  BackendResult unmap(int64_t first, int64_t count) override { return call(false, first, count); }
  // The pool's close (Note [Views outlive close]): checked and counted as an unmap.
  BackendResult retire(int64_t first, int64_t count, Clock::time_point deadline) override {
    return call(false, first, count, &deadline);
  }

  bool held(int64_t page) {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_[static_cast<size_t>(page)] != 0;
  }
  // Whether the page was mapped here at some moment since event `t0`.
  bool held_since(int64_t page, uint64_t t0) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t p = static_cast<size_t>(page);
    return held_[p] != 0 || mapped_at_[p] > t0 || unmapped_at_[p] > t0;
  }
  // Whether the page is mapped here by a call made after event `t0`.
  bool mapped_since(int64_t page, uint64_t t0) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t p = static_cast<size_t>(page);
    return held_[p] != 0 && mapped_at_[p] > t0;
  }
  // The event of the page's last map call here (0: never).
  uint64_t mapped_at(int64_t page) {
    std::lock_guard<std::mutex> lock(mutex_);
    return mapped_at_[static_cast<size_t>(page)];
  }
  int64_t held_count() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::count(held_.begin(), held_.end(), 1);
  }
  void set_unmap_failures(int pct) { unmap_fail_pct_ = pct; }

 private:
  BackendResult call(bool mapping, int64_t first, int64_t count,
                     const Clock::time_point* retire_by = nullptr) {
    CHECK(in_call_.fetch_add(1) == 0, who_ + ": two backend calls at once");
    struct Leave {
      std::atomic<int>& n;
      ~Leave() { n.fetch_sub(1); }
    } leave{in_call_};
    int roll;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      roll = static_cast<int>(rng_() % 100);
      for (int64_t p = first; p < first + count; ++p) {
        CHECK(held_[static_cast<size_t>(p)] == (mapping ? 0 : 1),
              who_ + (mapping ? ": map of a mapped page " : ": unmap of an unmapped page ") +
                  std::to_string(p));
      }
    }
    if (!mapping && roll < unmap_fail_pct_.load()) {  // before the real call: pages stay
      counts.injected_unmap_failures++;
      return BackendResult::failure("EBUSY: injected unmap failure");
    }
    BackendResult result = mapping     ? inner_->map(first, count)
                           : retire_by ? inner_->retire(first, count, *retire_by)
                                       : inner_->unmap(first, count);
    CHECK(result.ok, who_ + ": the host backend failed: " + result.error);
    const uint64_t now = event_clock.fetch_add(1);
    (mapping ? counts.device_maps : counts.device_unmaps) += count;
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t p = first; p < first + count; ++p) {
      held_[static_cast<size_t>(p)] = mapping ? 1 : 0;
      (mapping ? mapped_at_ : unmapped_at_)[static_cast<size_t>(p)] = now;
    }
    return result;
  }

  std::string who_;
  std::mutex mutex_;  // the vectors and rng_
  std::vector<uint8_t> held_;
  std::vector<uint64_t> mapped_at_, unmapped_at_;
  std::mt19937_64 rng_;
  std::atomic<int> in_call_{0};
  std::atomic<int> unmap_fail_pct_{0};
};

// -----------------------------------------------------------------------------------------------
// One round.

struct RankSlot {
  std::shared_ptr<Device> device;
  std::shared_ptr<kvasync::FaultState> faults;  // null: this rank's backend has no faults
  std::shared_ptr<kvasync::Backend> backend;
  // Readers: a check touching this rank's memory. The writer only flips `leaving`: whoever makes
  // the rank leave (its close, the group's close) takes it first, so a reader that saw the rank
  // in the group holds it there until it is done.
  std::shared_mutex guard;
  bool leaving = false;                         // under guard
  std::shared_ptr<kvasync::RankMapper> mapper;  // under guard; null until joined
  std::atomic<bool> abandoned{false};           // its close left a stuck thread behind
  Clock::time_point join_at{};
  // Per page: the latest event before a committed_page_ids() call that listed it (0: never).
  std::unique_ptr<std::atomic<uint64_t>[]> committed_seen;
};

struct Held {
  std::vector<int64_t> blocks;
  uint64_t mark;
};

class Round;

// The pool's backend: the group's, with every answer checked.
class Observer final : public stress::WrappingBackend<kvasync::GroupBackend> {
 public:
  Observer(std::shared_ptr<kvasync::GroupBackend> inner, Round& round)
      : WrappingBackend(std::move(inner)), round_(round) {}
  const char* name() const override { return inner_->name(); }
  BackendResult map(int64_t first, int64_t count) override;
  BackendResult unmap(int64_t first, int64_t count) override;
  // The pool's close (Note [Views outlive close]): checked as an unmap.
  BackendResult retire(int64_t first, int64_t count, Clock::time_point deadline) override;

 private:
  Round& round_;
};

class Round {
 public:
  Round(uint64_t seed, double seconds, int index) : rng_(seed), seconds_(seconds) {
    num_ranks_ = 1 + static_cast<int>(rng_() % 4);
    num_ranges_ = 1 + static_cast<int>(rng_() % 2);
    num_pages_ = 4 + static_cast<int64_t>(rng_() % 21);
    bpp_ = int64_t{1} << (rng_() % 4);  // 1..8 blocks of 4096 / bpp bytes each
    map_local_ = index % 2 == 0;        // alternate rounds: the EngineCore's case, no local map
    map_timeout_ = 0.05 + (rng_() % 250) / 1000.0;
    unmap_timeout_ = 0.05 + (rng_() % 250) / 1000.0;
    path_ = "/dev/shm/kvasync-group-stress-" + std::to_string(getpid()) + "-" +
            std::to_string(index);
    name_ = "stress-" + std::to_string(index);
    group_ = kvasync::SchedulerGroup::create(path_, name_, num_ranks_, num_ranges_, num_pages_,
                                             kPageSize);
    for (int r = 0; r < num_ranks_; ++r) {
      auto slot = std::make_unique<RankSlot>();
      slot->device = std::make_shared<Device>("rank " + std::to_string(r), num_ranges_,
                                              num_pages_, rng_());
      slot->backend = slot->device;
      if (rng_() % 4 != 0) {
        slot->faults = std::make_shared<kvasync::FaultState>();
        slot->backend = std::make_shared<kvasync::FaultBackend>(slot->device, slot->faults);
        counts.faulted_ranks++;
      }
      // Now and then a rank that starts late, at times later than a map's timeout.
      const bool late = rng_() % 5 == 0;
      const double late_by = std::min(2 * map_timeout_, 0.8 * seconds_) * (rng_() % 100) / 100.0;
      slot->join_at = after(late ? late_by : 0.0);
      slot->committed_seen.reset(new std::atomic<uint64_t>[static_cast<size_t>(num_pages_)]);
      for (int64_t p = 0; p < num_pages_; ++p) slot->committed_seen[p] = 0;
      if (late) counts.late_ranks++;
      ranks_.push_back(std::move(slot));
    }
    counts.ranks += num_ranks_;
    local_ = std::make_shared<Device>("the scheduler", num_ranges_, num_pages_, rng_());
    auto group_backend = std::make_shared<kvasync::GroupBackend>(local_, group_, map_timeout_,
                                                                 unmap_timeout_, map_local_);
    kvasync::PoolConfig config{num_pages_ * bpp_,
                               bpp_,
                               1 + static_cast<int64_t>(rng_() % num_pages_),
                               static_cast<int64_t>(rng_() % 2),
                               static_cast<int64_t>(rng_() % 3),
                               0.5};
    config.reserve_high = std::max(config.reserve_high, config.reserve_low);
    pool_ = kvasync::PagePool::create(std::make_shared<Observer>(group_backend, *this), config);
    owner_.reset(new std::atomic<uint8_t>[static_cast<size_t>(num_pages_ * bpp_)]);
    for (int64_t b = 0; b < num_pages_ * bpp_; ++b) owner_[b] = 0;
    if (map_local_) counts.local_rounds++;
  }

  void run() {
    const auto end = after(seconds_);
    std::vector<std::thread> threads;
    threads.emplace_back([this] { join_ranks(); });
    if (rng_() % 3 == 0) wait_ready(0.01 + (rng_() % 50) / 1000.0);
    for (int w = 0; w < 3; ++w) threads.emplace_back([this, w] { worker(seed_for(w)); });
    threads.emplace_back([this] { chaos(seed_for(10)); });
    threads.emplace_back([this] { watch_committed(); });
    threads.emplace_back([this] { events(seed_for(20)); });
    // The drainer outlives the workers: a worker's last request still gets its record.
    std::thread drain([this] { drainer(); });
    // The round ends at its time, or shortly after a close: the calls racing the close are what
    // matters then, not a closed pool or a broken group refusing them for the rest of the round.
    while (Clock::now() < end && !(closed_ && Clock::now() > closed_at_.load() + kAfterClose)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    stop_ = true;
    for (std::thread& t : threads) t.join();
    drained_ = true;
    drain.join();
    finish();
    counts.rounds++;
  }

  // Observer's checks (the pool's mapper thread, or close's thread once it is joined).
  BackendResult observe_map(kvasync::GroupBackend& inner, int64_t first, int64_t count) {
    const uint64_t t0 = event_clock.fetch_add(1);
    const auto start = Clock::now();
    const BackendResult result = inner.map(first, count);
    const double took = since(start);
    CHECK(took <= map_timeout_ + kSlack, "GroupBackend::map took " + std::to_string(took) +
                                             " s, its timeout is " + std::to_string(map_timeout_));
    if (result.ok) {
      counts.group_maps_ok++;
      for (int r = 0; r < num_ranks_; ++r) {
        for (int64_t p = first; p < first + count; ++p) {
          CHECK(ranks_[r]->device->held_since(p, t0),
                "the group mapped page " + std::to_string(p) + " though rank " +
                    std::to_string(r) + " never held it after the map was asked for");
        }
      }
      if (map_local_) {
        for (int64_t p = first; p < first + count; ++p) {
          CHECK(local_->held(p), "the group mapped page " + std::to_string(p) +
                                     " though the scheduler's device does not hold it");
        }
      }
      // Committed on every rank still in the group: a rank's process may use them now.
      for (int r = 0; r < num_ranks_; ++r) {
        std::shared_lock<std::shared_mutex> lock(ranks_[r]->guard);
        if (ranks_[r]->leaving || !ranks_[r]->mapper) continue;
        const std::vector<int64_t> committed = ranks_[r]->mapper->committed_page_ids();
        for (int64_t p = first; p < first + count; ++p) {
          CHECK(std::binary_search(committed.begin(), committed.end(), p),
                "the group mapped page " + std::to_string(p) + " but rank " + std::to_string(r) +
                    " does not hold it committed");
        }
      }
      return result;
    }
    counts.group_maps_failed++;
    CHECK(result.error.rfind("TP_GROUP: ", 0) == 0, "an error not named: " + result.error);
    const bool pending = result.error.find("rollback") != std::string::npos;
    if (pending) counts.rollbacks_pending++;
    for (int64_t p = first; p < first + count; ++p) {
      CHECK(!local_->held(p), "a failed map left page " + std::to_string(p) +
                                  " on the scheduler's device: " + result.error);
      if (pending) continue;
      for (int r = 0; r < num_ranks_; ++r) {
        std::shared_lock<std::shared_mutex> lock(ranks_[r]->guard);
        if (ranks_[r]->leaving) continue;
        // A rank may hold a page from before (its unmap failed, or an earlier rollback was
        // not posted): only what this map mapped must be gone.
        CHECK(!ranks_[r]->device->mapped_since(p, t0),
              "a failed map left page " + std::to_string(p) + " mapped on rank " +
                  std::to_string(r) + ", with no rollback pending: " + result.error);
      }
    }
    // No rank listed a page of this failed map as committed at any moment after its device
    // mapped it (watch_committed): its process would have written it, and the rollback unmapped
    // it under the write. (A page it held from before keeps no device call after t0.)
    for (int r = 0; r < num_ranks_; ++r) {
      for (int64_t p = first; p < first + count; ++p) {
        const uint64_t mapped_at = ranks_[r]->device->mapped_at(p);
        if (mapped_at <= t0) continue;
        CHECK(ranks_[r]->committed_seen[p].load() <= mapped_at,
              "rank " + std::to_string(r) + " listed page " + std::to_string(p) +
                  " as committed, mapped by a map that failed: " + result.error);
      }
    }
    return result;
  }

  BackendResult observe_unmap(kvasync::GroupBackend& inner, int64_t first, int64_t count,
                              const Clock::time_point* retire_by = nullptr) {
    const auto start = Clock::now();
    const BackendResult result =
        retire_by ? inner.retire(first, count, *retire_by) : inner.unmap(first, count);
    const double took = since(start);
    CHECK(took <= unmap_timeout_ + kSlack,
          "GroupBackend::unmap took " + std::to_string(took) + " s, its timeout is " +
              std::to_string(unmap_timeout_));
    if (result.ok) {
      counts.group_unmaps_ok++;
      for (int64_t p = first; p < first + count; ++p) {
        CHECK(!map_local_ || !local_->held(p),
              "an unmap done left page " + std::to_string(p) + " on the scheduler's device");
      }
      return result;
    }
    // The pool keeps the pages of a failed unmap as mapped and hands their blocks out again:
    // they must still be mapped on every device of the group.
    counts.group_unmaps_failed++;
    for (int64_t p = first; p < first + count; ++p) {
      CHECK(!map_local_ || local_->held(p),
            "a failed unmap (kept mapped by the pool) left page " + std::to_string(p) +
                " unmapped on the scheduler's device: " + result.error);
      for (int r = 0; r < num_ranks_; ++r) {
        std::shared_lock<std::shared_mutex> lock(ranks_[r]->guard);
        if (ranks_[r]->leaving || !ranks_[r]->mapper) continue;
        CHECK(ranks_[r]->device->held(p),
              "a failed unmap (kept mapped by the pool) left page " + std::to_string(p) +
                  " unmapped on rank " + std::to_string(r) + ": " + result.error);
      }
    }
    return result;
  }

 private:
  uint64_t seed_for(int salt) {
    std::lock_guard<std::mutex> lock(mutex_);
    return rng_() ^ static_cast<uint64_t>(salt);
  }

  // --- ranks -----------------------------------------------------------------------------------

  void join_ranks() {
    std::vector<int> order(static_cast<size_t>(num_ranks_));
    for (int r = 0; r < num_ranks_; ++r) order[static_cast<size_t>(r)] = r;
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return ranks_[a]->join_at < ranks_[b]->join_at; });
    for (int r : order) {
      RankSlot& slot = *ranks_[r];
      // A rank process that starts late (not a wait for anything to settle).
      std::this_thread::sleep_until(slot.join_at);
      std::shared_ptr<kvasync::RankMapper> mapper;
      const double timeout = 0.3;
      const auto start = Clock::now();
      try {
        mapper = kvasync::RankMapper::join(path_, name_, r, slot.backend, timeout);
      } catch (const kvasync::GroupError& e) {
        const double took = since(start);
        CHECK(took <= timeout + kSlack, "RankMapper::join took " + std::to_string(took) + " s");
        // Only a group closed before the rank started refuses it here.
        CHECK(group_closed_.load(), std::string("a rank of an open group was refused: ") +
                                        e.what());
        counts.joins_refused++;
        continue;
      }
      std::unique_lock<std::shared_mutex> lock(slot.guard);
      slot.mapper = std::move(mapper);
    }
  }

  void wait_ready(double timeout) {
    const auto start = Clock::now();
    try {
      group_->wait_ready(timeout);
    } catch (const kvasync::GroupError& e) {
      CHECK(std::string(e.what()).find("never joined") != std::string::npos,
            std::string("wait_ready failed for no rank missing: ") + e.what());
      counts.wait_ready_failed++;
    }
    const double took = since(start);
    CHECK(took <= timeout + kSlack, "wait_ready took " + std::to_string(took) + " s");
  }

  // Closes rank r's mapper (the rank leaves, unmapping what it holds).
  void close_rank(int r, double timeout) {
    RankSlot& slot = *ranks_[r];
    std::shared_ptr<kvasync::RankMapper> mapper;
    {
      std::unique_lock<std::shared_mutex> lock(slot.guard);
      slot.leaving = true;
      mapper = slot.mapper;
    }
    if (!mapper) return;  // not joined yet: finish() closes it
    const auto start = Clock::now();
    const bool joined = mapper->close(timeout);
    const double took = since(start);
    CHECK(took <= timeout + kSlack, "RankMapper::close took " + std::to_string(took) + " s");
    CHECK(mapper->left(), "a closed rank has not left");
    if (!joined) {
      slot.abandoned = true;
      counts.rank_closes_abandoned++;
    }
  }

  void close_group() {
    for (auto& slot : ranks_) {
      std::unique_lock<std::shared_mutex> lock(slot->guard);
      slot->leaving = true;
    }
    group_closed_ = true;
    group_->close();
  }

  bool close_pool(double timeout) {
    {
      std::unique_lock<std::shared_mutex> lock(pool_guard_);
      pool_closing_ = true;
    }
    const auto start = Clock::now();
    const bool joined = pool_->close(timeout);
    const double took = since(start);
    // A busy mapper gets `timeout` (an idle one a second), then each mapped page is unmapped
    // through the group, one unmap_timeout at most each.
    const double bound = std::max(timeout, 1.0) + num_pages_ * unmap_timeout_ + kSlack;
    CHECK(took <= bound, "PagePool::close took " + std::to_string(took) + " s");
    if (!joined) counts.pool_closes_abandoned++;
    return joined;
  }

  // --- checks of blocks handed out -------------------------------------------------------------

  // Every range of every device still in the group, at block b: fn(address).
  template <class Fn>
  void for_each_copy(const std::vector<int64_t>& blocks, const char* what, Fn&& fn) {
    std::shared_lock<std::shared_mutex> pool_lock(pool_guard_);
    if (pool_closing_) return;  // close unmaps everything, blocks held or not
    const int64_t block_bytes = kPageSize / bpp_;
    auto touch = [&](kvasync::Backend& backend, const std::string& who) {
      for (int64_t b : blocks) {
        for (int range = 0; range < num_ranges_; ++range) {
          fn(reinterpret_cast<volatile uint64_t*>(backend.range_base(range) + b * block_bytes),
             who + " range " + std::to_string(range) + " block " + std::to_string(b) + " (" +
                 what + ")");
        }
      }
    };
    if (map_local_) {
      for (int64_t b : blocks) {
        CHECK(local_->held(pool_->page_of(b)),
              "block " + std::to_string(b) + " handed out unmapped on the scheduler's device");
      }
      touch(*local_, "the scheduler's device");
    }
    for (int r = 0; r < num_ranks_; ++r) {
      RankSlot& slot = *ranks_[r];
      std::shared_lock<std::shared_mutex> lock(slot.guard);
      if (slot.leaving) continue;
      const std::vector<int64_t> ids = slot.mapper ? slot.mapper->mapped_page_ids()
                                                   : std::vector<int64_t>{};
      for (int64_t b : blocks) {
        const int64_t page = pool_->page_of(b);
        CHECK(page >= 0, "block " + std::to_string(b) + " has no page");
        CHECK(slot.device->held(page), "block " + std::to_string(b) + " (page " +
                                           std::to_string(page) + ") is not mapped on rank " +
                                           std::to_string(r));
        // Not joined yet (its mapper not published): its device is the record.
        CHECK(!slot.mapper || std::binary_search(ids.begin(), ids.end(), page),
              "rank " + std::to_string(r) + "'s mapped_page_ids() lacks page " +
                  std::to_string(page) + " of block " + std::to_string(b));
      }
      touch(*slot.device, "rank " + std::to_string(r));
    }
    counts.block_checks++;
  }

  void claim(const std::vector<int64_t>& blocks) {
    for (int64_t b : blocks) {
      CHECK(b >= 0 && b < num_pages_ * bpp_, "block id out of range: " + std::to_string(b));
      CHECK(owner_[b].exchange(1) == 0, "block " + std::to_string(b) + " handed out twice");
    }
  }
  void unclaim(const std::vector<int64_t>& blocks) {
    for (int64_t b : blocks) CHECK(owner_[b].exchange(0) == 1, "freeing a block not held");
  }

  void took_blocks(std::vector<int64_t> blocks) {
    claim(blocks);
    const uint64_t mark = next_mark_.fetch_add(1);
    for_each_copy(blocks, "alloc", [&](volatile uint64_t* at, const std::string&) { *at = mark; });
    std::lock_guard<std::mutex> lock(mutex_);
    held_.push_back({std::move(blocks), mark});
  }

  void give_back(Held held) {
    for_each_copy(held.blocks, "free", [&](volatile uint64_t* at, const std::string& where) {
      const uint64_t seen = *at;
      CHECK(seen == held.mark, where + ": its mark " + std::to_string(held.mark) + " reads " +
                                   std::to_string(seen) + " (unmapped or remapped while held)");
    });
    unclaim(held.blocks);
    pool_->free(held.blocks);
    counts.frees++;
  }

  std::optional<Held> take_held(std::mt19937_64& rng) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_.empty()) return std::nullopt;
    const size_t k = rng() % held_.size();
    Held held = std::move(held_[k]);
    held_[k] = std::move(held_.back());
    held_.pop_back();
    return held;
  }

  // --- requests --------------------------------------------------------------------------------

  std::optional<kvasync::Completion> wait_record(int64_t id, Clock::time_point until) {
    std::unique_lock<std::mutex> lock(records_mutex_);
    records_cv_.wait_until(lock, until, [&] { return records_.count(id) != 0; });
    auto it = records_.find(id);
    if (it == records_.end()) return std::nullopt;
    kvasync::Completion c = std::move(it->second);
    records_.erase(it);
    return c;
  }

  // A request's record by `until`, else it is cancelled; a record that cancel() says is queued
  // must come within kSlack.
  std::optional<kvasync::Completion> settle(int64_t id, Clock::time_point until) {
    if (auto c = wait_record(id, until)) return c;
    if (pool_->cancel(id, true)) {
      std::lock_guard<std::mutex> lock(records_mutex_);
      cancelled_.push_back(id);
      return std::nullopt;
    }
    auto c = wait_record(id, after(kSlack));
    CHECK(c.has_value(), "request " + std::to_string(id) +
                             ": cancel() said its record was queued, and it never came");
    return c;
  }

  // A barrier (trim, set_limit_pages) given up at its deadline: its record may still come, or
  // not; it carries no blocks either way.
  void settle_barrier(int64_t id, Clock::time_point until) {
    if (auto c = wait_record(id, until)) {
      CHECK(c->blocks.empty(), "a barrier's record with blocks");
      return;
    }
    CHECK(!pool_->cancel(id, true), "cancel() described a barrier as a waiter");
  }

  void drainer() {
    const int fd = pool_->completion_fd();
    while (!drained_) {
      pollfd ready{fd, POLLIN, 0};
      poll(&ready, 1, 5);
      std::vector<kvasync::Completion> got = pool_->drain();
      if (got.empty()) continue;
      {
        std::lock_guard<std::mutex> lock(records_mutex_);
        for (kvasync::Completion& c : got) records_[c.request_id] = std::move(c);
      }
      records_cv_.notify_all();
    }
  }

  void worker(uint64_t seed) {
    std::mt19937_64 rng(seed);
    while (!stop_) {
      const int op = static_cast<int>(rng() % 100);
      try {
        if (op < 35) {
          const int64_t n = 1 + static_cast<int64_t>(rng() % (2 * bpp_));
          const double wait = 0.01 + (rng() % 300) / 1000.0;
          auto result = pool_->alloc(n, monotonic_s() + wait);
          if (auto* blocks = std::get_if<std::vector<int64_t>>(&result)) {
            counts.allocs_now++;
            took_blocks(std::move(*blocks));
          } else if (auto c = settle(std::get<int64_t>(result), after(wait))) {
            if (c->status == kvasync::CompletionStatus::kOk) {
              counts.allocs_waited++;
              took_blocks(std::move(c->blocks));
            } else {
              CHECK(c->blocks.empty(), "a failed record with blocks");
              counts.allocs_failed++;
            }
          } else {
            counts.alloc_timeouts++;
          }
        } else if (op < 45) {
          if (auto blocks = pool_->alloc_nowait(1 + static_cast<int64_t>(rng() % bpp_))) {
            counts.nowaits++;
            took_blocks(std::move(*blocks));
          }
        } else if (op < 85) {
          if (auto held = take_held(rng)) give_back(std::move(*held));
        } else if (op < 93) {
          const double wait = 0.02 + (rng() % 300) / 1000.0;
          const int64_t id = pool_->trim(monotonic_s() + wait);
          counts.trims++;
          if (id != 0) settle_barrier(id, after(wait));
        } else if (op < 96) {
          const double wait = 0.02 + (rng() % 300) / 1000.0;
          const int64_t id = pool_->set_limit_pages(1 + static_cast<int64_t>(rng() % num_pages_),
                                                    monotonic_s() + wait);
          counts.resizes++;
          if (id != 0) settle_barrier(id, after(wait));
        } else {
          const kvasync::PoolStats s = pool_->stats();
          CHECK(s.mapped_pages + s.mapping_pages + s.unmapping_pages + s.unmapped_pages ==
                    num_pages_,
                "pages not each in one state");
        }
      } catch (const kvasync::AllocatorClosedError&) {
        counts.closed_errors++;
      } catch (const kvasync::OutOfBlocksError&) {
        counts.out_of_blocks++;  // above a lowered limit
      }
    }
  }

  // Each rank's faults on and off; the group's views read meanwhile (as `kvasync top` would).
  void chaos(uint64_t seed) {
    std::mt19937_64 rng(seed);
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 + rng() % 15));
      counts.fault_changes++;
      RankSlot& slot = *ranks_[static_cast<size_t>(rng() % ranks_.size())];
      const int what = static_cast<int>(rng() % 8);
      if (what == 0) {
        slot.device->set_unmap_failures(static_cast<int>(rng() % 40));
      } else if (what == 1) {
        slot.device->set_unmap_failures(0);
      } else if (slot.faults) {
        kvasync::FaultState& faults = *slot.faults;
        switch (what) {
          case 2: faults.set_delay((rng() % 10) / 1000.0); break;
          case 3: faults.set_delay(map_timeout_ * (0.5 + (rng() % 100) / 100.0)); break;
          case 4:
            faults.hang = true;  // a stuck driver call, longer than the map's timeout at times
            std::this_thread::sleep_for(Seconds(map_timeout_ * (rng() % 150) / 100.0));
            faults.hang = false;
            break;
          case 5: faults.fail_count = static_cast<int64_t>(1 + rng() % 3); break;
          default: faults.release(); break;
        }
      }
      for (const auto& view : group_->ranks()) {
        CHECK(view.rank >= 0 && view.rank < num_ranks_ && view.mapped_pages >= 0 &&
                  view.mapped_pages <= num_pages_,
              "a rank's view out of range");
        // One snapshot (SchedulerGroup::ranks): a rank never has done more than was posted.
        CHECK(view.jobs_done <= view.jobs_posted,
              "rank " + std::to_string(view.rank) + "'s view: " + std::to_string(view.jobs_done) +
                  " jobs done of " + std::to_string(view.jobs_posted) + " posted");
      }
      (void)group_->broken();
      (void)group_->closed();
    }
  }

  // A rank's process using what its mapper says is committed, as vLLM's worker does with the
  // null block's page: each listing is stamped, for observe_map's check of failed maps.
  void watch_committed() {
    while (!stop_) {
      for (auto& slot : ranks_) {
        std::shared_lock<std::shared_mutex> lock(slot->guard);
        if (!slot->mapper) continue;
        const uint64_t before = event_clock.fetch_add(1);
        for (int64_t p : slot->mapper->committed_page_ids()) {
          uint64_t seen = slot->committed_seen[p].load();
          while (seen < before && !slot->committed_seen[p].compare_exchange_weak(seen, before)) {
          }
        }
      }
      // Often enough to see a page between a rank's map and its rollback (a fault's delay, a
      // map's timeout), without taking a core from the threads under test.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // The racing closes: a rank leaving mid-map, the group closing while maps are in flight, the
  // pool closing. Each at a random moment of the round, or not at all.
  void events(uint64_t seed) {
    std::mt19937_64 rng(seed);
    struct Event {
      double at;
      int kind;  // 0: a rank closes, 1: the group closes, 2: the pool closes
    };
    std::vector<Event> plan;
    auto moment = [&] { return seconds_ * (0.1 + (rng() % 80) / 100.0); };
    if (rng() % 3 == 0) plan.push_back({moment(), 0});
    if (rng() % 4 == 0) plan.push_back({moment(), 1});
    if (rng() % 4 == 0) plan.push_back({moment(), 2});
    std::sort(plan.begin(), plan.end(), [](const Event& a, const Event& b) { return a.at < b.at; });
    const auto start = Clock::now();
    for (const Event& e : plan) {
      const auto at = start + std::chrono::duration_cast<Clock::duration>(Seconds(e.at));
      while (!stop_ && Clock::now() < at) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (stop_) return;
      if (!closed_) {
        closed_at_ = Clock::now();
        closed_ = true;
      }
      if (e.kind == 0) {
        counts.rank_closes++;
        // Now and then with the rank's mapper stuck in a map: its close must abandon it within
        // its timeout, and the group must still learn that the rank left.
        const int r = static_cast<int>(rng() % num_ranks_);
        const auto& faults = ranks_[r]->faults;
        const bool stuck = faults && rng() % 2 == 0;
        if (stuck) faults->hang = true;
        close_rank(r, (rng() % 100) / 1000.0);
        if (stuck) faults->hang = false;
      } else if (e.kind == 1) {
        counts.group_closes_racing++;
        close_group();
      } else {
        counts.pool_closes_racing++;
        close_pool((rng() % 200) / 1000.0);
      }
    }
  }

  // --- the end of a round ----------------------------------------------------------------------

  // Waits (bounded) until the mapper has nothing queued or running. The drainer has stopped:
  // the records left are those of barriers given up, with no blocks.
  void wait_idle() {
    const auto give_up = after(num_pages_ * (map_timeout_ + unmap_timeout_) + 5 * kSlack);
    while (true) {
      for (const kvasync::Completion& c : pool_->drain()) {
        CHECK(c.blocks.empty(), "blocks of request " + std::to_string(c.request_id) +
                                    " never taken");
      }
      const kvasync::PoolStats s = pool_->stats();
      if (s.queued_jobs + s.mapping_pages + s.unmapping_pages == 0 && s.mapper_op.empty()) return;
      CHECK(Clock::now() < give_up, "the mapper is still busy: " + s.mapper_op);
      pollfd ready{pool_->completion_fd(), POLLIN, 0};
      poll(&ready, 1, 1);
    }
  }

  void finish() {
    for (auto& slot : ranks_) {
      if (slot->faults) slot->faults->release();
      slot->device->set_unmap_failures(0);
    }
    // The records nobody waits for: trims given up late. Any alloc record among them would be
    // blocks handed to nobody; a record of a request cancelled while waiting must not exist.
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      for (int64_t id : cancelled_) {
        CHECK(records_.count(id) == 0,
              "a record for request " + std::to_string(id) + ", cancelled while waiting");
      }
      for (auto& [id, c] : records_) {
        CHECK(c.blocks.empty(), "blocks of request " + std::to_string(id) + " never taken");
      }
    }
    if (!pool_closing_) {
      // Everything back, then a trim once the mapper is idle: nothing stays mapped, on any
      // device still in the group. (Idle first: with slow ranks and a short default timeout an
      // unmap queued before the trim can be dropped at its deadline; the trim then sweeps again
      // (tests/test_pool_contract.py), but its own unmap may meet slow ranks too.)
      while (auto held = take_held(rng_)) give_back(std::move(*held));
      wait_idle();
      const int64_t id = pool_->trim(monotonic_s() + 5.0);
      if (id != 0) {
        // The drainer has stopped: this thread takes the records now.
        const auto give_up = after(5.0 + kSlack);
        std::optional<kvasync::Completion> c;
        while (!c) {
          CHECK(Clock::now() < give_up, "the final trim's barrier never completed");
          for (kvasync::Completion& got : pool_->drain()) {
            if (got.request_id == id) c = std::move(got);
          }
          pollfd ready{pool_->completion_fd(), POLLIN, 0};
          if (!c) poll(&ready, 1, 5);
        }
        CHECK(c->status == kvasync::CompletionStatus::kOk, "the final trim failed: " + c->message);
      }
      const kvasync::PoolStats s = pool_->stats();
      CHECK(s.used_blocks == 0 && s.waiters == 0, "blocks or waiters left after every free");
      CHECK(s.mapped_pages == 0,
            "the final trim left " + std::to_string(s.mapped_pages) + " page(s) mapped (" +
                std::to_string(s.reserve_pages) + " in the reserve, " +
                std::to_string(s.mapping_pages) + " mapping, " + std::to_string(s.queued_jobs) +
                " jobs queued, limit " + std::to_string(s.limit_pages) + ", " +
                std::to_string(s.dropped_jobs) + " jobs dropped; last error: " +
                s.last_error + ")");
      CHECK(!map_local_ || local_->held_count() == 0,
            "the scheduler's device holds pages the pool does not");
      CHECK(close_pool(5.0), "close did not join an idle mapper");
    } else {
      std::lock_guard<std::mutex> lock(mutex_);
      held_.clear();  // the pool is closed: its blocks are gone with it
    }
    if (!group_closed_) close_group();
    CHECK(access(path_.c_str(), F_OK) != 0, "the group's file outlived close()");
    for (int r = 0; r < num_ranks_; ++r) {
      RankSlot& slot = *ranks_[r];
      std::shared_ptr<kvasync::RankMapper> mapper;
      {
        std::unique_lock<std::shared_mutex> lock(slot.guard);
        mapper = std::move(slot.mapper);
      }
      if (!mapper) continue;  // refused: the group closed before it started
      if (!slot.abandoned) {
        const auto start = Clock::now();
        CHECK(mapper->wait_left(1.0), "rank " + std::to_string(r) + " did not leave");
        CHECK(since(start) <= 1.0 + kSlack, "wait_left overran its deadline");
        const auto closing = Clock::now();
        CHECK(mapper->close(1.0), "rank " + std::to_string(r) + "'s idle mapper not joined");
        CHECK(since(closing) <= 1.0 + kSlack, "close overran its deadline");
        const bool kept = mapper->left_reason().find("stayed mapped") != std::string::npos;
        CHECK(kept || (mapper->mapped_pages() == 0 && slot.device->held_count() == 0),
              "rank " + std::to_string(r) + " still holds " +
                  std::to_string(slot.device->held_count()) + " page(s) after leaving: " +
                  mapper->left_reason());
      }
      // An abandoned mapper thread ends by itself once its (released) fault returns; it holds
      // the last reference then. Wait for that, bounded.
      std::weak_ptr<kvasync::RankMapper> gone = mapper;
      mapper.reset();
      const auto give_up = after(kvasync::FaultState::kMaxHangSeconds);
      while (!gone.expired()) {
        CHECK(Clock::now() < give_up, "an abandoned rank mapper thread never ended");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    std::weak_ptr<kvasync::PagePool> pool_gone = pool_;
    pool_.reset();
    const auto give_up = after(map_timeout_ + 5 * kSlack);
    while (!pool_gone.expired()) {
      CHECK(Clock::now() < give_up, "an abandoned pool mapper thread never ended");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    group_.reset();
  }

  std::mt19937_64 rng_;
  double seconds_;
  int num_ranks_ = 0, num_ranges_ = 0;
  int64_t num_pages_ = 0, bpp_ = 1;
  bool map_local_ = true;
  double map_timeout_ = 0, unmap_timeout_ = 0;
  std::string path_, name_;
  std::shared_ptr<kvasync::SchedulerGroup> group_;
  std::vector<std::unique_ptr<RankSlot>> ranks_;
  std::shared_ptr<Device> local_;
  std::shared_ptr<kvasync::PagePool> pool_;
  std::unique_ptr<std::atomic<uint8_t>[]> owner_;
  std::atomic<uint64_t> next_mark_{1};
  std::atomic<bool> stop_{false};
  std::atomic<bool> drained_{false};  // the drainer's stop, once the workers have ended
  std::atomic<bool> closed_{false};  // something closed (a rank, the group, the pool)
  std::atomic<Clock::time_point> closed_at_{Clock::time_point{}};  // set before closed_
  static constexpr auto kAfterClose = std::chrono::milliseconds(50);
  std::atomic<bool> group_closed_{false};
  std::shared_mutex pool_guard_;  // readers: checks touching blocks; the writer: close_pool
  bool pool_closing_ = false;     // under pool_guard_

  std::mutex mutex_;  // rng_ (once the threads run) and held_
  std::vector<Held> held_;

  std::mutex records_mutex_;  // records_, cancelled_
  std::condition_variable records_cv_;
  std::map<int64_t, kvasync::Completion> records_;
  std::vector<int64_t> cancelled_;
};

BackendResult Observer::map(int64_t first, int64_t count) {
  return round_.observe_map(*inner_, first, count);
}
BackendResult Observer::unmap(int64_t first, int64_t count) {
  return round_.observe_unmap(*inner_, first, count);
}

BackendResult Observer::retire(int64_t first, int64_t count, Clock::time_point deadline) {
  return round_.observe_unmap(*inner_, first, count, &deadline);
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 5.0;
  uint64_t seed = 7;
  stress::parse_args(argc, argv, seconds, seed);
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(Seconds(seconds));
  std::mt19937_64 rng(seed);
  for (int index = 0; Clock::now() < end; ++index) {
    Round round(rng(), 0.15 + (rng() % 35) / 100.0, index);
    round.run();
  }
  std::printf("group_stress: seed %" PRIu64 ", %.1f s, %" PRId64 " rounds (%" PRId64
              " mapping locally), no failure\n",
              seed, since(start), counts.rounds.load(), counts.local_rounds.load());
  std::printf("  ranks: %" PRId64 " (%" PRId64 " with faults, %" PRId64 " late, %" PRId64
              " refused after the group closed)\n",
              counts.ranks.load(), counts.faulted_ranks.load(), counts.late_ranks.load(),
              counts.joins_refused.load());
  std::printf("  allocs: %" PRId64 " at once, %" PRId64 " after waiting, %" PRId64
              " failed, %" PRId64 " timed out; alloc_nowait: %" PRId64 "; %" PRId64
              " checks of blocks on every device\n",
              counts.allocs_now.load(), counts.allocs_waited.load(), counts.allocs_failed.load(),
              counts.alloc_timeouts.load(), counts.nowaits.load(), counts.block_checks.load());
  std::printf("  frees: %" PRId64 ", trims: %" PRId64 ", resizes: %" PRId64 "; %" PRId64
              " calls refused as closed, %" PRId64 " out of blocks\n",
              counts.frees.load(), counts.trims.load(), counts.resizes.load(),
              counts.closed_errors.load(), counts.out_of_blocks.load());
  std::printf("  group maps: %" PRId64 " ok, %" PRId64 " failed (%" PRId64
              " with a rollback pending); unmaps: %" PRId64 " ok, %" PRId64 " failed\n",
              counts.group_maps_ok.load(), counts.group_maps_failed.load(),
              counts.rollbacks_pending.load(), counts.group_unmaps_ok.load(),
              counts.group_unmaps_failed.load());
  std::printf("  devices: %" PRId64 " pages mapped, %" PRId64 " unmapped; faults: %" PRId64
              " changes, %" PRId64 " injected unmap failures on ranks\n",
              counts.device_maps.load(), counts.device_unmaps.load(), counts.fault_changes.load(),
              counts.injected_unmap_failures.load());
  std::printf("  racing closes: %" PRId64 " ranks (%" PRId64 " abandoned a stuck mapper), %" PRId64
              " groups, %" PRId64 " pools (%" PRId64 " abandoned a busy mapper); %" PRId64
              " wait_ready timeouts\n",
              counts.rank_closes.load(), counts.rank_closes_abandoned.load(),
              counts.group_closes_racing.load(), counts.pool_closes_racing.load(),
              counts.pool_closes_abandoned.load(), counts.wait_ready_failed.load());
  return 0;
}
