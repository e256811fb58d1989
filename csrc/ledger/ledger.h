// Ledger: one device's memory budget shared by allocators in several processes.
//
// Note [Share ledger]
// ~~~~~~~~~~~~~~~~~~~
// Rationale: co-located engines each map pages from one device. Without a common account, each
// sees only its own limit, and a second engine starting next to a busy first one races it for the
// driver's memory (seed 001). The ledger is that account: a file in /dev/shm, mapped by every
// allocator of the share, with one entry per allocator.
//
// Approach: an entry's `committed_bytes` counts the pages its pool has claimed for mapping, has
// mapped, or is unmapping. A pool *charges* pages to its entry before it queues their map
// (ShareMember::grant, under the ledger lock: the sum of every live entry plus the charge must
// stay within the share's budget, the smallest `budget_bytes` of the live entries) and releases
// them when they are unmapped again (an atomic subtraction, no lock). So a map that would take the
// share past its budget never reaches the backend: the pool's waiter waits, with its deadline,
// exactly as at its own memory limit. A refill of the reserve is granted only real headroom: none
// while another allocator of the share has a request short of budget.
//
// Wake-ups: every release bumps `release_seq` in the header and FUTEX_WAKEs it (a non-private
// futex: it works across processes mapping the file). Each allocator has a watcher thread
// (ShareMember) blocked in FUTEX_WAIT on that word with a timeout (kTick), never busy: woken, it
// re-plans its pool's maps, applies a limit set from outside, gives its reserve back while
// another allocator is short of budget, and publishes its figures into its entry.
//
// Note [Fair share under pressure]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The budget alone is first come, first served: an engine that holds most of it recycles its own
// freed blocks for its next requests (the hot path needs no grant), so a co-located engine whose
// load rises later waits for memory that never comes back (measured on the H200: fewer requests
// within the SLO than two static halves). And budget / members is no better where KV memory
// binds: with one hot model among N, a static 1/N starves the hot one while the cold ones sit on
// memory they do not use. So the share divides its budget by *demand*.
//
// Demand: each member publishes in its entry (`demand_bytes`) the pages it wants now: the most
// of (a) the blocks it holds plus those its waiters ask for, and (b) what its engine reported
// (Allocator.set_demand: the engine's scheduler reports, each loop, the blocks its running
// requests hold and need for their next step plus the next-step need of the waiting requests
// that fit its batch), in pages of the fewest blocks a page holds, at most its own limit. A
// report lapses after kDemandTtl without a new one (an engine stuck or gone stops claiming).
// What a report claims beyond (a) is believed only while requests follow it (Note [Demand
// claims] in limit_policy.h): for kClaimHold (1 s) after the claim, or after the pool's last
// request that needed pages (one still waiting renews it); a report renews nothing. So a member
// that only claims stops counting within kClaimHold + kTick, however often it reports.
// The pool publishes it at each watcher tick, when a waiter arrives, when an alloc_nowait misses
// and on each report; a report that changes it wakes every watcher (the ledger's futex).
//
// Fair share (water-filling, max-min fair over demands), over the live members with budget B
// and demands d_i (bytes): when sum d <= B, f_i = d_i + (B - sum d) / n (the slack is split
// evenly); otherwise f_i = min(d_i, L), with L the level at which sum min(d_i, L) = B. Each f_i
// is floored to whole pages of its member (share_fair_shares() computes it; tests check it).
// Entitled: e_i = min(d_i, f_i). Unmet: u_i = max(0, e_i - committed_i).
//
// Pressure on member i: another member is blocked (short of budget with a waiter), or the
// share is short (sum u > B - sum committed) and another member has u_j > 0. Under pressure,
// i's pool is held to a memory limit of max(1, f_i) pages when its own limit is higher (Note
// [Limit policy] in limit_policy.h): it stops growing, keeps no reserve, unmaps free pages at
// once, and pages over the limit drain (no block is handed out from them; a scheduler reading
// drain_from_block() vacates the requests holding them, so the memory comes back within a step).
// Its own waiters are not failed: a request above the fair share waits, with its deadline.
//
// Grants (ShareMember::grant, under the lock): a map of member i is granted at most
// B - sum committed - sum_{j != i} u_j: never the budget another member is entitled to and
// wants, so that memory given back under pressure is not taken again by the one that gave it.
// Except below the minimum: a map for a request of member i (not a refill) is granted at least
// min(B - sum committed, floor(B / n) - committed_i), whatever the others claim. Their u_j rest
// on demand they report, which nothing checks: kept for a claim while a member that holds more
// than its share does not vacate, the free budget waited unused beside a member held below its
// minimum (issue 27: 5 of 16 pages free, a request for budget / members timed out after 3 s).
// The request is i's demand (published before the grant), so i takes no more than its own
// guaranteed minimum, and the minima of all members fit the budget together.
// A refill gets nothing while another member is blocked. available_blocks() counts, of the
// share, what i can count on (room_pages): the larger of that headroom and of
// max(f_i, floor(B / n)) - committed_i (by wanting more, any member gets at least B / n).
//
// Invariants (tests/test_share_policy.py checks them after every step of a random run):
//   - Budget: sum committed <= B at all times (grants under the lock; releases only subtract).
//     A budget lowered by a newcomer can leave the share over it; then nothing is granted.
//   - Minimum: under pressure, a member's limit is at least min(own limit, g_i) pages, with the
//     guaranteed minimum g_i = min(d_i, floor(B / n)) (water-filling gives f_i >= g_i: a level
//     below B / n would leave budget over). So a cold model's first request gets its pages as
//     soon as the others' excess is unmapped or vacated, however hot they are. And no request
//     waits below it while budget is free: the free budget goes to it at its grant, whatever
//     the others claim (the grants' rule above); a member blocked below it with budget free is
//     granted at the next release in the share (a wake-up) or tick (tests/test_share_policy.py;
//     `make soak`'s fair-share part, tests/soak_fair_share.py, checks it under churn).
//   - Fast reclaim: when a member blocks or its demand rises, every watcher is woken at once
//     (FUTEX_WAKE), and within that tick an idle member (no block in use) queues the unmap of
//     every page it holds beyond max(1, f_i) and of its whole reserve, and gives back the
//     backend's cached handles (cuda's spare pages: device memory the ledger does not charge);
//     the handles its unmaps leave go at the tick their release wakes. A watcher also ticks
//     every kTick without a wake: the bound is one kTick (100 ms) plus the unmaps' own time.
//   - No oscillation: a member's fair-share limit goes down at once (a step-down serves a
//     waiter) but goes up again only kRegrowHold (LimitPolicy) after its last step-down, and
//     never stays below min(own limit, g_i) meanwhile, where the g_i in force is the highest of
//     the last kRegrowHold: it rises at once and falls as that peak ages past the hold, except
//     to B / n at once (a member joining is no flap, and a minimum held from fewer members would
//     keep the newcomer waiting). An engine's demand, and g_i with it, flaps from loop to loop:
//     followed flap by flap it lifted the limit 37 times in 1.5 s past the hold, and a minimum
//     that fell to the g_i of the tick its peak lapsed at let a flap back up lift the limit
//     within the hold (two turns 210 ms apart: tests/test_share_policy.py).
//     The bound: two fall->rise turns of a member's limit come less than kRegrowHold (300 ms)
//     apart only when the later one rises to a g_i higher than every g_i of the hold before it
//     (one over a lower B / n counting at B / n): its demand growing to a new peak, not
//     flapping. Without such a peak the turns are at least 300 ms apart, at most 4 in any
//     second: 3 turns in a second keep the bound; 2 turns 202 ms apart break it unless the later
//     one is to a new peak. The ledger shows the limit, not g_i: an observer can tell only that
//     a rise to more than B / n is no such peak. Pages a member gave back stay with the member
//     entitled to them at least kRegrowHold (the grants' rule above keeps them from it for as
//     long as that member wants them). Pressure lifts when nobody is short, and the own limit
//     (configured, or `kvasync limit`) comes back after the same hold.
//   - No waiter waits while its map could be granted: a member blocked re-plans at each release
//     in the share (a wake-up) and each tick; a member's own waiters, within its entitlement,
//     are granted as soon as the others' excess comes back.
//
// Dead processes: an entry's owner is identified by pid *and* the process's start time (from
// /proc, against pid reuse) *and* its pid namespace (the inode of /proc/self/ns/pid): a pid means
// something only in its own namespace, and containers that share /dev/shm need not share one. An
// entry of this process's namespace whose process is gone (no such pid, a zombie, or another
// start time) is reclaimed; an entry of another namespace is reclaimed when its watcher's
// heartbeat (`heartbeat_ns`, CLOCK_MONOTONIC, stored every kTick) is older than
// kForeignStaleAfter. Reclaiming happens under the lock at the next grant or snapshot, and by every
// watcher at least every kReclaimEvery.
//
// Slots are reused: each join and each leave (or reclaim) bumps the slot's `generation`, and a
// member acts on its slot only while the generation is the one it joined with. So a member whose
// entry was reclaimed (thought dead) never charges, releases or publishes into a newcomer's entry.
//
// fork(): a membership belongs to the process that joined. A forked child inherits the object
// (never its watcher thread); in the child it grants nothing, publishes nothing, and leaving does
// not touch the parent's entry. An allocator opened in the child joins anew with its own pid.
//
// Access (Note [Ledger access]): the file is refused at open unless its owner and mode are the
// ones the operator chose, so that another user cannot plant a file that an allocator then joins.
//
// Stale files: the last member to leave removes the file, under the lock; a joiner that got the
// lock of a file no longer at its path (st_nlink 0 or another inode) opens the path anew.
// `kvasync ls --prune` removes the files of shares whose members are all dead (Ledger::prune).
// A file removed under live members (an operator's rm, systemd's RemoveIPC): Note [Ledger file
// identity].
//
// The lock is a robust process-shared mutex, always taken with a deadline (pthread_mutex_clocklock
// on CLOCK_MONOTONIC; a deadline far away saturates, and a caller's timeout that is negative or
// not finite is refused with std::invalid_argument, never taken for an unusable lock); a holder that died leaves EOWNERDEAD to
// the next taker, which marks it consistent and reclaims dead entries (the only state a holder
// can leave half-written is its own entry, and it is dead).
//
// Invariants:
//   - Only its owner changes an entry's figures; other processes change only `requested_limit`
//     (+ `limit_generation`), and the lock holder frees the entries of dead processes.
//   - Every figure is an std::atomic that is always lock-free (address-free across processes).
//   - The layout carries a magic, a version, its sizes and a check word; a file that does not
//     match is refused with a LedgerError (KVAsyncError in Python), never used.
//   - One check decides whether a file can be used (Ledger::damage(): its size, its header, and
//     every entry's state, 0 or 1, and a live entry's figures), and every user applies it: open
//     (size and header, before the lock is touched), joining, re-registering, every grant,
//     snapshot (so `kvasync ls` and `top`), set_limit and prune. A file refused by one is refused
//     by all: nobody joins or charges a file that `ls` calls corrupt, and prune keeps it (the
//     error says to remove it). Reclaiming frees live entries (state 1) only: an entry of another
//     state is damage to report, not a dead member to repair silently.
//
// Note [Ledger access]
// ~~~~~~~~~~~~~~~~~~~~~
// By default a share is one user's: the file must be a regular file owned by the effective user,
// of mode 0600 exactly (created so). To share a device between users, each sets
// KVASYNC_SHARE_GROUP=<group> (LedgerAccess::group): the file is created with that group and
// mode 0660, and accepted when its group is that one, its mode is 0660 exactly, and its owner is
// this user, root, or a member of the group. Anyone in the group can then read every entry and set
// any member's limit, which is what sharing a device grants; nobody outside it can open the file.
// Exactly: a mode the operator did not document (0400, 0700, 0640, a setuid or sticky bit) is
// refused, naming the mode found and the one expected, as a wrong owner is.
//
// Note [Ledger file identity]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rationale: the file can be removed while members have it mapped (an operator's rm; systemd's
// RemoveIPC cleans a user's /dev/shm at logout). The members keep the removed file, a joiner
// finds no file at the path and creates one: two ledgers, each granting the whole budget (A held
// 12 of 16 pages, B mapped 12 more, and nobody noticed).
//
// Approach: re-register, since it keeps serving. A member knows the file it holds by st_dev and
// st_ino. Its watcher compares them with the path's (lstat) at every tick, before the tick's
// first touch of the file, and every grant compares them under the lock before it charges. A
// member whose file is no longer at the path charges nothing more in it (its grants wake every
// watcher of the old file, so the others notice at once too); its watcher opens the file at the
// path, creating it when absent, takes an entry there carrying its committed pages (and its
// demand), then frees its entry in the old file. The budget stays whole in the file at the path.
// A joiner cannot see the members of a removed file, so a *fresh* file grants nothing during
// its first kFreshSettle (header.settle_until_ns): members of a removed file re-register into it
// before any newcomer charges. Grants refused so are no shortage (nobody is marked blocked): the
// pool plans again at its watcher's next tick (the watcher wakes at the settle's end), and a
// waiter that times out meanwhile says why (ShareMember::trouble()).
//
// The bound: a member notices within one watcher tick (kTick, 100 ms) plus its scheduling delay,
// and charges nothing in the old file from then on. Two ledgers both granting exist only when a
// member's watcher runs more than kFreshSettle (200 ms) late, or for a grant whose identity check
// passed in the microseconds before the rm. Either is then seen within a tick: the member
// re-registers with its pages, the share shows past its budget, and nothing is granted until it
// is back within it (as when a newcomer lowers the budget).
//
// A file at the path that cannot be used (another owner or mode, corrupt, truncated, full, its
// lock unusable) is not joined: the member charges nothing, says why (trouble()), and tries
// again each tick; its pages stay charged in the old file meanwhile.
//
// Truncation cannot be made safe, only noticed. Pages of a mapped file cut off by ftruncate fault
// on the next access (SIGBUS), and that access can come from any thread of a member (an alloc
// reads the budget, a release subtracts) at any moment after the truncation; catching SIGBUS
// would need a signal handler, which a library must not install. What is done: every taker of
// the lock checks the size (fstat, no touch) before touching the lock, and the watcher checks it
// before each tick's first touch; a member that finds its file short lets go of it (unmaps it,
// touches it no more) and charges nothing until the file at the path can be used again (removed,
// it re-registers its pages into a new one); a joiner, snapshot or prune refuses it as
// truncated. So a truncation landing while a member is idle is a clear error; one racing an
// access kills that member with SIGBUS. Never truncate a ledger file; remove it (that is safe).
//
// Invariants: a member has at most one live entry in the file at the path, and its committed
// pages (charged_pages_, kept by the member) are charged in exactly one file: the old entry is
// freed only after the new one, carrying them, is live. The membership (ledger_, slot_,
// generation_) changes only on the watcher's thread, under ShareMember::mutex_.
//
// lock order: PagePool::mutex_ -> Ledger lock -> ShareMember::mutex_ (a leaf, never held across
// a wait). Nothing waits on the pool while holding the ledger.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/wakeup.h"

