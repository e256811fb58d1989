// The scheduler's side of a tensor-parallel group: the group's file, and the Backend that the
// scheduler's page pool maps through (Note [Tensor parallel group] in group_file.h).
//
// Note [Group backend]
// ~~~~~~~~~~~~~~~~~~~~
// The pool needs no change for tensor parallelism: it calls Backend::map and Backend::unmap from
// its mapper thread, never under its lock, and a failure is a value. GroupBackend is such a
// backend: map(first, count) posts the job to every rank (they start at once, in parallel), runs
// it on the scheduler's local backend meanwhile, then waits for every rank's ack in slices of
// kLivenessSlice on the header's futex word, checking between slices that each rank it waits for
// is alive. Ok only when every rank mapped; otherwise it rolls back (local unmap, an unmap job
// posted to every rank, waited for until the map's deadline) and returns the first failure,
// naming the rank:
//   - "rank 1 (pid 42) failed to map pages [0, 4): ENOMEM: ..."  its backend refused;
//   - "rank 1 (pid 42) died while ... (killed or exited)"      its process is gone;
//   - "rank 2 (pid 43, alive) did not finish ... within 5 s"  slow or stuck;
//   - "rank 3 never joined group 'x' within 5 s ..."           never started.
// A dead or departed rank breaks the group for maps (every later map fails at once with that
// reason); unmaps skip it (its memory went with its process), so the pool can still drain and
// close. An unmap fails only when the local one does, before anything is posted: the pool keeps
// a failed unmap's pages mapped and hands their blocks out again (GroupBackend::unmap). The
// scheduler's process is the only poster (the pool has one mapper thread); a mutex guards the
// posting side anyway, so that a misuse cannot corrupt a ring.
//
// lock order: PagePool::mutex_ is never held here (the pool calls backends outside it) ->
// SchedulerGroup::post_mutex_ -> SchedulerGroup::broken_mutex_.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "group/group_file.h"

namespace kvasync {

class SchedulerGroup {
 public:
  // Creates the group's file at `path` (a name in use by a live scheduler is a GroupError; a
  // file left by a dead one is replaced). `name` is for messages.
  static std::shared_ptr<SchedulerGroup> create(const std::string& path, const std::string& name,
                                                int num_ranks, int num_ranges, int64_t num_pages,
                                                int64_t page_size);
  ~SchedulerGroup();
  SchedulerGroup(const SchedulerGroup&) = delete;
  SchedulerGroup& operator=(const SchedulerGroup&) = delete;

  // Waits until every rank has joined; throws GroupError naming those that did not, or that were
  // refused, or died, by the deadline.
  void wait_ready(double timeout_s);
  // Tells every rank the group is over (they unmap and leave) and removes the file. Idempotent.
  void close();
  bool closed() const { return closed_.load(); }

  struct RankView {
    int rank;
    std::string state;  // "absent", "joined", "left", "refused", "dead"
    int32_t pid;
    int64_t mapped_pages;
    uint64_t jobs_posted, jobs_done;  // one snapshot: jobs_done <= jobs_posted (ranks())
    std::string note;
  };
  std::vector<RankView> ranks() const;
  int num_ranks() const { return num_ranks_; }
  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }
  // Why maps fail at once (a rank died or left), or nothing while the group is whole.
  std::optional<std::string> broken() const;

  // The mapper thread's side (GroupBackend).
  struct Outcome {
    bool ok = true;
    std::string error;
  };
  // Waits until every rank has joined, or one cannot (refused, dead, left), or the deadline.
  Outcome wait_joined(group_detail::Clock::time_point deadline, double timeout_s);
  // Posts a job to every joined rank; seqs[r] is its number there, 0 where not posted. A rank
  // whose ring is full fails the post (named in the outcome), and for a map so does a rank that
  // is no longer joined; the others are posted still.
  Outcome post_all(GroupJobKind kind, int64_t first, int64_t count, std::vector<uint64_t>& seqs);
  // Waits for rank r's job seqs[r], for every r with seqs[r] != 0. `what`: for messages. For a
  // map, the first failure ends the wait; a dead rank fails it. For an unmap (dead_is_done), a
  // dead or departed rank counts as done.
  Outcome wait_acks(const std::vector<uint64_t>& seqs, group_detail::Clock::time_point deadline,
                    double timeout_s, const std::string& what, bool dead_is_done);
  // Tells every rank that the map jobs seqs[r] succeeded everywhere: the pages they mapped stay
  // until the pool unmaps them (Note [Tensor parallel group]: committed pages). Only after
  // wait_acks said every rank did its job.
  void commit(const std::vector<uint64_t>& seqs);

