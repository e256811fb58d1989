#include "group/group_backend.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>

namespace kvasync {

using group_detail::Clock;

namespace {

// The prefix of every error this backend returns (Note [Backends]: errors start with a name).
constexpr const char* kErrorName = "TP_GROUP";

std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds;
  return out.str();
}

const char* state_name(uint32_t state) {
  switch (static_cast<RankState>(state)) {
    case RankState::kAbsent:
      return "absent";
    case RankState::kJoined:
      return "joined";
    case RankState::kLeft:
      return "left";
    case RankState::kRefused:
      return "refused";
  }
  return "corrupt";
}

// Initialises a new (zeroed) file; the magic goes last, with release: a rank that reads it reads
// everything before it.
void init_file(GroupFile* file, int num_ranks, int num_ranges, int64_t num_pages,
               int64_t page_size) {
  GroupHeader& h = file->header;
  h.version = kGroupVersion;
  h.num_ranks = static_cast<uint32_t>(num_ranks);
  h.file_bytes = sizeof(GroupFile);
  h.num_pages = num_pages;
  h.page_size = page_size;
  h.num_ranges = num_ranges;
  h.scheduler_pid.store(getpid());
  h.scheduler_start_time.store(group_detail::own_start_time());
  h.open.store(1);
  h.magic.store(kGroupMagic, std::memory_order_release);
}

// Whether the file at `path` belongs to a live scheduler; throws GroupError when it is not this
// user's private file (another user's file is never joined nor removed).
bool held_by_live_scheduler(const std::string& path, const std::string& name) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;  // gone meanwhile: create it anew
  struct stat st;
  bool live = false;
  std::string refused;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) != 0) {
    refused = "is not a private file of this user";
  } else if (st.st_size >= static_cast<off_t>(sizeof(GroupFile))) {
    GroupFile* file = group_detail::map_file(fd, path);
    const GroupHeader& h = file->header;
    live = h.magic.load(std::memory_order_acquire) == kGroupMagic && h.open.load() == 1 &&
           group_detail::process_alive(h.scheduler_pid.load(), h.scheduler_start_time.load());
    if (live) {
      refused = "is in use by the live scheduler pid " + std::to_string(h.scheduler_pid.load());
    }
    group_detail::unmap_file(file);
  }
  ::close(fd);
  if (!refused.empty()) {
    throw GroupError("tensor-parallel group '" + name + "' cannot be opened: " + path + " " +
                     refused + "; pick another group name, or stop that process");
  }
  return live;
}

}  // namespace

SchedulerGroup::SchedulerGroup(std::string path, std::string name, int num_ranks, GroupFile* file)
    : path_(std::move(path)),
      name_(std::move(name)),
      num_ranks_(num_ranks),
      file_(file),
      owner_pid_(getpid()) {}

std::shared_ptr<SchedulerGroup> SchedulerGroup::create(const std::string& path,
                                                       const std::string& name, int num_ranks,
                                                       int num_ranges, int64_t num_pages,
                                                       int64_t page_size) {
  if (num_ranks < 1 || num_ranks > kGroupMaxRanks) {
    throw std::invalid_argument("num_ranks must be in 1.." + std::to_string(kGroupMaxRanks) +
                                ", got " + std::to_string(num_ranks));
  }
  if (num_ranges < 1 || num_pages < 1 || page_size < 1) {
    throw std::invalid_argument("a group's geometry must be positive: num_ranges " +
                                std::to_string(num_ranges) + ", num_pages " +
                                std::to_string(num_pages) + ", page_size " +
                                std::to_string(page_size));
  }
  std::random_device random;
  // Two attempts: a file left by a dead scheduler is removed once, then the name is ours.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string temp =
        path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(random());
    const int fd = ::open(temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      throw GroupError("cannot create the group file " + temp + ": " + std::strerror(errno));
    }
    // Created complete under a temporary name, then linked into place: no rank ever maps a
    // half-initialised file.
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, sizeof(GroupFile)) != 0) {
      const int err = errno;
      ::close(fd);
      unlink(temp.c_str());
      throw GroupError("cannot size the group file " + temp + ": " + std::strerror(err));
    }
    GroupFile* file = nullptr;
    try {
      file = group_detail::map_file(fd, temp);
    } catch (...) {
      ::close(fd);
      unlink(temp.c_str());
      throw;
    }
    struct stat created;
    const bool have_stat = fstat(fd, &created) == 0;
    ::close(fd);  // the mapping keeps the file
    init_file(file, num_ranks, num_ranges, num_pages, page_size);
    const bool linked = link(temp.c_str(), path.c_str()) == 0;
    const int err = errno;
    unlink(temp.c_str());
    if (linked) {
      std::shared_ptr<SchedulerGroup> group(new SchedulerGroup(path, name, num_ranks, file));
      if (have_stat) {
        group->device_ = static_cast<uint64_t>(created.st_dev);
        group->inode_ = static_cast<uint64_t>(created.st_ino);
      }
      return group;
    }
    group_detail::unmap_file(file);
    if (err != EEXIST) {
      throw GroupError("cannot create the group file " + path + ": " + std::strerror(err));
    }
    if (!held_by_live_scheduler(path, name)) unlink(path.c_str());  // a dead scheduler's
  }
  throw GroupError("tensor-parallel group '" + name + "': " + path +
                   " keeps being recreated by another process; pick another group name");
}