namespace kvasync {

class PagePool;

// A ledger that cannot be used: missing rights, a corrupt or incompatible file, a lock that stays
// taken past its deadline. Crosses into Python as KVAsyncError.
struct LedgerError : BackendError {
  using BackendError::BackendError;
};

constexpr uint64_t kLedgerMagic = 0x3152474445'4c4b56ULL;  // "VKLEDGR1" read little-endian
// 2: pid namespace, heartbeat, slot generation; 3: demand (Note [Fair share under pressure])
constexpr uint32_t kLedgerVersion = 3;
constexpr int kLedgerEntries = 64;
constexpr int kLedgerNameBytes = 64;
constexpr int kLedgerOpBytes = 64;

struct alignas(64) LedgerEntry {
  std::atomic<uint32_t> state;  // 0 free, 1 live
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;  // the owner's start time (/proc/PID/stat field 22)
  std::atomic<uint64_t> serial;      // unique per join: tells two allocators of one process apart
  std::atomic<uint64_t> pid_ns;      // the owner's pid namespace (inode of /proc/self/ns/pid)
  std::atomic<int64_t> heartbeat_ns;  // CLOCK_MONOTONIC, stored by the owner's watcher each tick
  std::atomic<uint32_t> generation;   // bumped at each join and leave of this slot
  char name[kLedgerNameBytes];
  std::atomic<int64_t> committed_bytes;  // charged against the budget (Note [Share ledger])
  std::atomic<int64_t> mapped_bytes;
  std::atomic<int64_t> reserved_bytes;
  std::atomic<int64_t> used_bytes;
  std::atomic<int64_t> limit_bytes;  // the limit in force
  std::atomic<int64_t> page_bytes;
  std::atomic<int64_t> budget_bytes;  // this allocator's device_budget (0 = none of its own)
  std::atomic<int64_t> waiters;
  std::atomic<int64_t> blocked;  // waiters short of the share's budget
  std::atomic<int64_t> requested_limit;  // set from outside: bytes, or 0 = back to configured
  std::atomic<uint32_t> limit_generation;
  std::atomic<uint32_t> op_generation;  // odd while `op` is being written
  std::atomic<int64_t> op_started_ns;   // CLOCK_MONOTONIC, 0 when idle
  char op[kLedgerOpBytes];
  // Pages this allocator wants now, in bytes (Note [Fair share under pressure]); its owner's.
  std::atomic<int64_t> demand_bytes;
  // The pool's whole capacity (every page id mapped), so that a reader tells "no limit" (the
  // limit in force is the capacity) from a limit. In the entry's padding: sizeof is unchanged,
  // so files of older writers of this version still open (they leave it 0: unknown).
  std::atomic<int64_t> capacity_bytes;
};
static_assert(sizeof(LedgerEntry) == 320, "the entry's layout is the file's: bump kLedgerVersion");

struct LedgerHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t file_bytes;
  uint32_t num_entries;
  uint32_t entry_bytes;
  uint64_t check;  // mixes the words above: a header overwritten with other data is refused
  alignas(64) pthread_mutex_t mutex;
  alignas(64) std::atomic<uint32_t> release_seq;  // the futex word (Note [Share ledger])
  std::atomic<uint64_t> next_serial;
  std::atomic<uint64_t> repairs;  // lock holders found dead
  // Note [Ledger file identity]: CLOCK_MONOTONIC until which a fresh file grants nothing (its
  // creation plus kFreshSettle), written before the file is linked into place. 0 in a file of an
  // older writer: settled. It fits the header's padding: sizeof(LedgerHeader) is unchanged, so
  // files of older writers of this version still open.
  int64_t settle_until_ns;
};