 private:
  SchedulerGroup(std::string path, std::string name, int num_ranks, GroupFile* file);
  std::string describe_rank(int rank) const;
  // The reason rank r cannot serve (dead, left, refused), or nothing while it can.
  std::optional<std::string> rank_lost(int rank) const;
  void mark_broken(const std::string& reason);

  std::string path_, name_;
  int num_ranks_;
  GroupFile* file_;
  int32_t owner_pid_;  // the process that created the group (Note [Tensor parallel group]: fork)
  // Atomic: closed() is read without post_mutex_ (Python's `closed`, with the GIL, while another
  // thread is in close() without it); tests/cpp/group_stress.cpp's TSan run flagged the race.
  std::atomic<bool> closed_{false};
  uint64_t device_ = 0, inode_ = 0;  // the file we created, to tell it from a newer one at path_
  // Mutable: ranks() reads each rank's `head` under it (the posting side's words stand still).
  mutable std::mutex post_mutex_;
  uint64_t next_seq_[kGroupMaxRanks] = {};
  mutable std::mutex broken_mutex_;
  std::optional<std::string> broken_;
};

class GroupBackend final : public Backend {
 public:
  // `local`: the scheduler process's own backend, of the group's geometry. `map_local` false:
  // the scheduler's process holds no KV memory (vLLM's EngineCore beside its rank processes):
  // `local` only gives the ranges their addresses and is never mapped, so nothing in this
  // process may touch them.
  GroupBackend(std::shared_ptr<Backend> local, std::shared_ptr<SchedulerGroup> group,
               double map_timeout_s, double unmap_timeout_s, bool map_local = true);

  const char* name() const override { return local_->name(); }
  int64_t page_size() const override { return local_->page_size(); }
  int num_ranges() const override { return local_->num_ranges(); }
  int64_t num_pages() const override { return local_->num_pages(); }
  uintptr_t range_base(int range) const override { return local_->range_base(range); }
  const char* out_of_memory_name() const override { return local_->out_of_memory_name(); }

  BackendResult wait_fence(uintptr_t fence,
                           std::chrono::steady_clock::time_point deadline) override {
    return local_->wait_fence(fence, deadline);
  }
  void release_fence(uintptr_t fence) override { local_->release_fence(fence); }
  void release_cached() override { local_->release_cached(); }
  double upkeep() override { return local_->upkeep(); }

  BackendResult map(int64_t first, int64_t count) override;
  BackendResult unmap(int64_t first, int64_t count) override;
  // The local backend retires the pages (Note [Views outlive close]); the ranks unmap them, as
  // unmap() has them do (their views are their processes' own).
  BackendResult retire(int64_t first, int64_t count,
                       std::chrono::steady_clock::time_point deadline) override;

  const std::shared_ptr<SchedulerGroup>& group() const { return group_; }

 private:
  // unmap()'s side on the ranks, once the local backend has given the pages up.
  BackendResult unmap_ranks(int64_t first, int64_t count);
  // Undoes a failed map everywhere; returns a note for the error when a rank has not yet.
  std::string roll_back(int64_t first, int64_t count, bool local_mapped,
                        group_detail::Clock::time_point deadline);

  std::shared_ptr<Backend> local_;
  std::shared_ptr<SchedulerGroup> group_;
  double map_timeout_s_, unmap_timeout_s_;
  bool map_local_;
};

}  // namespace kvasync
