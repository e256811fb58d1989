// PagePool: page states, block free lists, waiters and the mapper's job queue.
//
// Note [Page states]
// ~~~~~~~~~~~~~~~~~~
// Every page id is in exactly one state and counted there:
//
//   kUnmapped --(job queued)--> kMapping --(map ok)--> kFree <--(first alloc / last free)--> kInUse
//       ^                          |  (map failed, job dropped)   |
//       +--------------------------+                              | (unmap queued)
//       +------------------------(unmap done)---- kUnmapping <----+
//
// kFree pages are mapped with every block free: they are the reserve. kMapping and kUnmapping
// pages are owned by the mapper ("in flight"); that is a state of its own and is never read as
// "out of pages". A page's blocks are allocatable only in kFree and kInUse.
//
// Note [Waiters]
// ~~~~~~~~~~~~~~
// An alloc that fits in mapped free blocks completes at once, on the caller's thread. Otherwise it
// becomes a waiter (first come, first served) and, if memory allows, a map job is queued for the
// pages it lacks. Waiters are served strictly in order as blocks appear (maps done, blocks freed).
// A later request may still take mapped free blocks that no waiter is counting on: waiters first
// count on pages being mapped *for them*, and only the demand those pages do not cover protects
// the free blocks. So a stuck map never blocks allocations of blocks already mapped, and a waiter
// blocked at the memory limit is never starved by later small requests.
// The reserve refill never counts as incoming for a waiter (Note [Reserve] in DESIGN: the reserve
// is an optimisation, never a dependency).
//
// Note [Unmap safety]
// ~~~~~~~~~~~~~~~~~~~~
// A mapping is never changed under running device work. free(blocks, fence) attaches the fence
// (device work that still uses those blocks) to their pages; an unmap job carries its pages'
// fences and the mapper waits for each, polled with the job's deadline (no device-wide sync),
// before the backend call. A fence not done by then fails the job and the pages stay mapped.
// Fences are reference-counted by the pages that hold them and released once, when the last of
// those pages is unmapped (or at close).
//
// What the pool may hold, what of its reserve it keeps, the drain of pages over a lowered limit
// and trim(): Note [Limit policy] in limit_policy.h.
//
// Note [Mapper deadlines]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Jobs (map for a request, refill the reserve, unmap) carry a deadline and the mapper takes the
// earliest first. A job whose deadline has passed is dropped before it reaches the backend and its
// pages go back to their previous state. Nothing here waits: the pool's mutex is held for
// bookkeeping only, never across a backend call, and there is no condition variable.
//
// Note [Fences outside the lock]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Releasing a fence is a driver call (cuEventDestroy on cuda), so it never happens under mutex_:
// the code holding the lock only collects fences no page holds any more (unused_fences_), and
// FenceReleasingLock releases them after unlocking, on every exit path, exceptions included.
// Note [Blocks and pages]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Block i sits at byte i * block_bytes of every range (one fixed stride, so that a range is one
// [num_blocks, ...] tensor) and page p covers bytes [p * page_bytes, (p + 1) * page_bytes).
// When page_bytes is not a multiple of block_bytes, a block can straddle a page boundary: such a
// block would need two pages mapped and would pin both, so it is never handed out (at most one
// per page boundary). Page p holds the whole blocks [first_block, first_block + num_blocks);
// block -> page is one division (block * block_bytes / page_bytes), and the block after a page's
// last whole block is its straddler. The memory limit promises `limit_pages * min_page_blocks`
// blocks (the fewest any full page holds): requests above that are refused at once, so no waiter
// ever depends on which pages happen to be mapped. kvasync's layout picks page sizes that lose
// at most 1/32 of the memory this way (KVLayout.page_unit).
//
// Note [Budget off the caller's thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In a share, every map is charged to the ledger before it reaches the backend (Note [Share
// ledger]): maps for waiters, refills of the reserve and alloc_nowait's maps alike. Charging
// takes the ledger's lock, which another process holds now and then, and may hold for long (a
// stopped or stuck process). The caller's thread (an event loop) and the watcher plan maps under
// mutex_, so there a charge only *tries* the lock, never waits for it: when it is busy, a map
// for demand (a waiter, alloc_nowait) is queued uncharged (Job::charge_pending) and the mapper
// charges it before running it, waiting for the lock there (mutex_ not held) with a deadline; a
// refill is dropped (the reserve is never a dependency), and none is planned while such a map
// waits for its charge: a refill that found the lock free in the meantime would take the budget
// that map waits for (a fresh pool's page 0 then lost to the refill's higher pages). Pages not
// granted go back unmapped. A lock that stayed busy is not a budget shortage: the pool does
// not mark itself blocked (which would make the other members give memory back for nothing);
// the watcher's next tick plans the map again, and a waiter that times out meanwhile names the
// lock's holder. Members keep serving from the blocks they have mapped: only new maps need the
// lock.
//
// lock order: GIL -> PagePool::mutex_ -> CompletionQueue::mutex_
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "backends/backend.h"
#include "pool/completion_queue.h"
#include "pool/limit_policy.h"
#include "ledger/ledger.h"
#include "pool/mapper.h"
#include "pool/page_set.h"

