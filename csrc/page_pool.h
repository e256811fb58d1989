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
// Note [Mapper deadlines]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Jobs (map for a request, refill the reserve, unmap) carry a deadline and the mapper takes the
// earliest first. A job whose deadline has passed is dropped before it reaches the backend and its
// pages go back to their previous state. Nothing here waits: the pool's mutex is held for
// bookkeeping only, never across a backend call, and there is no condition variable.
// lock order: GIL -> PagePool::mutex_ -> CompletionQueue::mutex_
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "backend.h"
#include "completion_queue.h"
#include "ledger.h"
#include "mapper.h"
#include "page_set.h"

namespace kvasync {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: the clock of asyncio's loop.time()

enum class PageState : uint8_t { kUnmapped, kMapping, kFree, kInUse, kUnmapping };
enum class JobKind : uint8_t { kMapForRequest, kRefill, kUnmap };

struct PoolConfig {
  int64_t num_blocks = 0;
  int64_t blocks_per_page = 0;
  int64_t limit_pages = 0;  // physical budget, in page ids
  int64_t reserve_low = 0;
  int64_t reserve_high = 0;
  double default_timeout_s = 5.0;
};

struct Job {
  JobKind kind;
  int64_t request_id;          // the waiter it maps for, or a barrier to complete; 0 = none
  std::vector<int64_t> pages;  // ascending
  Clock::time_point deadline;
  std::vector<uintptr_t> fences;  // unmap jobs: device work to wait for first
};

// One job holding the pages of `jobs` (map jobs, run as one batch).
Job merge_jobs(const std::vector<Job>& jobs);

struct PoolStats {
  int64_t num_blocks, used_blocks, free_blocks, mapped_pages, reserve_pages, mapping_pages,
      unmapping_pages, unmapped_pages, waiters, queued_jobs, mapper_batches, maps_done, unmaps_done,
      map_errors,
      dropped_jobs, timeouts, limit_pages;
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
  std::optional<std::vector<int64_t>> alloc_nowait(int64_t n);
  // `fence` (0 = none) is device work still using the blocks; the pool takes ownership of it.
  void free(const std::vector<int64_t>& blocks, uintptr_t fence = 0);
  // Releases a fence that never reached free() (its ids could not even be read).
  void discard_fence(uintptr_t fence) { backend_->release_fence(fence); }
  // Removes a waiter. Returns what it was waiting for, or nothing when it is no longer waiting
  // (its completion is already queued). `timed_out` counts it in stats.
  std::optional<std::string> cancel(int64_t request_id, bool timed_out);
  std::vector<Completion> drain() { return completions_.drain(); }
  int completion_fd() const { return completions_.fd(); }

  // Returns a barrier request id completed when the unmaps are done, or 0 when there is none.
  int64_t trim(double deadline_s);
  int64_t set_limit_pages(int64_t limit_pages, double deadline_s);
  // Returns true when the mapper thread was joined, false when it was abandoned at the deadline.
  bool close(double timeout_s);

  PoolStats stats() const;
  bool is_allocated(int64_t block) const;
  const Backend& backend() const { return *backend_; }
  const PoolConfig& config() const { return config_; }

  // The mapper thread's side (mapper.cpp). The next jobs to run as one backend batch (the
  // earliest job, plus every other queued map when it maps); empty when there is none.
  static constexpr int64_t kMaxBatchPages = 512;
  std::vector<Job> next_batch();
  // `still_mapped`: pages of an unmap job whose runs failed (ascending); empty otherwise.
  void finish_job(const Job& job, const BackendResult& result,
                  const std::vector<int64_t>& still_mapped);
  Backend& mutable_backend() { return *backend_; }

  // The share watcher's side (ledger.cpp): re-plans after memory was released in the share,
  // applies a limit set from outside, publishes this pool's figures into its entry.
  void on_share_tick(ShareMember& member);

 private:
  PagePool(std::shared_ptr<Backend> backend, PoolConfig config);

  struct Page {
    PageState state = PageState::kUnmapped;
    int32_t num_blocks = 0;  // blocks of this page inside num_blocks (the last page may be short)
    int32_t used = 0;
    std::vector<int32_t> free_slots;  // stack of free block slots while mapped
    std::vector<uintptr_t> fences;    // Note [Unmap safety]
  };
  struct Waiter {
    int64_t id;
    int64_t n;
    Clock::time_point deadline;
  };

  // All of these run with mutex_ held.
  int64_t headroom_pages() const;
  int64_t available_to_newcomer() const;
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
  void charge_share(std::vector<int64_t>& pages, bool refill);
  void release_share(int64_t pages);
  void apply_share_limit(int64_t limit_pages);

  std::shared_ptr<Backend> backend_;
  PoolConfig config_;
  CompletionQueue completions_;
  Mapper mapper_;

  mutable std::mutex mutex_;
  bool closed_ = false;
  std::vector<Page> pages_;
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
  int64_t maps_done_ = 0, unmaps_done_ = 0, map_errors_ = 0, dropped_jobs_ = 0, timeouts_ = 0;
  int64_t batches_ = 0;  // backend batches the mapper ran
  std::string last_error_;
  std::map<uintptr_t, int64_t> fence_refs_;  // fence -> pages holding it
  std::shared_ptr<ShareMember> share_;  // null: no share (Note [Share ledger])
  int64_t configured_limit_pages_ = 0;   // the limit a share's "back to configured" restores
  std::optional<Job> current_job_;
  Clock::time_point current_job_start_;
};

}  // namespace kvasync