SchedulerGroup::~SchedulerGroup() {
  close();
  group_detail::unmap_file(file_);
}

void SchedulerGroup::close() {
  std::lock_guard<std::mutex> lock(post_mutex_);
  if (closed_) return;
  closed_ = true;
  // A forked child closes only its copy: the group, its file and its ranks are the parent's.
  if (getpid() != owner_pid_) return;
  file_->header.open.store(0, std::memory_order_release);
  for (int r = 0; r < num_ranks_; ++r) {
    file_->ranks[r].posted.fetch_add(1, std::memory_order_release);
    group_detail::futex_wake(file_->ranks[r].posted);
  }
  // Only our own file: a newer scheduler may have replaced one we no longer hold.
  struct stat at_path;
  if (stat(path_.c_str(), &at_path) == 0 && at_path.st_dev == device_ && at_path.st_ino == inode_) {
    unlink(path_.c_str());
  }
}

std::string SchedulerGroup::describe_rank(int rank) const {
  const RankRecord& rec = file_->ranks[rank];
  const int32_t pid = rec.pid.load();
  return "rank " + std::to_string(rank) + (pid > 0 ? " (pid " + std::to_string(pid) + ")" : "");
}

std::optional<std::string> SchedulerGroup::rank_lost(int rank) const {
  const RankRecord& rec = file_->ranks[rank];
  const auto state = static_cast<RankState>(rec.state.load(std::memory_order_acquire));
  if (state == RankState::kLeft || state == RankState::kRefused) {
    return describe_rank(rank) + (state == RankState::kLeft ? " left" : " was refused by") +
           " group '" + name_ + "': " + group_detail::read_text(rec.note, sizeof rec.note);
  }
  if (state == RankState::kJoined &&
      !group_detail::process_alive(rec.pid.load(), rec.start_time.load())) {
    return describe_rank(rank) + " died (killed or exited without leaving group '" + name_ + "')";
  }
  return std::nullopt;
}

void SchedulerGroup::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!broken_) broken_ = reason;
}

std::optional<std::string> SchedulerGroup::broken() const {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  return broken_;
}

SchedulerGroup::Outcome SchedulerGroup::wait_joined(Clock::time_point deadline, double timeout_s) {
  while (true) {
    const uint32_t seen = file_->header.acks.load(std::memory_order_acquire);
    std::vector<int> absent;
    for (int r = 0; r < num_ranks_; ++r) {
      const auto state = static_cast<RankState>(file_->ranks[r].state.load());
      if (state == RankState::kAbsent) absent.push_back(r);
      if (state == RankState::kLeft || state == RankState::kRefused) {
        const std::string lost = rank_lost(r).value_or(describe_rank(r) + " left");
        mark_broken(lost);
        return {false, lost};
      }
    }
    // A joined rank's liveness is left to wait_acks, which reads /proc only while it waits: the
    // fast path of a map never does.
    if (absent.empty()) return {};
    if (Clock::now() >= deadline) {
      std::string names;
      for (int r : absent) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return {false, std::string(absent.size() == 1 ? "rank " : "ranks ") + names +
                         " never joined group '" + name_ + "' within " + seconds_text(timeout_s) +
                         " s (no process attached; each rank opens a RankMapper on this group)"};
    }
    group_detail::futex_wait(file_->header.acks, seen,
                             std::min<Clock::duration>(kLivenessSlice, deadline - Clock::now()));
  }
}