namespace kvasync {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: the clock of asyncio's loop.time()

enum class PageState : uint8_t { kUnmapped, kMapping, kFree, kInUse, kUnmapping };
enum class JobKind : uint8_t { kMapForRequest, kRefill, kUnmap };

struct PoolConfig {
  int64_t num_blocks = 0;
  int64_t blocks_per_page = 0;  // pages hold exactly this many blocks; 0 with block_bytes
  int64_t limit_pages = 0;  // physical budget, in page ids
  int64_t reserve_low = 0;
  int64_t reserve_high = 0;
  double default_timeout_s = 5.0;
  // Note [Limit policy]: the linger, seconds the pages in use at a recent peak stay mapped after
  // use falls; 0: none (the reserve goes down to reserve_high at once).
  double linger_s = 0.0;
  // Note [Blocks and pages]: with block_bytes > 0, a block takes block_bytes in each range and a
  // page page_bytes, which need not be a multiple of it.
  int64_t block_bytes = 0;
  int64_t page_bytes = 0;
};

struct Job {
  JobKind kind;
  int64_t request_id;          // the waiter it maps for, or a barrier to complete; 0 = none
  std::vector<int64_t> pages;  // ascending
  Clock::time_point deadline;
  std::vector<uintptr_t> fences;  // unmap jobs: device work to wait for first
  int64_t seq = 0;                // queue order (Note [Limit policy]: trim); set by push_job
  bool keep_cached = false;       // a trim that keeps the backend's pooled handles
  // A map queued while the share's ledger lock was busy: the mapper charges it before it runs
  // (Note [Budget off the caller's thread]).
  bool charge_pending = false;
};

// One job holding the pages of `jobs` (map jobs, run as one batch).
Job merge_jobs(const std::vector<Job>& jobs);

// "map", "refill" or "unmap": how stats and the share's ledger name the mapper's current job.
const char* job_name(JobKind kind);

struct PoolStats {
  int64_t num_blocks, used_blocks, free_blocks, mapped_pages, reserve_pages, mapping_pages,
      unmapping_pages, unmapped_pages, waiters, queued_jobs, mapper_batches, maps_done, unmaps_done,
      map_errors,
      dropped_jobs, timeouts, limit_pages;
  int64_t limit_blocks;     // blocks the memory limit promises (Note [Blocks and pages])
  int64_t unusable_blocks;  // ids in range(num_blocks) never handed out: across a page boundary
  std::string mapper_op;  // empty when idle
  double mapper_op_age_s;
  std::string last_error;
};

class PagePool : public std::enable_shared_from_this<PagePool> {
 public:
  // `share` (optional) joins the pool to a device's share ledger (Note [Share ledger]).
  static std::shared_ptr<PagePool> create(std::shared_ptr<Backend> backend, PoolConfig config,
                                          std::shared_ptr<ShareMember> share = nullptr);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Hot path and waits. An alloc returns its blocks, or the id of the waiter it became.
  // `deadline_s` is a CLOCK_MONOTONIC time in seconds, or negative for now + default_timeout.
  std::variant<std::vector<int64_t>, int64_t> alloc(int64_t n, double deadline_s);
  // On a miss, starts mapping what the request lacks into the reserve (Note [Limit policy]).
  // `map_on_miss` false: a pure try (the async alloc's hot path), which changes nothing on a miss.
  std::optional<std::vector<int64_t>> alloc_nowait(int64_t n, bool map_on_miss = true);
  // Blocks an alloc could get now or by mapping within the memory limit (less waiters' demand).
  int64_t available_blocks() const;
  // The blocks the caller (an engine's scheduler) wants now: held plus about to be asked for. In
  // a share it sets this pool's demand for kDemandTtl (Note [Fair share under pressure] in
  // ledger.h); what it claims beyond what the pool holds and waits for counts only while
  // requests follow it (Note [Demand claims] in limit_policy.h). Without a share it is only
  // recorded. Negative: std::invalid_argument.
  static constexpr auto kDemandTtl = std::chrono::seconds(5);
  void set_demand(int64_t blocks);
  // The free blocks an allocation would hand out, in the order take_blocks hands them out (lowest
  // page first, each page's most recently freed slot first), at most `limit` of them: blocks of
  // draining pages are not among them (Note [Limit policy]). A snapshot taken under mutex_ that
  // takes nothing; empty once closed. Negative limit: std::invalid_argument.
  std::vector<int64_t> free_blocks_in_order(int64_t limit) const;
  // Note [Limit policy]: the first block id of the draining pages, those this pool wants back
  // (a limit in force below what is mapped) and hands no block out from; -1 when none drains.
  int64_t drain_from_block() const;
  // Seconds each successful map job took since the last call (at most kMaxMapSamples kept),
  // for a metrics exporter's histogram.
  static constexpr size_t kMaxMapSamples = 4096;
  std::vector<double> take_map_seconds();
  // `fence` (0 = none) is device work still using the blocks; the pool takes ownership of it.
  void free(const std::vector<int64_t>& blocks, uintptr_t fence = 0);
  // Releases a fence that never reached free() (its ids could not even be read).
  void discard_fence(uintptr_t fence) { backend_->release_fence(fence); }
  // Removes a waiter. Returns what it was waiting for, or nothing when it is no longer waiting
  // (its completion is already queued). `timed_out` counts it in stats.
  std::optional<std::string> cancel(int64_t request_id, bool timed_out);
  std::vector<Completion> drain() { return completions_.drain(); }
  // The completion of `request_id`, taken alone, when the mapper's queued and current work is
  // expected to end within `max_spin_s`: the caller (the GIL released) spins for it that long
  // at most (Note [Spinning wake-up] in wakeup.h). Empty when it did not come, or when the work
  // is expected to take longer (then nothing spins).
  std::optional<Completion> take_completion(int64_t request_id, double max_spin_s);
  // The mapper's measure of its jobs: seconds per page, kept as a moving average per kind.
  void record_job_time(JobKind kind, double seconds, int64_t pages);
  int completion_fd() const { return completions_.fd(); }

