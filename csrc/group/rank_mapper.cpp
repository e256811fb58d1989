#include "group/rank_mapper.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <stdexcept>

namespace kvasync {

using group_detail::Clock;

namespace {

// How often join() looks for the group's file while the scheduler has not created it yet.
constexpr auto kJoinPoll = std::chrono::milliseconds(10);

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

void ack(GroupFile* file) {
  file->header.acks.fetch_add(1, std::memory_order_acq_rel);
  group_detail::futex_wake(file->header.acks);
}

// Maps the group's file when it is there, created complete and open by a live scheduler; null
// otherwise (not yet, or a dead scheduler's file that its successor will replace).
GroupFile* open_file(const std::string& path, std::string& why) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    why = errno == ENOENT ? "no group file " + path + " (the scheduler has not opened it)"
                          : "cannot open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) != 0) {
    ::close(fd);
    throw GroupError("the group file " + path +
                     " is not a private file of this user: refusing to join it");
  }
  if (st.st_size < static_cast<off_t>(sizeof(GroupFile))) {
    ::close(fd);
    throw GroupError("the group file " + path + " is too small (" + std::to_string(st.st_size) +
                     " bytes): not a kvasync group of this version");
  }
  GroupFile* file = group_detail::map_file(fd, path);
  ::close(fd);
  const GroupHeader& h = file->header;
  if (h.magic.load(std::memory_order_acquire) != kGroupMagic || h.version != kGroupVersion ||
      h.file_bytes != sizeof(GroupFile)) {
    group_detail::unmap_file(file);
    throw GroupError("the group file " + path + " is not a kvasync group of this version");
  }
  if (h.open.load() != 1 ||
      !group_detail::process_alive(h.scheduler_pid.load(), h.scheduler_start_time.load())) {
    why = "the group file " + path + " was left by a scheduler that is gone";
    group_detail::unmap_file(file);
    return nullptr;
  }
  return file;
}

// Waits (polling the path, bounded) for an open group's file and maps it.
GroupFile* wait_for_file(const std::string& path, const std::string& name, const std::string& who,
                         double timeout_s) {
  const auto deadline = group_detail::deadline_after(timeout_s);
  std::string why;
  GroupFile* file = nullptr;
  while ((file = open_file(path, why)) == nullptr) {
    if (Clock::now() >= deadline) {
      throw GroupError(who + " cannot join tensor-parallel group '" + name + "' within " +
                       std::to_string(timeout_s) + " s: " + why);
    }
    // A bounded poll: the file appears once, when the scheduler opens the group.
    std::this_thread::sleep_for(std::min<Clock::duration>(kJoinPoll, deadline - Clock::now()));
  }
  return file;
}

}  // namespace

GroupGeometry read_group_geometry(const std::string& path, const std::string& name,
                                  double timeout_s) {
  GroupFile* file = wait_for_file(path, name, "a rank", timeout_s);
  const GroupHeader& h = file->header;
  const GroupGeometry geometry{static_cast<int>(h.num_ranks), h.num_ranges, h.num_pages,
                               h.page_size};
  group_detail::unmap_file(file);
  return geometry;
}

RankMapper::RankMapper(std::string name, int rank, std::shared_ptr<Backend> backend,
                       GroupFile* file)
    : name_(std::move(name)),
      rank_(rank),
      owner_pid_(getpid()),
      backend_(std::move(backend)),
      file_(file),
      scheduler_pid_(file->header.scheduler_pid.load()),
      scheduler_start_time_(file->header.scheduler_start_time.load()),
      mapped_by_(new std::atomic<uint64_t>[static_cast<size_t>(backend_->num_pages())]) {
  for (int64_t p = 0; p < backend_->num_pages(); ++p) mapped_by_[p].store(0);
}

