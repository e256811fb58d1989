// Tensor-parallel group: the shared-memory file between the scheduler and its ranks.
//
// Note [Tensor parallel group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rationale: with tensor parallelism one scheduler decides the page ids and every rank must map
// the same pages on its own device before any block on them is used. The reference allocator
// broadcast each map to the ranks from a C++ thread that called back into Python (seed 000: a
// hang when the GIL was held elsewhere), over sockets, with no bound on the wait.
//
// Approach: the scheduler's pool runs unchanged. Its backend is a GroupBackend (group_backend.h): a
// map or unmap that the pool's mapper thread asks of it is run on the scheduler's own (local)
// backend (unless map_local is false) and posted, as a job, to every rank; the call returns when
// every rank has acknowledged it, or fails. Each rank process runs a RankMapper (rank_mapper.h): a
// C++ thread that takes its jobs in order and runs them on that rank's own backend. Nothing on this
// path is Python: the scheduler's side runs on the pool's mapper thread, the rank's side on its own
// thread.
//
// Transport: one file in /dev/shm per group (group_path() in kvasync._group), mapped by the
// scheduler and every rank. Per rank: a ring of kGroupRingSlots jobs {seq, kind, pages} written by
// the scheduler only, the rank's count of jobs done and each job's result {ok, error} written by
// that rank only. Wake-ups are non-private futexes on 32-bit words of the file: a rank waits on
// its `posted` word, the scheduler on the header's `acks` word (every rank bumps it after each
// job, at join and at leave). Every futex wait has a timeout (a slice of the caller's deadline).
//
// Invariants:
//  - An alloc completes only when every rank has mapped: GroupBackend::map succeeds only when the
//    local map and every rank's job succeeded. On any failure it unmaps locally and posts an
//    unmap of the same pages to every rank (a rollback), and waits for those within what is
//    left of the map's deadline: the pool's "map failed, nothing mapped" holds on every device
//    when the failure is reported (a rank still busy past the deadline is the exception, and the
//    error says so). The error names the rank and says what happened to it.
//  - Jobs of a rank run in the order posted (one poster: the pool's mapper thread). A rollback
//    posted behind a map that is still running (a slow rank past the deadline) runs after it, so
//    the rank ends unmapped without anyone waiting for it.
//  - A rank applies a job against its own record of what it has mapped: a map skips pages it
//    already holds, an unmap touches only pages it holds. So a rollback or a repeated unmap is
//    harmless, and a rank's pages are always known (it unmaps them all when it leaves).
//  - Every wait has a deadline: the scheduler's wait for acks (map_timeout / unmap_timeout of the
//    group, since Backend::map carries no deadline of its own; the pool's waiter still fails at
//    its own deadline), a rank's join (the file may not exist yet), a rank's wait for jobs (a
//    slice, after which it checks that the scheduler is alive), close and leave.
//  - Processes are identified by pid and start time (/proc/PID/stat field 22, against pid reuse),
//    as in the share ledger (Note [Share ledger]). A rank that dies (kill -9) fails every wait on
//    it at its next slice (kLivenessSlice), naming the rank; the group is then broken: every later
//    map fails at once, since that rank's device has lost its pages (unmaps succeed: a dead
//    process's memory is gone with it). A rank slot is taken once: a replacement process is
//    refused (its device has none of the group's pages); reopen the group instead.
//  - A rank that never starts: a map waits for every rank to have joined, with its deadline, and
//    fails naming the ranks that did not; SchedulerGroup::wait_ready does the same at open.
//  - The scheduler exiting (or closing the group): each rank notices within kLivenessSlice (its
//    futex slice) once the backend call it is in (if any) returns, unmaps every page it holds,
//    marks itself left, and its thread ends.
//  - fork(): a group and a rank mapper belong to the process that opened them. A forked child
//    inherits the objects (never the threads); there, closing touches nothing shared (the file,
//    the rings, the rank's state and pages stay the parent's) and nothing is posted.
//  - A rank's own map is not the group's: a map that one rank did is rolled back when another
//    rank fails it or is late, so a rank must not touch a page (vLLM's worker zeroes the null
//    block's) because it mapped it. Once a map succeeded everywhere the scheduler stores its job's
//    number in every rank's `committed` word (SchedulerGroup::commit); a rank holds a page
//    *committed* (RankMapper::committed_page_ids) when the job that mapped it is at or below that
//    word. No rollback can be pending for such a page: a rollback is posted before the map's
//    outcome returns, so before any later commit, and a rank acks the committed job only after
//    every job before it in its ring, the rollback included. This needs the group's maps to run
//    one at a time, as the pool's one mapper thread calls GroupBackend::map: two maps at once
//    could commit the later before the earlier's rollback is posted. (A rank whose unmap failed
//    keeps listing that page as committed until it is mapped again: harmless for the null block,
//    which is never unmapped while the engine runs.) (The vLLM plugin's worker waited for
//    the null block's page in its own record and zeroed it; when the other rank failed that map,
//    or was late, as ranks join under load, the rollback unmapped the page under the write and
//    the worker died of SIGSEGV: seen with tests/test_vllm_plugin.py's rank processes and a rank
//    that fails the map just after the other mapped it; tests/cpp/group_stress.cpp checks it.)
//  - Only the scheduler writes a ring slot's job and a rank's `head` and `committed`; only rank r
//    writes rank r's results and counters. Every word shared is a lock-free std::atomic
//    (address-free across processes).
//
// Limitations: one pid namespace (a pid is checked in /proc); the scheduler's process needs a
// local backend of the group's geometry for the ranges' addresses (mapped too, or with
// map_local false only reserved); rank-side device fences (unmap only after that rank's GPU
// work) are the cuda integration's business and not done here; the file of a scheduler killed
// with SIGKILL stays in /dev/shm until the next scheduler of that name replaces it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/process.h"