  // Returns a barrier request id completed when the unmaps are done, or 0 when there is none.
  // `release_cached`: also give back what the backend keeps for quick re-mapping (cuda handles).
  int64_t trim(double deadline_s, bool release_cached = true);
  int64_t set_limit_pages(int64_t limit_pages, double deadline_s);
  // Returns true when the mapper thread was joined, false when it was abandoned at the deadline.
  // The pages mapped then are retired, not unmapped (Note [Views outlive close] in backend.h).
  bool close(double timeout_s);

  PoolStats stats() const;
  bool is_allocated(int64_t block) const;
  // The page holding block `block` whole, or -1 (across a page boundary, or out of range).
  int64_t page_of(int64_t block) const;
  const Backend& backend() const { return *backend_; }
  const PoolConfig& config() const { return config_; }

  // The mapper thread's side (mapper.cpp). The next jobs to run as one backend batch (the
  // earliest job, plus every other queued map when it maps); empty when there is none.
  static constexpr int64_t kMaxBatchPages = 512;
  std::vector<Job> next_batch();
  // `still_mapped`: pages the job leaves mapped though it failed (ascending): the failed runs of
  // an unmap, or the runs of a failed map whose rollback unmap failed too. Empty otherwise.
  void finish_job(const Job& job, const BackendResult& result,
                  const std::vector<int64_t>& still_mapped);
  Backend& mutable_backend() { return *backend_; }