struct LedgerFile {
  LedgerHeader header;
  LedgerEntry entries[kLedgerEntries];
};

// One allocator's entry as read by snapshot().
struct EntryView {
  int slot;
  int32_t pid;
  uint64_t serial;
  std::string name;
  int64_t committed_bytes, mapped_bytes, reserved_bytes, used_bytes, limit_bytes, page_bytes,
      budget_bytes, waiters, blocked, requested_limit, demand_bytes, capacity_bytes;
  std::string op;
  double op_age_s;
  uint64_t pid_ns;
  bool foreign;  // of another pid namespace than the reader's: `pid` is not one of its pids
  double heartbeat_age_s;
};

// Who may own a ledger file, and how it is created (Note [Ledger access]).
struct LedgerAccess {
  int64_t group = -1;  // a gid shared between users, or -1: the file is this user's alone
};

// One mapping of a ledger file. One per path and process (Ledger::open shares them).
class Ledger {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kLockTimeout = std::chrono::milliseconds(200);

  // Opens the file at `path`, creating it when `create` and it is missing.
  // Throws LedgerError when it cannot be used, or its owner or mode is not what `access` allows.
  static std::shared_ptr<Ledger> open(const std::string& path, bool create,
                                      const LedgerAccess& access);
  static std::shared_ptr<Ledger> open(const std::string& path, bool create) {
    return open(path, create, LedgerAccess{});
  }
  ~Ledger();
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  const std::string& path() const { return path_; }
  const LedgerAccess& access() const { return access_; }
  // Whether the file mapped is still the one at path() (not removed by a last member leaving, an
  // operator or systemd; not replaced): st_dev and st_ino (Note [Ledger file identity]).
  bool still_linked() const;
  LedgerFile& file() { return *file_; }