void SchedulerGroup::wait_ready(double timeout_s) {
  const Outcome outcome = wait_joined(group_detail::deadline_after(timeout_s), timeout_s);
  if (!outcome.ok) throw GroupError(outcome.error);
  for (int r = 0; r < num_ranks_; ++r) {
    if (auto lost = rank_lost(r)) {
      mark_broken(*lost);
      throw GroupError(*lost);
    }
  }
}

SchedulerGroup::Outcome SchedulerGroup::post_all(GroupJobKind kind, int64_t first, int64_t count,
                                                 std::vector<uint64_t>& seqs) {
  std::lock_guard<std::mutex> lock(post_mutex_);
  seqs.assign(static_cast<size_t>(num_ranks_), 0);
  Outcome outcome;
  if (getpid() != owner_pid_) {  // a forked child posts nothing into the parent's rings
    return {false, "group '" + name_ + "' belongs to pid " + std::to_string(owner_pid_) +
                       ", not to this forked child"};
  }
  // Closed: the ranks drop every page when they see it, so an unmap has nothing to post.
  if (closed_) {
    if (kind == GroupJobKind::kUnmap) return {};
    return {false, "group '" + name_ + "' is closed"};
  }
  for (int r = 0; r < num_ranks_; ++r) {
    RankRecord& rec = file_->ranks[r];
    if (rec.state.load(std::memory_order_acquire) != static_cast<uint32_t>(RankState::kJoined)) {
      // A map must reach every rank: one that left after wait_joined saw it joined (its close
      // racing this map) fails the map here, as nothing would wait for it (its seq stays 0);
      // tests/cpp/group_stress.cpp saw such a map succeed without that rank. An unmap skips it:
      // a rank not in the group holds nothing the group will use again.
      if (kind == GroupJobKind::kMap && outcome.ok) {
        const std::optional<std::string> lost = rank_lost(r);
        if (lost) mark_broken(*lost);
        const std::string who =
            lost.value_or(describe_rank(r) + " has not joined group '" + name_ + "'");
        outcome = {false,
                   who + " while asked to map " + group_detail::describe_pages(first, count)};
      }
      continue;
    }
    const uint64_t seq = next_seq_[r] + 1;
    const uint64_t done = rec.done.load(std::memory_order_acquire);
    if (seq - done > static_cast<uint64_t>(kGroupRingSlots)) {
      if (outcome.ok) {
        outcome = {false, describe_rank(r) + " has " + std::to_string(seq - 1 - done) +
                              " jobs of group '" + name_ + "' not done (stuck?)"};
      }
      continue;
    }
    GroupSlot& slot = rec.ring[seq % kGroupRingSlots];
    slot.kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
    slot.first.store(first, std::memory_order_relaxed);
    slot.count.store(count, std::memory_order_relaxed);
    slot.seq.store(seq, std::memory_order_release);
    rec.head.store(seq, std::memory_order_release);
    next_seq_[r] = seq;
    seqs[static_cast<size_t>(r)] = seq;
    rec.posted.fetch_add(1, std::memory_order_release);
    group_detail::futex_wake(rec.posted);
  }
  return outcome;
}

SchedulerGroup::Outcome SchedulerGroup::wait_acks(const std::vector<uint64_t>& posted,
                                                  Clock::time_point deadline, double timeout_s,
                                                  const std::string& what, bool dead_is_done) {
  std::vector<uint64_t> seqs = posted;
  auto next_liveness = Clock::now() + kLivenessSlice;  // fast acks never read /proc
  Outcome failed;  // the first failure seen (kept across slices: its rank is no longer waited on)
  while (true) {
    const uint32_t seen = file_->header.acks.load(std::memory_order_acquire);
    std::vector<int> pending;
    for (int r = 0; r < num_ranks_; ++r) {
      const uint64_t seq = seqs[static_cast<size_t>(r)];
      if (seq == 0) continue;
      RankRecord& rec = file_->ranks[r];
      if (rec.done.load(std::memory_order_acquire) < seq) {
        pending.push_back(r);
        continue;
      }
      const GroupSlot& slot = rec.ring[seq % kGroupRingSlots];
      if (slot.done_seq.load(std::memory_order_acquire) == seq && slot.ok.load() == 0 &&
          failed.ok) {
        failed = {false, describe_rank(r) + " failed to " + what + ": " +
                             group_detail::read_text(slot.error, sizeof slot.error)};
      }
      seqs[static_cast<size_t>(r)] = 0;
    }
    if (!failed.ok && !dead_is_done) return failed;  // a map: no need to wait for the others
    if (pending.empty()) return failed;
    const auto now = Clock::now();
    if (now >= next_liveness || now >= deadline) {
      next_liveness = now + kLivenessSlice;
      for (int r : pending) {
        const auto lost = rank_lost(r);
        if (!lost) continue;
        mark_broken(*lost);
        if (!dead_is_done) return {false, *lost + " while asked to " + what};
        seqs[static_cast<size_t>(r)] = 0;  // its memory went with it
      }
    }
    if (now >= deadline) {
      std::string slow;
      for (int r : pending) {
        if (seqs[static_cast<size_t>(r)] == 0) continue;
        slow += (slow.empty() ? "" : "; ") + describe_rank(r) + ", alive, did not finish " + what +
                " within " + seconds_text(timeout_s) + " s";
      }
      if (!slow.empty()) return {false, slow};
      if (!failed.ok) return failed;
      continue;  // every pending rank turned out dead, and that counts as done
    }
    group_detail::futex_wait(file_->header.acks, seen,
                             std::min<Clock::duration>(kLivenessSlice, deadline - now));
  }
}