  // The share watcher's side (ledger.cpp): re-plans after memory was released in the share,
  // applies a limit set from outside, publishes this pool's figures into its entry.
  void on_share_tick(ShareMember& member);
  // The mapper's side of Note [Budget off the caller's thread]: charges the batch's jobs queued
  // while the ledger's lock was busy, waiting for the lock here (mutex_ not held) with a
  // deadline. Pages not granted go back unmapped; jobs left with no page leave the batch.
  void charge_pending(std::vector<Job>& batch);

 private:
  PagePool(std::shared_ptr<Backend> backend, PoolConfig config);

  struct Page {
    PageState state = PageState::kUnmapped;
    int64_t first_block = 0;  // Note [Blocks and pages]
    int32_t num_blocks = 0;   // whole blocks of this page inside num_blocks (the last may be short)
    int32_t used = 0;
    std::vector<int32_t> free_slots;  // stack of free block slots while mapped
    std::vector<uintptr_t> fences;    // Note [Unmap safety]
  };
  struct Waiter {
    int64_t id;
    int64_t n;
    Clock::time_point deadline;
  };

  struct PendingTrim {  // Note [Limit policy]: trim
    int64_t id;
    int64_t before_seq;  // waits for the maps queued before this
    Clock::time_point deadline;
    int64_t unmap_jobs;  // its unmap jobs still queued or running
    bool swept;          // the maps it waited for have landed and their pages were unmapped
    int64_t unmaps_before_seq;  // once swept: waits for the unmaps queued before this
    bool keep_cached;           // trim(release_handles=False): the backend keeps its handles
  };
  class FenceReleasingLock;  // Note [Fences outside the lock]

  // Fails before any allocation when the bookkeeping of `config` would cost too much memory.
  static void check_capacity(const PoolConfig& config);

  // All of these run with mutex_ held.
  bool trim_done(PendingTrim& trim);
  void settle_trims();
  bool finish_trim_unmap(int64_t request_id, const BackendResult& result);
  void job_left_flight(const Job& job);
  int64_t headroom_pages() const;
  int64_t limit_blocks(int64_t limit_pages) const;
  int64_t available_to_newcomer() const;
  bool draining() const;
  int64_t usable_free_blocks() const;  // free blocks outside draining pages (Note [Limit policy])
  void plan_drain();
  std::vector<int64_t> free_draining_pages(int64_t max_pages) const;
  std::vector<int64_t> take_blocks(int64_t n);
  void serve_waiters();
  void plan_maps();
  void plan_refill();
  void plan_unmaps();
  std::vector<int64_t> claim_unmapped(int64_t max_blocks, int64_t max_pages);
  std::vector<int64_t> highest_reserve(int64_t max_pages) const;
  void push_job(Job job);
  Job make_unmap_job(std::vector<int64_t> pages, int64_t request_id, Clock::time_point deadline);
  void drop_fences(const std::vector<int64_t>& pages);
  void set_state(int64_t page, PageState state);
  void add_mapped_blocks(int64_t page);
  void remove_mapped_blocks(int64_t page);
  void revert_job(const Job& job);
  void fail_waiter(int64_t request_id, CompletionStatus status, const std::string& message);
  std::string describe_wait(const Waiter& waiter) const;
  void check_open() const;
  bool try_charge_share(std::vector<int64_t>& pages, bool refill);
  int64_t demand_pages(Clock::time_point now) const;
  void publish_demand(Clock::time_point now);
  void release_share(int64_t pages);
  void limit_changed(bool fail_above_own);
  bool share_tick_locked(ShareMember& member);  // takes mutex_; returns the share's pressure