  // Why the file cannot be used, or "" when it can (Note [Share ledger], Invariants): shorter
  // than the layout (checked first, with fstat: nothing mapped is touched then), a header that
  // does not match, an entry whose state is neither 0 nor 1, a live entry with impossible
  // figures. Every user of the file applies this one check; the lock should be held for the
  // entries to be read consistently. Never throws.
  std::string damage() const;
  // Only the size (fstat): whether touching the mapping is safe. "" when it is.
  std::string size_damage() const;
  // Note [Ledger file identity]: whether the file is in its first kFreshSettle after creation.
  bool settling(Clock::time_point now) const;
  Clock::time_point settled_at() const;
  static constexpr auto kFreshSettle = std::chrono::milliseconds(200);
  // Test hook: the settle of files created from now on in this process (the C++ stress harness
  // runs rounds shorter than kFreshSettle).
  static void set_fresh_settle_for_test(std::chrono::nanoseconds settle);

  // The lock, taken with a deadline. Returns false at the deadline (or when the lock is unusable:
  // lock_failure() says which). A dead holder is repaired. Never throws.
  bool lock(Clock::time_point deadline) noexcept;
  void unlock();
  // Names the holder's pid when the lock stayed taken.
  std::string lock_failure(double timeout_s) const;
  // The process holding the lock now (from the robust mutex's owner thread), 0 when free, -1
  // when unknown. A hint for messages: it may have let go by the time it is read.
  int32_t holder_pid() const;