std::shared_ptr<RankMapper> RankMapper::join(const std::string& path, const std::string& name,
                                             int rank, std::shared_ptr<Backend> backend,
                                             double timeout_s) {
  if (!backend) throw std::invalid_argument("RankMapper needs a backend");
  GroupFile* file = wait_for_file(path, name, "rank " + std::to_string(rank), timeout_s);
  GroupHeader& h = file->header;
  if (rank < 0 || rank >= static_cast<int>(h.num_ranks)) {
    const uint32_t num_ranks = h.num_ranks;
    group_detail::unmap_file(file);
    throw GroupError("rank " + std::to_string(rank) + " is not a rank of group '" + name +
                     "', which has " + std::to_string(num_ranks) + " (0.." +
                     std::to_string(num_ranks - 1) + ")");
  }
  RankRecord& rec = file->ranks[rank];
  int32_t holder = 0;
  // Claimed by pid first (two processes of one rank: one wins), published by state last.
  if (!rec.pid.compare_exchange_strong(holder, getpid())) {
    group_detail::unmap_file(file);
    throw GroupError("rank " + std::to_string(rank) + " of group '" + name +
                     "' was already taken by pid " + std::to_string(holder) +
                     "; a group takes no replacement rank (its pages are lost): reopen the group");
  }
  rec.start_time.store(group_detail::own_start_time());
  if (h.num_ranges != backend->num_ranges() || h.num_pages != backend->num_pages() ||
      h.page_size != backend->page_size()) {
    const std::string error =
        "its backend has " + std::to_string(backend->num_ranges()) + " ranges of " +
        std::to_string(backend->num_pages()) + " pages of " + std::to_string(backend->page_size()) +
        " bytes; the group has " + std::to_string(h.num_ranges) + " of " +
        std::to_string(h.num_pages) + " of " + std::to_string(h.page_size);
    group_detail::copy_text(rec.note, sizeof rec.note, error);
    rec.state.store(static_cast<uint32_t>(RankState::kRefused), std::memory_order_release);
    ack(file);
    group_detail::unmap_file(file);
    throw GroupError("rank " + std::to_string(rank) + " cannot join group '" + name + "': " +
                     error);
  }
  std::shared_ptr<RankMapper> self(new RankMapper(name, rank, std::move(backend), file));
  rec.state.store(static_cast<uint32_t>(RankState::kJoined), std::memory_order_release);
  ack(file);
  self->thread_ = std::thread(&RankMapper::run, self);
  return self;
}

RankMapper::~RankMapper() {
  if (thread_.joinable()) thread_.detach();  // only when the abandoned thread drops the last ref
  group_detail::unmap_file(file_);
}

void RankMapper::run(std::shared_ptr<RankMapper> self) {
  RankRecord& rec = self->record();
  const GroupHeader& h = self->file_->header;
  auto next_liveness = Clock::now() + kLivenessSlice;
  uint64_t done = rec.done.load();
  while (!self->stopping_.load()) {
    const uint32_t seen = rec.posted.load(std::memory_order_acquire);
    const uint64_t head = rec.head.load(std::memory_order_acquire);
    while (done < head && !self->stopping_.load()) self->run_job(++done);
    if (self->stopping_.load()) break;
    if (h.open.load(std::memory_order_acquire) != 1) {
      self->leave("the scheduler closed the group");
      break;
    }
    const auto now = Clock::now();
    if (now >= next_liveness) {
      next_liveness = now + kLivenessSlice;
      if (!group_detail::process_alive(self->scheduler_pid_, self->scheduler_start_time_)) {
        self->leave("the scheduler (pid " + std::to_string(self->scheduler_pid_) + ") died");
        break;
      }
    }
    group_detail::futex_wait(rec.posted, seen, kLivenessSlice);
  }
  self->exited_.notify();
}

void RankMapper::run_job(uint64_t seq) {
  RankRecord& rec = record();
  GroupSlot& slot = rec.ring[seq % kGroupRingSlots];
  BackendResult result;
  if (slot.seq.load(std::memory_order_acquire) != seq) {
    result = BackendResult::failure("EPROTO: job " + std::to_string(seq) + " is not in its slot");
  } else {
    const auto kind = static_cast<GroupJobKind>(slot.kind.load(std::memory_order_relaxed));
    const int64_t first = slot.first.load(std::memory_order_relaxed);
    const int64_t count = slot.count.load(std::memory_order_relaxed);
    if (first < 0 || count <= 0 || first > backend_->num_pages() - count) {
      result = BackendResult::failure("EINVAL: " + group_detail::describe_pages(first, count) +
                                      " out of this rank's " +
                                      std::to_string(backend_->num_pages()) + " pages");
    } else if (kind == GroupJobKind::kMap) {
      result = map_pages(seq, first, count);
    } else if (kind == GroupJobKind::kUnmap) {
      result = unmap_pages(first, count);
    } else {
      result = BackendResult::failure("EPROTO: unknown job kind");
    }
  }
  rec.mapped_pages.store(mapped_count_.load());
  group_detail::copy_text(slot.error, sizeof slot.error, result.error);
  slot.ok.store(result.ok ? 1 : 0, std::memory_order_relaxed);
  slot.done_seq.store(seq, std::memory_order_release);
  rec.done.store(seq, std::memory_order_release);
  jobs_done_.store(seq);
  ack(file_);
}