  std::shared_ptr<Backend> backend_;
  PoolConfig config_;
  CompletionQueue completions_;
  Mapper mapper_;

  mutable std::mutex mutex_;
  bool closed_ = false;
  std::vector<Page> pages_;
  int64_t block_bytes_ = 1, page_bytes_ = 1;  // Note [Blocks and pages]
  int64_t min_page_blocks_ = 0;               // fewest blocks of a page other than the last
  int64_t usable_blocks_ = 0;                 // blocks of all pages
  std::vector<uint8_t> block_used_;
  PageSet unmapped_;                  // kUnmapped page ids
  PageSet reserve_;                   // kFree page ids
  PageSet with_free_;                 // kFree and kInUse pages with a free block
  std::map<Clock::time_point, std::vector<Job>> jobs_;  // deadline-ordered
  std::deque<Waiter> waiters_;        // FIFO
  int64_t next_request_id_ = 1;
  int64_t count_[5] = {0, 0, 0, 0, 0};  // pages per PageState
  int64_t used_blocks_ = 0;
  int64_t free_blocks_ = 0;           // free blocks in kFree and kInUse pages
  int64_t waiting_blocks_ = 0;        // sum of waiters' n
  int64_t incoming_for_waiters_ = 0;  // blocks of kMapping pages of kMapForRequest jobs
  int64_t refill_pages_ = 0;          // kMapping pages of kRefill jobs
  // Pages of queued maps still to be charged (Job::charge_pending): no refill meanwhile (Note
  // [Budget off the caller's thread]).
  int64_t uncharged_pages_ = 0;
  LimitPolicy policy_;  // Note [Limit policy]
  int64_t maps_done_ = 0, unmaps_done_ = 0, map_errors_ = 0, dropped_jobs_ = 0, timeouts_ = 0;
  int64_t batches_ = 0;  // backend batches the mapper ran
  std::string last_error_;
  std::map<uintptr_t, int64_t> fence_refs_;  // fence -> pages holding it
  std::shared_ptr<ShareMember> share_;  // null: no share (Note [Share ledger])
  // Note [Budget off the caller's thread]: the pid holding the ledger's lock when a charge last
  // found it busy (-1: unknown holder), 0 once a charge got the lock.
  int32_t ledger_busy_pid_ = 0;
  int64_t reported_demand_ = 0;  // set_demand's blocks, in force until reported_until_
  Clock::time_point reported_until_{};
  DemandClaim claim_;  // Note [Demand claims]: whether the report's excess counts
  std::optional<Job> current_job_;
  std::vector<double> map_seconds_;  // take_map_seconds()
  Clock::time_point current_job_start_;
  std::vector<uintptr_t> unused_fences_;  // Note [Fences outside the lock]
  std::vector<PendingTrim> trims_;        // Note [Limit policy]: trim
  std::multiset<int64_t> maps_in_flight_;    // seq of every queued or running map job
  std::multiset<int64_t> unmaps_in_flight_;  // and unmap job
  int64_t next_job_seq_ = 1;
  double seconds_per_page_[2] = {0.0, 0.0};  // map (and refill), unmap: moving averages
};

}  // namespace kvasync