  // Lock held. Frees the live entries of processes that are gone; returns how many.
  int reclaim_dead_locked();
  // The share's budget: the smallest budget of the live entries, or INT64_MAX when none has one.
  int64_t budget_locked() const;

  // Every live entry (reclaiming dead ones first). Throws LedgerError when an entry is corrupt or
  // the lock stays taken past `timeout_s`.
  std::vector<EntryView> snapshot(double timeout_s);
  // Sets the limit of every allocator of process `pid`; returns how many. 0 bytes = back to the
  // configured limit.
  // Only entries of the caller's pid namespace: a pid names a process only there.
  int set_limit(int32_t pid, int64_t bytes, double timeout_s);
  // Reclaims dead entries and removes the file when no live member is left; returns whether it
  // removed it. Throws LedgerError when the lock stays taken past `timeout_s`, or the file is
  // damaged (damage(): it is kept, for the operator to remove).
  bool prune(double timeout_s);
  // Lock held: removes the file when it has no live entry, is undamaged and is still at path().
  bool remove_if_unused_locked();

  void notify();  // a release: bump the futex word and wake every watcher
  uint32_t seq() const { return file_->header.release_seq.load(std::memory_order_acquire); }
  // FUTEX_WAIT until the word moves from `seen`, or `timeout` passes.
  void wait(uint32_t seen, std::chrono::nanoseconds timeout);

