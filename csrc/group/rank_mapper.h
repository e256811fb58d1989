// The rank's side of a tensor-parallel group: the thread that maps the scheduler's pages on this
// rank's own device (Note [Tensor parallel group] in group_file.h).
//
// Note [Rank mapper]
// ~~~~~~~~~~~~~~~~~~
// One C++ thread per rank process, started by join(). It waits on its ring's futex word in slices
// of kLivenessSlice, runs every job posted since the last one in order against the rank's own
// backend (the same Backend classes the pool uses: host, cuda, faults), records the result in the
// job's slot and wakes the scheduler. It never calls Python and never takes the GIL.
//
// What it holds is its own record (per page, the job that mapped it, 0 when not held): a map maps
// only the pages of the job it does not hold yet, all or nothing (on a failure it unmaps what
// this job mapped); an unmap unmaps only what it holds. The job's number tells a page the
// group's map may still roll back from a committed one (Note [Tensor parallel group]). Between
// slices it checks that the group is still open and that the scheduler's process (pid + start
// time) is alive; when either is not, it unmaps every page it holds, marks the rank left with the
// reason, and ends. close() does the same from the caller's thread after stopping the loop
// (bounded: a thread stuck in a backend call is abandoned, and then the pages stay until the
// backend goes away with the process).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "common/wakeup.h"
#include "group/group_file.h"

namespace kvasync {

// What a rank needs to build its backend: the group's ranges, pages and page size.
struct GroupGeometry {
  int num_ranks;
  int num_ranges;
  int64_t num_pages;
  int64_t page_size;
};
// Waits up to `timeout_s` for an open group at `path` and reads its geometry. Throws GroupError
// as RankMapper::join does.
GroupGeometry read_group_geometry(const std::string& path, const std::string& name,
                                  double timeout_s);

class RankMapper : public std::enable_shared_from_this<RankMapper> {
 public:
  // Joins rank `rank` of the group whose file is at `path`, waiting up to `timeout_s` for the
  // scheduler to create it. Throws GroupError when no open group is there by then, when its
  // geometry (ranges, pages, page size) is not `backend`'s (the scheduler is told: the rank is
  // refused), or when the rank's slot was taken before.
  static std::shared_ptr<RankMapper> join(const std::string& path, const std::string& name,
                                          int rank, std::shared_ptr<Backend> backend,
                                          double timeout_s);
  ~RankMapper();
  RankMapper(const RankMapper&) = delete;
  RankMapper& operator=(const RankMapper&) = delete;

  // Stops the loop (waiting up to `timeout_s`), unmaps every page held and leaves the group.
  // Returns false when the loop was stuck in a backend call and had to be abandoned.
  bool close(double timeout_s);
  // Waits until the rank has left (the scheduler closed the group or died, or close()).
  bool wait_left(double timeout_s);
  bool left() const { return left_.load(); }
  std::string left_reason() const;

  int rank() const { return rank_; }
  int64_t mapped_pages() const { return mapped_count_.load(); }
  std::vector<int64_t> mapped_page_ids() const;
  // The pages held whose map the whole group did (Note [Tensor parallel group]: committed
  // pages): no rollback will unmap them, only a later unmap the scheduler decides. What this
  // process may write, as the pool's blocks on them may be handed out.
  std::vector<int64_t> committed_page_ids() const;
  uint64_t jobs_done() const { return jobs_done_.load(); }
  const Backend& backend() const { return *backend_; }

 private:
  RankMapper(std::string name, int rank, std::shared_ptr<Backend> backend, GroupFile* file);
  static void run(std::shared_ptr<RankMapper> self);
  void run_job(uint64_t seq);
  BackendResult map_pages(uint64_t seq, int64_t first, int64_t count);
  BackendResult unmap_pages(int64_t first, int64_t count);
  // Unmaps everything held, records `reason` and marks the rank left (once).
  void leave(const std::string& reason);
  RankRecord& record() { return file_->ranks[rank_]; }
  const RankRecord& record() const { return file_->ranks[rank_]; }
  bool held(int64_t page) const { return mapped_by_[page].load(std::memory_order_acquire) != 0; }

  std::string name_;
  int rank_;
  int32_t owner_pid_;  // the process that joined (Note [Tensor parallel group]: fork)
  std::shared_ptr<Backend> backend_;
  GroupFile* file_;
  int32_t scheduler_pid_;
  uint64_t scheduler_start_time_;
  // Per page: the job that mapped it, 0 when not held. Written by one thread at a time (the
  // mapper's, or close's once it has stopped); read by any (mapped_page_ids, committed_page_ids).
  std::unique_ptr<std::atomic<uint64_t>[]> mapped_by_;
  std::atomic<int64_t> mapped_count_{0};
  std::atomic<uint64_t> jobs_done_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> leaving_{false};  // leave() runs once
  std::atomic<bool> left_{false};
  Wakeup left_wakeup_;                // left_ became true
  mutable std::mutex reason_mutex_;
  std::string left_reason_;
  Wakeup exited_;  // the loop has ended
  bool joined_thread_ = false;
  std::thread thread_;
};

}  // namespace kvasync