BackendResult RankMapper::map_pages(uint64_t seq, int64_t first, int64_t count) {
  // All or nothing for the job: on a failure, the runs this job mapped are unmapped again.
  std::vector<std::pair<int64_t, int64_t>> done;
  int64_t page = first;
  const int64_t end = first + count;
  while (page < end) {
    if (held(page)) {
      // Held still (an unmap of it failed here): the pool asks for it again because it counts
      // it unmapped, and this job's rollback would unmap it. So its fate is this job's now.
      mapped_by_[page].store(seq, std::memory_order_release);
      ++page;
      continue;
    }
    int64_t run_end = page + 1;
    while (run_end < end && !held(run_end)) ++run_end;
    const BackendResult result =
        guarded([&] { return backend_->map(page, run_end - page); });
    if (!result.ok) {
      for (auto [f, c] : done) {
        if (!guarded([&] { return backend_->unmap(f, c); }).ok) continue;  // stays held
        for (int64_t p = f; p < f + c; ++p) mapped_by_[p].store(0, std::memory_order_release);
        mapped_count_.fetch_sub(c);
      }
      return result;
    }
    for (int64_t p = page; p < run_end; ++p) mapped_by_[p].store(seq, std::memory_order_release);
    mapped_count_.fetch_add(run_end - page);
    done.emplace_back(page, run_end - page);
    page = run_end;
  }
  return BackendResult::success();
}

BackendResult RankMapper::unmap_pages(int64_t first, int64_t count) {
  BackendResult first_error;
  int64_t page = first;
  const int64_t end = first + count;
  while (page < end) {
    if (!held(page)) {
      ++page;
      continue;
    }
    int64_t run_end = page + 1;
    while (run_end < end && held(run_end)) ++run_end;
    const BackendResult result =
        guarded([&] { return backend_->unmap(page, run_end - page); });
    if (result.ok) {
      for (int64_t p = page; p < run_end; ++p) mapped_by_[p].store(0, std::memory_order_release);
      mapped_count_.fetch_sub(run_end - page);
    } else if (first_error.ok) {
      first_error = result;  // keep going: free what can be freed
    }
    page = run_end;
  }
  return first_error;
}

void RankMapper::leave(const std::string& reason) {
  if (leaving_.exchange(true)) return;
  BackendResult unmapped;
  if (backend_->num_pages() > 0) unmapped = unmap_pages(0, backend_->num_pages());
  RankRecord& rec = record();
  rec.mapped_pages.store(mapped_count_.load());
  const std::string note =
      unmapped.ok ? reason
                  : reason + "; " + std::to_string(mapped_count_.load()) +
                        " page(s) stayed mapped: " + unmapped.error;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    left_reason_ = note;
  }
  group_detail::copy_text(rec.note, sizeof rec.note, note);
  rec.state.store(static_cast<uint32_t>(RankState::kLeft), std::memory_order_release);
  ack(file_);
  left_.store(true);
  left_wakeup_.notify();
}

bool RankMapper::close(double timeout_s) {
  const auto deadline = group_detail::deadline_after(timeout_s);
  // A forked child has no mapper thread and its pages are the parent's: it touches nothing.
  if (getpid() != owner_pid_) return false;
  if (!joined_thread_ && thread_.joinable()) {
    stopping_.store(true);
    record().posted.fetch_add(1, std::memory_order_release);
    group_detail::futex_wake(record().posted);
    if (!exited_.wait_for(deadline - Clock::now())) {
      // Stuck in a backend call: abandoned (it holds a reference and ends by itself). Its
      // pages cannot be unmapped under it; the group is told the rank left.
      thread_.detach();
      if (!leaving_.exchange(true)) {
        const std::string note = "closed while its mapper was stuck in a backend call";
        {
          std::lock_guard<std::mutex> lock(reason_mutex_);
          left_reason_ = note;
        }
        group_detail::copy_text(record().note, sizeof record().note, note);
        record().state.store(static_cast<uint32_t>(RankState::kLeft), std::memory_order_release);
        ack(file_);
        left_.store(true);
        left_wakeup_.notify();
      }
      return false;
    }
    thread_.join();
    joined_thread_ = true;
  }
  leave("the rank closed its mapper");
  return true;
}

bool RankMapper::wait_left(double timeout_s) {
  const auto deadline = group_detail::deadline_after(timeout_s);
  while (!left_.load()) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    // In slices: another waiter may take the one notification.
    left_wakeup_.wait_for(std::min<Clock::duration>(deadline - now, kLivenessSlice));
  }
  return true;
}

std::string RankMapper::left_reason() const {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  return left_reason_;
}

std::vector<int64_t> RankMapper::mapped_page_ids() const {
  std::vector<int64_t> out;
  for (int64_t p = 0; p < backend_->num_pages(); ++p) {
    if (held(p)) out.push_back(p);
  }
  return out;
}

std::vector<int64_t> RankMapper::committed_page_ids() const {
  // `committed` first: every job up to it has run before the scheduler stored it (the rollbacks
  // of failed maps before it included), so the record read after shows their effect; a page
  // mapped by a later job (its outcome unknown yet) is not committed.
  const uint64_t committed = record().committed.load(std::memory_order_acquire);
  std::vector<int64_t> out;
  for (int64_t p = 0; p < backend_->num_pages(); ++p) {
    const uint64_t by = mapped_by_[p].load(std::memory_order_acquire);
    if (by != 0 && by <= committed) out.push_back(p);
  }
  return out;
}

}  // namespace kvasync