  // Test hook: takes the lock and keeps it for `seconds` (a process killed meanwhile dies holding
  // it). Returns false when the lock could not be taken.
  bool hold_lock_for(double seconds);

 private:
  Ledger(std::string path, LedgerFile* file, int fd);

  std::string path_;
  LedgerAccess access_;
  LedgerFile* file_;
  int fd_;  // kept open for fstat: the size of the file mapped (size_damage)
  uint64_t device_ = 0, inode_ = 0;  // the file mapped, to tell it from a newer one at path_
  std::atomic<int> lock_error_{0};    // the last error that made the lock unusable
};

// Note [Fair share under pressure]: the water-filling of `budget` bytes over `demands` (bytes,
// negative read as 0): each member's fair share in bytes.
std::vector<int64_t> share_fair_shares(const std::vector<int64_t>& demands, int64_t budget);

// One allocator's membership of a share: its entry and its watcher thread.
class ShareMember : public std::enable_shared_from_this<ShareMember> {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kTick = std::chrono::milliseconds(100);
  static constexpr auto kReclaimEvery = std::chrono::milliseconds(250);
  // An entry of another pid namespace is dead when its heartbeat is this old: its pid cannot be
  // checked from here. Far above kTick, so that a busy but live watcher is never taken for dead.
  static constexpr auto kForeignStaleAfter = std::chrono::seconds(10);
  // A grant runs under the pool's mutex (and so may hold up an alloc): it waits for the ledger
  // lock only briefly; when that fails, the watcher's next tick plans the map again.
  static constexpr auto kGrantLockTimeout = std::chrono::milliseconds(50);
  // Joining waits this long for the ledger's lock, leaving kLeaveLockTimeout (on the caller's
  // thread: opening and closing an allocator).
  static constexpr auto kJoinLockTimeout = std::chrono::seconds(1);
  static constexpr auto kLeaveLockTimeout = std::chrono::milliseconds(200);