void SchedulerGroup::commit(const std::vector<uint64_t>& seqs) {
  std::lock_guard<std::mutex> lock(post_mutex_);  // the poster's words, as in post_all
  for (int r = 0; r < num_ranks_; ++r) {
    const uint64_t seq = seqs[static_cast<size_t>(r)];
    RankRecord& rec = file_->ranks[r];
    // Release: a rank that reads it sees our read of its ack, so every job up to `seq` has run.
    if (seq > rec.committed.load(std::memory_order_relaxed)) {
      rec.committed.store(seq, std::memory_order_release);
    }
  }
}

std::vector<SchedulerGroup::RankView> SchedulerGroup::ranks() const {
  // jobs_posted and jobs_done are two words written by two processes (the poster, the rank).
  // Read one after the other, a post and its job done in between showed more jobs done than
  // posted (group_stress had to allow it). `head` moves only under post_mutex_, so under it the
  // snapshot is of one moment for the posting side, and `done`, read after, is at most `head`
  // (a rank runs only what was posted). /proc is read after, outside the lock.
  struct Counters {
    uint64_t posted, done;
  };
  std::vector<Counters> counters(static_cast<size_t>(num_ranks_));
  {
    std::lock_guard<std::mutex> lock(post_mutex_);
    for (int r = 0; r < num_ranks_; ++r) {
      const RankRecord& rec = file_->ranks[r];
      const uint64_t posted = rec.head.load(std::memory_order_acquire);
      counters[static_cast<size_t>(r)] = {posted, rec.done.load(std::memory_order_acquire)};
    }
  }
  std::vector<RankView> out;
  for (int r = 0; r < num_ranks_; ++r) {
    const RankRecord& rec = file_->ranks[r];
    const uint32_t state = rec.state.load(std::memory_order_acquire);
    std::string state_text = state_name(state);
    if (state == static_cast<uint32_t>(RankState::kJoined) &&
        !group_detail::process_alive(rec.pid.load(), rec.start_time.load())) {
      state_text = "dead";
    }
    const bool noted =
        state == static_cast<uint32_t>(RankState::kLeft) ||
        state == static_cast<uint32_t>(RankState::kRefused);
    const Counters& jobs = counters[static_cast<size_t>(r)];
    out.push_back({r, state_text, rec.pid.load(), rec.mapped_pages.load(), jobs.posted, jobs.done,
                   noted ? group_detail::read_text(rec.note, sizeof rec.note) : std::string()});
  }
  return out;
}

GroupBackend::GroupBackend(std::shared_ptr<Backend> local, std::shared_ptr<SchedulerGroup> group,
                           double map_timeout_s, double unmap_timeout_s, bool map_local)
    : local_(std::move(local)),
      group_(std::move(group)),
      map_timeout_s_(map_timeout_s),
      unmap_timeout_s_(unmap_timeout_s),
      map_local_(map_local) {
  if (!local_ || !group_) throw std::invalid_argument("GroupBackend needs a backend and a group");
  group_detail::deadline_after(map_timeout_s);  // validates both timeouts
  group_detail::deadline_after(unmap_timeout_s);
}