namespace kvasync {

// A group that cannot be used (a rank that died or never joined, a name in use, a file that does
// not match). Crosses into Python as KVAsyncError.
struct GroupError : BackendError {
  using BackendError::BackendError;
};

constexpr uint64_t kGroupMagic = 0x3150524730505456ULL;  // "VTP0GRP1" read little-endian
constexpr uint32_t kGroupVersion = 2;  // 2: RankRecord::committed
constexpr int kGroupMaxRanks = 16;
constexpr int kGroupRingSlots = 32;
constexpr int kGroupErrorBytes = 200;
// How often a waiter re-checks that the processes it waits for are alive, at most.
constexpr auto kLivenessSlice = std::chrono::milliseconds(20);

enum class GroupJobKind : uint32_t { kMap = 1, kUnmap = 2 };
enum class RankState : uint32_t { kAbsent = 0, kJoined = 1, kLeft = 2, kRefused = 3 };

struct alignas(64) GroupSlot {
  std::atomic<uint64_t> seq;  // the job's number, stored last by the scheduler
  std::atomic<uint32_t> kind;
  std::atomic<int64_t> first;
  std::atomic<int64_t> count;
  std::atomic<uint64_t> done_seq;  // = seq once the rank has run it (stored last by the rank)
  std::atomic<uint32_t> ok;
  char error[kGroupErrorBytes];  // the rank's error when !ok
};

struct alignas(64) RankRecord {
  std::atomic<uint32_t> state;  // RankState
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;
  std::atomic<uint32_t> posted;  // futex word the rank waits on (bumped per job and at close)
  std::atomic<uint64_t> head;    // the last job posted (its seq); scheduler's
  std::atomic<uint64_t> done;    // the last job run; the rank's
  std::atomic<int64_t> mapped_pages;  // pages the rank holds now; the rank's
  // The last job whose map every rank did (the group's map succeeded); the scheduler's. Never
  // goes down. Note [Tensor parallel group]: committed pages.
  std::atomic<uint64_t> committed;
  char note[kGroupErrorBytes];  // why it left or was refused: written once, before `state`
  GroupSlot ring[kGroupRingSlots];
};

struct GroupHeader {
  std::atomic<uint64_t> magic;  // stored last at creation: a file without it is not ready
  uint32_t version;
  uint32_t num_ranks;
  uint64_t file_bytes;
  int64_t num_pages;
  int64_t page_size;
  int32_t num_ranges;
  std::atomic<uint32_t> open;  // 1 while the scheduler has the group open
  std::atomic<int32_t> scheduler_pid;
  std::atomic<uint64_t> scheduler_start_time;
  alignas(64) std::atomic<uint32_t> acks;  // futex word the scheduler waits on
};

struct GroupFile {
  GroupHeader header;
  RankRecord ranks[kGroupMaxRanks];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");

namespace group_detail {

using Clock = std::chrono::steady_clock;

// Who a process is (csrc/common/process.h), shared with the ledger.
using kvasync::own_start_time;
using kvasync::process_alive;

void futex_wake(std::atomic<uint32_t>& word);
// FUTEX_WAIT while the word is `seen`, at most `timeout`; the caller re-checks either way.
void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, Clock::duration timeout);

// Copies `text` into a fixed buffer, NUL-terminated, cut at a UTF-8 character boundary.
void copy_text(char* out, size_t size, const std::string& text);
std::string read_text(const char* in, size_t size);

// Saturating now + seconds; `seconds` must be finite and >= 0 (std::invalid_argument).
Clock::time_point deadline_after(double seconds);

// Maps the whole file at `fd` read-write; throws GroupError.
GroupFile* map_file(int fd, const std::string& path);
void unmap_file(GroupFile* file);

std::string describe_pages(int64_t first, int64_t count);

}  // namespace group_detail
}  // namespace kvasync