  // Joins: takes a free entry. Throws LedgerError when the ledger is full or unusable.
  ShareMember(std::shared_ptr<Ledger> ledger, const std::string& name, int64_t budget_bytes,
              int64_t page_bytes);
  ~ShareMember();
  ShareMember(const ShareMember&) = delete;
  ShareMember& operator=(const ShareMember&) = delete;

  // Starts the watcher for `pool` (held weakly: the watcher never keeps a pool alive).
  void start(std::weak_ptr<PagePool> pool);
  // Stops the watcher (bounded) and leaves the ledger.
  void stop(double timeout_s);

  // The outcome of grant(): pages charged, and when the lock stayed taken past the caller's
  // deadline (nothing charged), who held it (-1: unknown). `held`: the share grants nothing now
  // for a reason other than its budget (Note [Ledger file identity]: a fresh file settling, a
  // file removed, replaced, truncated or damaged; trouble() says which): nothing charged, no
  // shortage either; plan again at the watcher's next tick.
  struct Grant {
    int64_t granted = 0;
    bool lock_busy = false;
    int32_t holder_pid = 0;
    bool held = false;
  };
  // PagePool side. Charges up to `pages` pages within the budget less what the other members are
  // entitled to and want (Note [Fair share under pressure]); a refill gets nothing while another
  // member is blocked. Waits for the ledger's lock until `lock_deadline` only (now: a try).
  // Never throws (it runs under the pool's mutex and on the mapper's thread).
  Grant grant(int64_t pages, bool refill, Clock::time_point lock_deadline) noexcept;
  void release(int64_t pages);  // no ledger lock: an atomic subtraction; notify() after a batch
  void notify();
  void set_blocked(int64_t waiters);
  bool blocked() const;
  // Publishes this member's demand (pages it wants now). Returns whether it changed; the caller
  // wakes the watchers (notify) when it did.
  bool set_demand(int64_t pages);
  // Note [Fair share under pressure], read without the lock (atomics).
  struct Fair {
    bool pressure = false;   // another member is blocked, or the share short and another unmet
    int64_t fair = -1;       // f_i in pages of this member; -1 when the share has no budget
    int64_t guaranteed = 0;  // g_i = min(d_i, budget / members) in pages
    int64_t equal_share = 0;  // budget / members in pages (0 without a budget)
  };
  Fair fair_share() const;
  bool pressure() const { return fair_share().pressure; }
  int64_t fair_share_pages() const { return fair_share().fair; }
  // The pages this allocator can count on getting: the budget the others are not entitled to,
  // or what is left of its fair share (at least budget / members) when more (the others give
  // it back under pressure).
  // INT64_MAX without a budget. Read without the lock (atomics): a hint, never a grant.
  int64_t room_pages() const;
  // The share's whole budget in pages of this allocator (INT64_MAX without one): a request
  // larger than this can never be served. Read without the lock (atomics).
  int64_t budget_pages() const;
  std::string describe_budget() const;