std::string GroupBackend::roll_back(int64_t first, int64_t count, bool local_mapped,
                                    Clock::time_point deadline) {
  // Posted behind the map on every rank, then waited for within what is left of the map's
  // deadline: in the common case every rank has unmapped when the failure is reported. A rank
  // still busy (slow) unmaps right after its map; nobody waits past the deadline for it.
  if (local_mapped && map_local_) local_->unmap(first, count);
  std::vector<uint64_t> seqs;
  const SchedulerGroup::Outcome posted =
      group_->post_all(GroupJobKind::kUnmap, first, count, seqs);
  const SchedulerGroup::Outcome undone = group_->wait_acks(
      seqs, deadline, map_timeout_s_, "roll back " + group_detail::describe_pages(first, count),
      true);
  if (!posted.ok) return " (rollback not posted: " + posted.error + ")";
  if (!undone.ok) return " (rollback pending: " + undone.error + ")";
  return "";
}

BackendResult GroupBackend::map(int64_t first, int64_t count) {
  const auto deadline = group_detail::deadline_after(map_timeout_s_);
  const std::string what = "map " + group_detail::describe_pages(first, count);
  if (auto broken = group_->broken()) {
    return BackendResult::failure(std::string(kErrorName) + ": cannot " + what + ": " + *broken +
                                  "; the group must be reopened");
  }
  const SchedulerGroup::Outcome joined = group_->wait_joined(deadline, map_timeout_s_);
  if (!joined.ok) return BackendResult::failure(std::string(kErrorName) + ": " + joined.error);
  std::vector<uint64_t> seqs;
  const SchedulerGroup::Outcome posted = group_->post_all(GroupJobKind::kMap, first, count, seqs);
  // The ranks map meanwhile, each on its own device.
  const BackendResult local =
      map_local_ ? local_->map(first, count) : BackendResult::success();
  SchedulerGroup::Outcome acked;
  if (posted.ok && local.ok) acked = group_->wait_acks(seqs, deadline, map_timeout_s_, what, false);
  if (posted.ok && local.ok && acked.ok) {
    group_->commit(seqs);  // the ranks may now use these pages (Note [Tensor parallel group])
    return BackendResult::success();
  }
  const std::string rollback = roll_back(first, count, local.ok, deadline);
  const std::string error = !posted.ok ? posted.error
                            : !local.ok ? "the scheduler's own backend failed to " + what + ": " +
                                              local.error
                                        : acked.error;
  return BackendResult::failure(std::string(kErrorName) + ": " + error + rollback);
}

BackendResult GroupBackend::unmap(int64_t first, int64_t count) {
  // The pool keeps the pages of a failed unmap as mapped and hands their blocks out again, so a
  // failure may be reported only while every device still holds them (tests/cpp/group_stress.cpp
  // found blocks handed out on pages that the local backend and the other ranks had unmapped,
  // after one rank refused or was slow). So the local unmap runs first, alone, and its failure is
  // the only one reported; the ranks' outcome is not: a rank that failed keeps the pages in its
  // record (a later map skips them, its leave unmaps them) and a slow one unmaps them before any
  // later job of its ring. Their acks are still waited for, within the deadline, so that in the
  // common case every rank has unmapped when this returns.
  if (map_local_) {
    const BackendResult local = local_->unmap(first, count);
    if (!local.ok) return local;
  }
  return unmap_ranks(first, count);
}

BackendResult GroupBackend::retire(int64_t first, int64_t count,
                                   std::chrono::steady_clock::time_point deadline) {
  if (map_local_) {
    const BackendResult local = local_->retire(first, count, deadline);
    if (!local.ok) return local;
  }
  return unmap_ranks(first, count);
}

BackendResult GroupBackend::unmap_ranks(int64_t first, int64_t count) {
  const auto deadline = group_detail::deadline_after(unmap_timeout_s_);
  const std::string what = "unmap " + group_detail::describe_pages(first, count);
  std::vector<uint64_t> seqs;
  const SchedulerGroup::Outcome posted =
      group_->post_all(GroupJobKind::kUnmap, first, count, seqs);
  const SchedulerGroup::Outcome acked =
      group_->wait_acks(seqs, deadline, unmap_timeout_s_, what, true);
  // Not a failure (above), but not silent either: the rank's device keeps memory the share no
  // longer counts, until a later unmap of those pages or the rank's leave.
  const SchedulerGroup::Outcome& lost = !posted.ok ? posted : acked;
  if (!lost.ok) {
    return BackendResult::success_with_warning(
        std::string(kErrorName) + ": " + lost.error +
        "; that rank keeps those pages mapped until a later unmap of them or its leave");
  }
  return BackendResult::success();
}

}  // namespace kvasync