  // Figures published by the watcher. `limit`: the limit in force; `capacity`: what the pool
  // holds with every page id mapped (the limit in force when there is none).
  void publish(int64_t mapped, int64_t reserved, int64_t used, int64_t limit, int64_t capacity,
               int64_t waiters, const std::string& op, double op_age_s);
  // The limit requested from outside, when it changed since the last call: bytes, or 0 = back to
  // the configured limit. -1 when unchanged.
  int64_t take_requested_limit();

  // Whether this process still owns the entry it joined with: false in a forked child, once
  // the entry was reclaimed (its owner thought dead) and its slot possibly reused, or while it
  // holds no file (Note [Ledger file identity]: its file was truncated).
  bool owns_entry() const;
  int64_t page_bytes() const { return page_bytes_; }
  // The share's file: the same path across re-registrations.
  const std::string& path() const { return path_; }
  // Why this member charges nothing now for a reason other than the budget (Note [Ledger file
  // identity]), for a waiter's timeout message; "" when none.
  std::string trouble() const;

 private:
  static void run(std::shared_ptr<ShareMember> self, std::weak_ptr<PagePool> pool);
  void leave();
  // mutex_ held. Whether the entry joined is still this member's, in the file it holds.
  bool owns_entry_locked() const;
  LedgerEntry& entry() { return ledger_->file().entries[slot_]; }
  const LedgerEntry& entry() const { return ledger_->file().entries[slot_]; }
  // Lock of `ledger` held, mutex_ held: fills free entry `slot` with this member's identity and
  // figures (committed: `committed_bytes`, demand: `demand_bytes`) and makes it live.
  void take_entry_locked(Ledger& ledger, int slot, int64_t committed_bytes, int64_t demand_bytes);
  // The watcher's thread, before each tick's first touch of the file (Note [Ledger file
  // identity]): lets go of a truncated file, and re-registers when the file held is no longer
  // the one at the path. Returns the file to wait on (null: none held).
  std::shared_ptr<Ledger> check_file();
  void reregister(const std::shared_ptr<Ledger>& old);
  void set_trouble(const std::string& why);

  const std::string path_;
  const LedgerAccess access_;
  const std::string name_;
  const int64_t budget_bytes_;
  int32_t pid_ = 0;            // the process that joined
  int64_t page_bytes_;
  // lock order: Ledger lock -> mutex_. A leaf: held only for reads and stores of the file's
  // atomics and of the fields below, never across a wait (Note [Ledger file identity]).
  mutable std::mutex mutex_;
  std::shared_ptr<Ledger> ledger_;  // null once let go of (truncated) until re-registered
  int slot_ = -1;
  uint64_t serial_ = 0;
  uint32_t generation_ = 0;    // the slot's generation at the join
  uint32_t seen_limit_generation_ = 0;
  int64_t charged_pages_ = 0;  // charged and not yet released: carried into a new file
  std::string trouble_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> left_{false};  // stored under mutex_ (a re-registration checks it there)
  Wakeup exited_;
  Wakeup wake_;  // wakes a watcher that holds no file (nothing to FUTEX_WAIT on)
  std::thread thread_;
};

}  // namespace kvasync
