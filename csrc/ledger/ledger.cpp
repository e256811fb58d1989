#include "ledger/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/futex.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>

#include "common/process.h"
#include "pool/page_pool.h"

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer intercepts pthread_mutex_lock and timedlock, not clocklock: told by hand that
// the ledger's lock was taken, it does not report each unlock as one of an unlocked mutex.
#include <sanitizer/tsan_interface.h>
#endif

namespace kvasync {
namespace {

static_assert(std::atomic<int64_t>::is_always_lock_free, "shared figures must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the futex word must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is 32 bits");

uint64_t header_check(const LedgerHeader& h) {
  // Not a cryptographic hash: it only tells a ledger header from other bytes.
  uint64_t x = h.magic ^ (uint64_t{h.version} << 32 | h.header_bytes);
  x = (x ^ h.file_bytes) * 0x9e3779b97f4a7c15ULL;
  x = (x ^ (uint64_t{h.num_entries} << 32 | h.entry_bytes)) * 0xbf58476d1ce4e5b9ULL;
  return x ^ (x >> 31) ^ sizeof(pthread_mutex_t);
}

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

timespec to_timespec(Ledger::Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux (libstdc++), the clock clocklock is given.
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch());
  timespec ts;
  ts.tv_sec = static_cast<time_t>(ns.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(ns.count() % 1000000000);
  return ts;
}

// A caller's timeout: finite and >= 0, or std::invalid_argument (a ValueError in Python). Never a
// reason to call the lock unusable.
double check_timeout(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    throw std::invalid_argument("timeout must be a finite number of seconds >= 0, got " +
                                std::to_string(seconds));
  }
  return seconds;
}

Ledger::Clock::time_point after(double seconds) {
  // Saturating: a deadline decades away is as good as any later one, and now + 1e10 s in
  // nanoseconds would wrap past INT64_MAX into the past (or an invalid timespec).
  constexpr double kFarAway = 1e9;  // about 31 years
  const double bounded = std::isnan(seconds) ? 0.0 : std::clamp(seconds, 0.0, kFarAway);
  return Ledger::Clock::now() + std::chrono::duration_cast<Ledger::Clock::duration>(
                                    std::chrono::duration<double>(bounded));
}

uint64_t own_pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// This process as the ledger records it. Cached per thread and keyed by pid: a forked child
// (whose threads start with the parent's cache) reads its own start time, not the parent's. No
// lock, so that nothing held across fork() can leave the child stuck.
struct Identity {
  int32_t pid = 0;
  uint64_t start_time = 0;
  uint64_t pid_ns = 0;
};

const Identity& self_identity() {
  thread_local Identity cached;
  const int32_t pid = getpid();
  if (cached.pid != pid) cached = Identity{pid, own_start_time(), own_pid_namespace()};
  return cached;
}

void copy_text(char* out, size_t size, const std::string& text) {
  size_t n = std::min(text.size(), size - 1);
  // Cut at a UTF-8 character boundary: never keep the lead bytes of a character without its
  // continuation bytes (10xxxxxx), which readers could not decode.
  if (n < text.size()) {
    while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  }
  std::memcpy(out, text.data(), n);
  std::memset(out + n, 0, size - n);
}

std::string read_text(const char* in, size_t size) {
  return std::string(in, strnlen(in, size));
}

// `op` is written by its owner while others read it, outside the lock (a sequence count tells a
// torn read): byte by byte as relaxed atomics, so that the race is one the language allows.
void store_op(char* out, size_t size, const std::string& text) {
  char staged[kLedgerOpBytes];
  copy_text(staged, sizeof staged, text);
  for (size_t i = 0; i < size && i < sizeof staged; ++i) {
    __atomic_store_n(&out[i], staged[i], __ATOMIC_RELAXED);
  }
}

std::string load_op(const char* in, size_t size) {
  char staged[kLedgerOpBytes];
  for (size_t i = 0; i < size && i < sizeof staged; ++i) {
    staged[i] = __atomic_load_n(&in[i], __ATOMIC_RELAXED);
  }
  return read_text(staged, std::min(size, sizeof staged));
}

void init_file(LedgerFile* file) {
  std::memset(static_cast<void*>(file), 0, sizeof(LedgerFile));
  LedgerHeader& h = file->header;
  h.magic = kLedgerMagic;
  h.version = kLedgerVersion;
  h.header_bytes = sizeof(LedgerHeader);
  h.file_bytes = sizeof(LedgerFile);
  h.num_entries = kLedgerEntries;
  h.entry_bytes = sizeof(LedgerEntry);
  h.check = header_check(h);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int rc = pthread_mutex_init(&h.mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) throw LedgerError(std::string("ledger: pthread_mutex_init: ") + strerror(rc));
}

const char* const kRemoveIt = ": stop the processes using it and remove the file";
// Ledger::lock_error_ when the file is shorter than the layout (errno values are positive).
constexpr int kLockTruncated = -1;

std::string truncated_text(const std::string& path, int64_t size) {
  return "the ledger file " + path + " is truncated (" + std::to_string(size) +
         " bytes, expected " + std::to_string(sizeof(LedgerFile)) + ")" + kRemoveIt;
}

// The header's part of Ledger::damage(): why the header is not this kvasync's layout, or "".
std::string header_damage(const std::string& path, const LedgerHeader& h) {
  if (h.magic != kLedgerMagic) {
    return "the ledger file " + path + " is not a kvasync ledger (bad magic)" + kRemoveIt;
  }
  if (h.version != kLedgerVersion) {
    return "the ledger file " + path + " has layout version " + std::to_string(h.version) +
           "; this kvasync uses version " + std::to_string(kLedgerVersion) + kRemoveIt;
  }
  if (h.header_bytes != sizeof(LedgerHeader) || h.entry_bytes != sizeof(LedgerEntry) ||
      h.num_entries != kLedgerEntries || h.file_bytes != sizeof(LedgerFile) ||
      h.check != header_check(h)) {
    return "the ledger file " + path + " is corrupt (its header does not match" +
           " this kvasync's layout)" + kRemoveIt;
  }
  return "";
}

// The entries' part of Ledger::damage(): an entry that is neither free (0) nor live (1), or a
// live one with figures no member writes.
std::string entries_damage(const LedgerFile& file) {
  for (int slot = 0; slot < kLedgerEntries; ++slot) {
    const LedgerEntry& e = file.entries[slot];
    const uint32_t state = e.state.load();
    if (state > 1) return "entry " + std::to_string(slot) + " has state " + std::to_string(state);
    if (state == 0) continue;
    const int32_t pid = e.pid.load();
    const int64_t committed = e.committed_bytes.load(), page = e.page_bytes.load();
    if (pid <= 0 || committed < 0 || e.mapped_bytes.load() < 0 || e.reserved_bytes.load() < 0 ||
        e.used_bytes.load() < 0 || page <= 0 || e.budget_bytes.load() < 0 ||
        e.waiters.load() < 0) {
      return "entry " + std::to_string(slot) + " holds impossible figures (pid " +
             std::to_string(pid) + ", committed " + std::to_string(committed) + ", page " +
             std::to_string(page) + " bytes)";
    }
  }
  return "";
}

std::string user_name(uid_t uid) {
  std::vector<char> buffer(16384);
  passwd pw, *found = nullptr;
  if (getpwuid_r(uid, &pw, buffer.data(), buffer.size(), &found) == 0 && found) {
    return std::string(pw.pw_name) + " (uid " + std::to_string(uid) + ")";
  }
  return "uid " + std::to_string(uid);
}

std::string group_name(gid_t gid) {
  std::vector<char> buffer(16384);
  group gr, *found = nullptr;
  if (getgrgid_r(gid, &gr, buffer.data(), buffer.size(), &found) == 0 && found) {
    return std::string(gr.gr_name) + " (gid " + std::to_string(gid) + ")";
  }
  return "gid " + std::to_string(gid);
}

// Whether user `uid` belongs to group `gid`: as its primary group or as a listed member.
bool user_in_group(uid_t uid, gid_t gid) {
  std::vector<char> buffer(16384);
  passwd pw, *found = nullptr;
  if (getpwuid_r(uid, &pw, buffer.data(), buffer.size(), &found) != 0 || !found) return false;
  if (pw.pw_gid == gid) return true;
  int count = 64;
  std::vector<gid_t> groups(count);
  if (getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &count) < 0) {
    groups.resize(count);
    if (getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &count) < 0) return false;
  }
  return std::find(groups.begin(), groups.begin() + count, gid) != groups.begin() + count;
}

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// Note [Ledger access]: refuses a file whose owner or mode the operator did not choose.
void check_access(const std::string& path, const struct stat& st, const LedgerAccess& access) {
  const uid_t me = geteuid();
  std::string expected;
  bool ok = S_ISREG(st.st_mode);
  // Exactly the documented modes (Note [Ledger access]): no bit more, no bit less.
  const mode_t mode = st.st_mode & 07777;
  if (access.group < 0) {
    ok = ok && st.st_uid == me && mode == 0600;
    expected = "owned by " + user_name(me) +
               ", read and write for the owner alone (mode 0600); to share a device between "
               "users, set KVASYNC_SHARE_GROUP to a group they all belong to";
  } else {
    const auto gid = static_cast<gid_t>(access.group);
    // root may own it too: it could read and change any file anyway, so trusting it grants
    // nothing; and root is how an operator creates a group's file without being in the group.
    ok = ok && st.st_gid == gid && mode == 0660 &&
         (st.st_uid == me || st.st_uid == 0 || user_in_group(st.st_uid, gid));
    expected = "group " + group_name(gid) +
               ", read and write for the owner and the group alone (mode 0660), owned by " +
               user_name(me) + ", root or a member of that group (KVASYNC_SHARE_GROUP)";
  }
  if (ok) return;
  throw LedgerError("refusing the ledger file " + path + ": it is " +
                    (S_ISREG(st.st_mode) ? "" : "not a regular file, ") + "owned by " +
                    user_name(st.st_uid) + ", group " + group_name(st.st_gid) + ", mode " +
                    mode_text(st.st_mode) + "; expected " + expected +
                    ". Remove it if nobody should be using it");
}

// Note [Ledger file identity]: the settle of the files this process creates (a test hook may
// shorten it).
std::atomic<int64_t> g_fresh_settle_ns{
    std::chrono::duration_cast<std::chrono::nanoseconds>(Ledger::kFreshSettle).count()};

// Creates the file complete under a temporary name, then links it into place: nobody ever maps a
// half-initialised ledger, and of two processes creating it at once one wins, the other opens it.
void create_file(const std::string& path, const LedgerAccess& access) {
  std::random_device random;
  const std::string temp = path + ".tmp." + std::to_string(getpid()) + "." +
                           std::to_string(random());
  const int fd = ::open(temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    throw LedgerError("cannot create the ledger file " + temp + ": " + strerror(errno));
  }
  std::string error;
  // The mode is set explicitly: the umask could only have taken bits away, never the group's.
  const auto gid = static_cast<gid_t>(access.group);
  if (access.group >= 0 && fchown(fd, static_cast<uid_t>(-1), gid) != 0) {
    error = "cannot give it to group " + group_name(gid) + " (" +
            strerror(errno) + "; is this user a member?)";
  } else if (fchmod(fd, access.group >= 0 ? 0660 : 0600) != 0) {
    error = std::string("fchmod: ") + strerror(errno);
  } else if (ftruncate(fd, sizeof(LedgerFile)) != 0) {
    error = std::string("ftruncate: ") + strerror(errno);
  } else {
    void* data = mmap(nullptr, sizeof(LedgerFile), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      error = std::string("mmap: ") + strerror(errno);
    } else {
      try {
        init_file(static_cast<LedgerFile*>(data));
        // Note [Ledger file identity]: a fresh file settles; written before it is linked.
        static_cast<LedgerFile*>(data)->header.settle_until_ns =
            monotonic_ns() + g_fresh_settle_ns.load();
      } catch (const LedgerError& e) {
        error = e.what();
      }
      munmap(data, sizeof(LedgerFile));
    }
  }
  ::close(fd);
  if (error.empty() && link(temp.c_str(), path.c_str()) != 0 && errno != EEXIST) {
    error = std::string("link: ") + strerror(errno);
  }
  unlink(temp.c_str());
  if (!error.empty()) throw LedgerError("cannot create the ledger file " + path + ": " + error);
}

std::mutex& open_ledgers_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::string, std::weak_ptr<Ledger>>& open_ledgers() {
  static auto* ledgers = new std::map<std::string, std::weak_ptr<Ledger>>();  // never destroyed
  return *ledgers;
}

// Note [Fair share under pressure]: water-filling of `budget` over `n` demands (>= 0). Arrays
// of at most kLedgerEntries: no allocation (grant() runs under the pool's mutex, noexcept).
void water_fill(const int64_t* demand, int n, int64_t budget, int64_t* fair) {
  if (n <= 0) return;
  int64_t sum = 0;
  for (int i = 0; i < n; ++i) sum += demand[i];
  if (sum <= budget) {
    const int64_t slack = (budget - sum) / n;  // split evenly: nobody is held below its demand
    for (int i = 0; i < n; ++i) fair[i] = demand[i] + slack;
    return;
  }
  // Ascending demand: the smallest are served whole while they fit under the level.
  int order[kLedgerEntries];
  for (int i = 0; i < n; ++i) order[i] = i;
  std::sort(order, order + n, [&](int a, int b) { return demand[a] < demand[b]; });
  int64_t remaining = budget;
  for (int k = 0; k < n; ++k) {
    const int left = n - k;
    const int64_t level = remaining / left;
    if (demand[order[k]] <= level) {
      fair[order[k]] = demand[order[k]];
      remaining -= demand[order[k]];
      continue;
    }
    // Every demand from here on is above the level (sum > budget guarantees we get here).
    for (int rest = k; rest < n; ++rest) fair[order[rest]] = level;
    return;
  }
}

// One reading of every live entry (atomics, with or without the lock).
struct ShareReading {
  int n = 0;
  int self = -1;  // this member's index, -1 when it has no live entry
  int64_t budget = INT64_MAX;
  int64_t committed = 0;
  int64_t unmet_total = 0;
  int64_t committed_of[kLedgerEntries];
  int64_t demand_of[kLedgerEntries];
  int64_t page_of[kLedgerEntries];
  int64_t fair_of[kLedgerEntries];
  int64_t unmet_of[kLedgerEntries];
  bool blocked_of[kLedgerEntries];
  const LedgerEntry* entry_of[kLedgerEntries];  // for messages: who each member is

  bool has_budget() const { return budget != INT64_MAX && n > 0; }
  bool other_blocked() const {
    for (int i = 0; i < n; ++i) {
      if (i != self && blocked_of[i]) return true;
    }
    return false;
  }
  int64_t others_unmet() const { return unmet_total - (self >= 0 ? unmet_of[self] : 0); }
};

void read_share(const LedgerFile& file, const LedgerEntry* self, ShareReading& r) {
  for (const LedgerEntry& e : file.entries) {
    if (e.state.load() != 1) continue;
    const int i = r.n++;
    if (&e == self) r.self = i;
    r.entry_of[i] = &e;
    r.committed_of[i] = e.committed_bytes.load();
    r.demand_of[i] = std::max<int64_t>(0, e.demand_bytes.load());
    r.page_of[i] = std::max<int64_t>(1, e.page_bytes.load());
    r.blocked_of[i] = e.blocked.load() > 0;
    r.committed += r.committed_of[i];
    const int64_t own = e.budget_bytes.load();
    if (own > 0) r.budget = std::min(r.budget, own);
  }
  if (!r.has_budget()) return;
  water_fill(r.demand_of, r.n, r.budget, r.fair_of);
  for (int i = 0; i < r.n; ++i) {
    r.fair_of[i] = r.fair_of[i] / r.page_of[i] * r.page_of[i];  // whole pages of its member
    const int64_t entitled = std::min(r.demand_of[i], r.fair_of[i]);
    r.unmet_of[i] = std::max<int64_t>(0, entitled - r.committed_of[i]);
    r.unmet_total += r.unmet_of[i];
  }
}

}  // namespace

std::vector<int64_t> share_fair_shares(const std::vector<int64_t>& demands, int64_t budget) {
  if (demands.size() > static_cast<size_t>(kLedgerEntries)) {
    throw std::invalid_argument("a share has at most " + std::to_string(kLedgerEntries) +
                                " members, got " + std::to_string(demands.size()) + " demands");
  }
  if (budget < 0) throw std::invalid_argument("budget must not be negative");
  std::vector<int64_t> clamped(demands.size()), fair(demands.size());
  for (size_t i = 0; i < demands.size(); ++i) clamped[i] = std::max<int64_t>(0, demands[i]);
  water_fill(clamped.data(), static_cast<int>(clamped.size()), budget, fair.data());
  return fair;
}

// ---------------------------------------------------------------------------------------------
// Ledger

std::shared_ptr<Ledger> Ledger::open(const std::string& path, bool create,
                                     const LedgerAccess& access) {
  // One mapping per file and process: the robust-mutex machinery knows a lock by its address.
  std::lock_guard<std::mutex> guard(open_ledgers_mutex());
  // O_NOFOLLOW: a link planted at the path by another user is refused, never followed.
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (auto existing = open_ledgers()[path].lock()) {
    // The same file still (not one removed and made anew under the same name): share it.
    struct stat now;
    if (fd >= 0 && fstat(fd, &now) == 0 && now.st_dev == existing->device_ &&
        now.st_ino == existing->inode_) {
      ::close(fd);
      check_access(path, now, access);  // its owner or mode may have changed since
      // Cut short since (Note [Ledger file identity]): refused, as at a first open.
      if (const std::string damage = existing->size_damage(); !damage.empty()) {
        throw LedgerError(damage);
      }
      return existing;
    }
  }
  // The file made (or found made) can be removed again by its last member leaving before this
  // process opens it: make it anew, a bounded number of times (each round is a few syscalls).
  for (int attempt = 0; fd < 0 && errno == ENOENT && create && attempt < 16; ++attempt) {
    create_file(path, access);
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  }
  if (fd < 0) {
    throw LedgerError("cannot open the ledger file " + path + ": " + strerror(errno) +
                      (errno == ENOENT ? " (no allocator has joined this share)" : ""));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const std::string why = strerror(errno);
    ::close(fd);
    throw LedgerError("cannot stat the ledger file " + path + ": " + why);
  }
  try {
    check_access(path, st, access);  // before reading a byte of it
  } catch (...) {
    ::close(fd);
    throw;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < sizeof(LedgerHeader)) {
    ::close(fd);
    throw LedgerError(truncated_text(path, st.st_size));
  }
  void* data = mmap(nullptr, sizeof(LedgerFile), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_error = errno;
  if (data == MAP_FAILED) {
    ::close(fd);
    throw LedgerError("cannot map the ledger file " + path + ": " + strerror(map_error));
  }
  auto* file = static_cast<LedgerFile*>(data);
  // The header first (it lies within the size checked), then the size: a short file is refused
  // before anything past its end is read. The entries are checked under the lock, by each user.
  std::string damage = header_damage(path, file->header);
  if (damage.empty() && size < sizeof(LedgerFile)) damage = truncated_text(path, st.st_size);
  if (!damage.empty()) {
    munmap(data, sizeof(LedgerFile));
    ::close(fd);
    throw LedgerError(damage);
  }
  std::shared_ptr<Ledger> ledger(new Ledger(path, file, fd));
  ledger->access_ = access;
  ledger->device_ = st.st_dev;
  ledger->inode_ = st.st_ino;
  open_ledgers()[path] = ledger;
  return ledger;
}

Ledger::Ledger(std::string path, LedgerFile* file, int fd)
    : path_(std::move(path)), file_(file), fd_(fd) {}

Ledger::~Ledger() {
  munmap(file_, sizeof(LedgerFile));
  ::close(fd_);
}

bool Ledger::still_linked() const {
  struct stat st;
  return lstat(path_.c_str(), &st) == 0 && st.st_dev == device_ && st.st_ino == inode_ &&
         st.st_nlink > 0;
}

std::string Ledger::size_damage() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    return "cannot stat the ledger file " + path_ + ": " + strerror(errno);
  }
  if (st.st_size < static_cast<off_t>(sizeof(LedgerFile))) return truncated_text(path_, st.st_size);
  return "";
}

std::string Ledger::damage() const {
  // Note [Share ledger], Invariants: the one check of whether the file can be used. The size
  // first: past it, reading the header or the entries would fault.
  std::string why = size_damage();
  if (why.empty()) why = header_damage(path_, file_->header);
  if (!why.empty()) return why;
  why = entries_damage(*file_);
  return why.empty() ? why : "the ledger file " + path_ + " is corrupt: " + why + kRemoveIt;
}

bool Ledger::settling(Clock::time_point now) const {
  return now < settled_at();
}

Ledger::Clock::time_point Ledger::settled_at() const {
  // steady_clock is CLOCK_MONOTONIC (to_timespec). A settle end further away than a settle from
  // now (another clock, or damage) is not waited for: a settle never stalls a share.
  const int64_t until = file_->header.settle_until_ns;
  const int64_t now = monotonic_ns();
  const int64_t longest = std::chrono::nanoseconds(kFreshSettle + std::chrono::seconds(1)).count();
  if (until <= now || until - now > longest) return Clock::time_point{};
  return Clock::now() + std::chrono::nanoseconds(until - now);
}

void Ledger::set_fresh_settle_for_test(std::chrono::nanoseconds settle) {
  g_fresh_settle_ns.store(settle.count());
}

bool Ledger::lock(Clock::time_point deadline) noexcept {
  const timespec until = to_timespec(deadline);
  if (until.tv_sec < 0 || until.tv_nsec < 0 || until.tv_nsec >= 1000000000) {
    return false;  // a deadline that is no time at all: the caller's error, not the lock's
  }
  // Note [Ledger file identity]: the lock lies in the file; a file cut short would fault here.
  struct stat st;
  if (fstat(fd_, &st) == 0 && st.st_size < static_cast<off_t>(sizeof(LedgerFile))) {
    lock_error_.store(kLockTruncated);
    return false;
  }
#if defined(__SANITIZE_THREAD__)
  __tsan_mutex_pre_lock(&file_->header.mutex, __tsan_mutex_try_lock);
#endif
  const int rc = pthread_mutex_clocklock(&file_->header.mutex, CLOCK_MONOTONIC, &until);
#if defined(__SANITIZE_THREAD__)
  const bool taken = rc == 0 || rc == EOWNERDEAD;
  __tsan_mutex_post_lock(&file_->header.mutex,
                         __tsan_mutex_try_lock | (taken ? 0 : __tsan_mutex_try_lock_failed), 0);
#endif
  if (rc == 0) {
    lock_error_.store(0);  // usable again (the file was replaced, or the error was passing)
    return true;
  }
  if (rc == ETIMEDOUT) return false;
  if (rc == EOWNERDEAD) {
    // The previous holder died holding it. Its half-done work can only be its own entry's
    // figures or a join in progress: reclaiming dead entries repairs both.
    pthread_mutex_consistent(&file_->header.mutex);
    file_->header.repairs.fetch_add(1);
    reclaim_dead_locked();
    return true;
  }
  // Never thrown from here: lock() runs under the pool's mutex and on the mapper's and watcher's
  // threads. An unusable lock refuses every grant (the waiters time out) and is reported by
  // snapshot(), set_limit() and joining (lock_failure()).
  lock_error_.store(rc);
  return false;
}

std::string Ledger::lock_failure(double timeout_s) const {
  const int error = lock_error_.load();
  if (error == kLockTruncated) return size_damage();
  if (error != 0) {
    return "the ledger lock of " + path_ + " is unusable (" + strerror(error) +
           "): stop the processes using it and remove the file";
  }
  const int32_t holder = holder_pid();
  std::ostringstream seconds;
  seconds << timeout_s;
  return "the ledger lock of " + path_ + " stayed taken for " + seconds.str() + " s" +
         (holder > 0 ? " by pid " + std::to_string(holder) +
                           " (is that process stopped or stuck?)"
                     : std::string(" (its holder is unknown)"));
}

int32_t Ledger::holder_pid() const {
  // A robust mutex records its owner's thread id (glibc: __data.__owner, which the kernel also
  // reads for robust futexes); the process is that thread's thread group.
  const int tid = __atomic_load_n(&file_->header.mutex.__data.__owner, __ATOMIC_RELAXED);
  if (tid == 0) return 0;
  if (tid < 0) return -1;
  try {
    std::ifstream status("/proc/" + std::to_string(tid) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("Tgid:", 0) == 0) return static_cast<int32_t>(std::atol(line.c_str() + 5));
    }
  } catch (...) {
    // Only a name for a message: the thread id is the pid of a single-threaded holder.
  }
  return tid;
}

void Ledger::unlock() { pthread_mutex_unlock(&file_->header.mutex); }

int Ledger::reclaim_dead_locked() {
  int reclaimed = 0;
  const Identity& self = self_identity();
  const int64_t now = monotonic_ns();
  const int64_t stale_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(ShareMember::kForeignStaleAfter).count();
  for (LedgerEntry& e : file_->entries) {
    // Only live entries: another state is damage (Ledger::damage()), reported, never repaired.
    if (e.state.load() != 1) continue;
    const int32_t pid = e.pid.load();
    if (e.pid_ns.load() != self.pid_ns) {
      // Another pid namespace (another container): its pid means nothing here, its heartbeat does.
      if (now - e.heartbeat_ns.load() < stale_ns) continue;
    } else if (pid == self.pid) {
      // This process's own entries are alive; an entry with its pid but another start time is an
      // earlier process's (pids are reused, in containers especially).
      if (e.start_time.load() == self.start_time) continue;
    } else if (process_alive(pid, e.start_time.load())) {
      continue;
    }
    e.committed_bytes.store(0);
    e.blocked.store(0);
    e.waiters.store(0);
    e.demand_bytes.store(0);
    e.generation.fetch_add(1, std::memory_order_acq_rel);  // its owner, if alive, lets go of it
    e.state.store(0);
    ++reclaimed;
  }
  if (reclaimed > 0) notify();  // its memory is free for the others now
  return reclaimed;
}

int64_t Ledger::budget_locked() const {
  int64_t budget = INT64_MAX;
  for (const LedgerEntry& e : file_->entries) {
    const int64_t own = e.budget_bytes.load();
    if (e.state.load() == 1 && own > 0) budget = std::min(budget, own);
  }
  return budget;
}

bool Ledger::remove_if_unused_locked() {
  // A damaged file is kept, as prune keeps it: the operator removes it, as its error says.
  if (!damage().empty()) return false;
  for (const LedgerEntry& e : file_->entries) {
    if (e.state.load() != 0) return false;
  }
  // Under the lock: a joiner waiting for it finds the file gone (still_linked) and opens anew.
  if (!still_linked()) return false;
  return unlink(path_.c_str()) == 0;
}

bool Ledger::prune(double timeout_s) {
  check_timeout(timeout_s);
  if (!lock(after(timeout_s))) throw LedgerError(lock_failure(timeout_s));
  if (const std::string damage = this->damage(); !damage.empty()) {
    unlock();
    throw LedgerError(damage);
  }
  reclaim_dead_locked();
  const bool removed = remove_if_unused_locked();
  unlock();
  return removed;
}

std::vector<EntryView> Ledger::snapshot(double timeout_s) {
  check_timeout(timeout_s);
  if (!lock(after(timeout_s))) throw LedgerError(lock_failure(timeout_s));
  if (const std::string damage = this->damage(); !damage.empty()) {
    unlock();
    throw LedgerError(damage);
  }
  std::vector<EntryView> out;
  reclaim_dead_locked();
  const int64_t now = monotonic_ns();
  const uint64_t own_ns = self_identity().pid_ns;
  for (int slot = 0; slot < kLedgerEntries; ++slot) {
    LedgerEntry& e = file_->entries[slot];
    if (e.state.load() != 1) continue;
    EntryView v;
    v.slot = slot;
    v.pid = e.pid.load();
    v.serial = e.serial.load();
    v.name = read_text(e.name, sizeof e.name);
    v.committed_bytes = e.committed_bytes.load();
    v.mapped_bytes = e.mapped_bytes.load();
    v.reserved_bytes = e.reserved_bytes.load();
    v.used_bytes = e.used_bytes.load();
    v.limit_bytes = e.limit_bytes.load();
    v.page_bytes = e.page_bytes.load();
    v.budget_bytes = e.budget_bytes.load();
    v.waiters = e.waiters.load();
    v.blocked = e.blocked.load();
    v.requested_limit = e.requested_limit.load();
    v.demand_bytes = e.demand_bytes.load();
    v.capacity_bytes = e.capacity_bytes.load();
    v.pid_ns = e.pid_ns.load();
    v.foreign = v.pid_ns != own_ns;
    v.heartbeat_age_s = std::max<int64_t>(0, now - e.heartbeat_ns.load()) / 1e9;
    // A torn read of `op` (its owner writing it meanwhile) is retried a few times, then shown.
    for (int attempt = 0; attempt < 8; ++attempt) {
      const uint32_t before = e.op_generation.load(std::memory_order_acquire);
      v.op = load_op(e.op, sizeof e.op);
      const int64_t started = e.op_started_ns.load();
      v.op_age_s = started > 0 ? std::max<int64_t>(0, now - started) / 1e9 : 0.0;
      if (before % 2 == 0 && e.op_generation.load(std::memory_order_acquire) == before) break;
    }
    out.push_back(std::move(v));
  }
  unlock();
  return out;
}

int Ledger::set_limit(int32_t pid, int64_t bytes, double timeout_s) {
  check_timeout(timeout_s);
  if (!lock(after(timeout_s))) throw LedgerError(lock_failure(timeout_s));
  if (const std::string damage = this->damage(); !damage.empty()) {
    unlock();
    throw LedgerError(damage);
  }
  reclaim_dead_locked();
  int count = 0;
  std::string too_small;
  const uint64_t own_ns = self_identity().pid_ns;
  for (LedgerEntry& e : file_->entries) {
    if (e.state.load() != 1 || e.pid.load() != pid || e.pid_ns.load() != own_ns) continue;
    if (bytes != 0 && bytes < e.page_bytes.load()) {
      too_small = std::to_string(e.page_bytes.load());
      continue;
    }
    e.requested_limit.store(bytes);
    e.limit_generation.fetch_add(1, std::memory_order_release);
    ++count;
  }
  unlock();
  if (!too_small.empty() && count == 0) {
    throw std::invalid_argument("limit: " + std::to_string(bytes) +
                                " bytes is below one page of process " + std::to_string(pid) +
                                "'s allocator (" + too_small + " bytes)");
  }
  notify();  // the watchers apply it now, not at their next tick
  return count;
}

void Ledger::notify() {
  file_->header.release_seq.fetch_add(1, std::memory_order_acq_rel);
  syscall(SYS_futex, &file_->header.release_seq, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void Ledger::wait(uint32_t seen, std::chrono::nanoseconds timeout) {
  // A relative timeout: FUTEX_WAIT measures it on CLOCK_MONOTONIC. Returns early when the word
  // already moved (EAGAIN), when woken, or on a signal; the caller re-checks either way.
  timespec rel;
  rel.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  rel.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, &file_->header.release_seq, FUTEX_WAIT, seen, &rel, nullptr, 0);
}

bool Ledger::hold_lock_for(double seconds) {
  check_timeout(seconds);
  if (!lock(after(1.0))) return false;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  unlock();
  return true;
}

// ---------------------------------------------------------------------------------------------
// ShareMember

ShareMember::ShareMember(std::shared_ptr<Ledger> ledger, const std::string& name,
                         int64_t budget_bytes, int64_t page_bytes)
    : path_(ledger->path()),
      access_(ledger->access()),
      name_(name),
      budget_bytes_(budget_bytes),
      pid_(getpid()),
      page_bytes_(page_bytes),
      ledger_(std::move(ledger)) {
  if (page_bytes <= 0) throw std::invalid_argument("page_bytes must be positive");
  if (budget_bytes < 0) throw std::invalid_argument("device_budget must not be negative");
  // The last member to leave removes the file under the lock (Note [Share ledger]): a file found
  // removed once locked is given up for the one now at the path, created anew if need be.
  // One deadline for every attempt: joining waits kJoinLockTimeout in all (the caller's thread).
  const auto deadline = Clock::now() + kJoinLockTimeout;
  for (int attempt = 0;; ++attempt) {
    if (!ledger_->lock(deadline)) {
      throw LedgerError("cannot join the share: " +
                        ledger_->lock_failure(std::chrono::duration<double>(kJoinLockTimeout).count()));
    }
    if (ledger_->still_linked()) break;
    ledger_->unlock();
    if (attempt == 16) {
      throw LedgerError("cannot join the share: the ledger file " + ledger_->path() +
                        " keeps being removed while joining");
    }
    ledger_ = Ledger::open(ledger_->path(), true, ledger_->access());
  }
  // The one check every user of the file applies (Note [Share ledger], Invariants).
  if (const std::string damage = ledger_->damage(); !damage.empty()) {
    ledger_->unlock();
    throw LedgerError("cannot join the share: " + damage);
  }
  ledger_->reclaim_dead_locked();
  int slot = -1;
  for (int i = 0; i < kLedgerEntries && slot < 0; ++i) {
    if (ledger_->file().entries[i].state.load() == 0) slot = i;
  }
  if (slot < 0) {
    ledger_->unlock();
    throw LedgerError("the ledger " + ledger_->path() + " is full (" +
                      std::to_string(kLedgerEntries) + " allocators)");
  }
  {
    std::lock_guard<std::mutex> guard(mutex_);  // no other thread yet: take_entry_locked's contract
    take_entry_locked(*ledger_, slot, 0, 0);
  }
  ledger_->unlock();
}

void ShareMember::take_entry_locked(Ledger& ledger, int slot, int64_t committed_bytes,
                                    int64_t demand_bytes) {
  LedgerEntry& e = ledger.file().entries[slot];
  const Identity& self = self_identity();
  serial_ = ledger.file().header.next_serial.fetch_add(1) + 1;
  slot_ = slot;
  generation_ = e.generation.fetch_add(1, std::memory_order_acq_rel) + 1;
  e.pid.store(self.pid);
  e.start_time.store(self.start_time);
  e.pid_ns.store(self.pid_ns);
  e.heartbeat_ns.store(monotonic_ns());
  e.serial.store(serial_);
  copy_text(e.name, sizeof e.name, name_);
  e.committed_bytes.store(committed_bytes);
  e.mapped_bytes.store(0);
  e.reserved_bytes.store(0);
  e.used_bytes.store(0);
  e.limit_bytes.store(0);
  e.capacity_bytes.store(0);
  e.page_bytes.store(page_bytes_);
  e.budget_bytes.store(budget_bytes_);
  e.waiters.store(0);
  e.blocked.store(0);
  e.requested_limit.store(-1);
  e.demand_bytes.store(demand_bytes);
  seen_limit_generation_ = e.limit_generation.load();
  e.op_started_ns.store(0);
  store_op(e.op, sizeof e.op, "");
  e.state.store(1, std::memory_order_release);  // last: the entry is whole before it counts
}

ShareMember::~ShareMember() {
  // Only when the watcher itself drops the last ref, or in a forked child (which has a copy of
  // the thread's handle, never the thread).
  if (thread_.joinable()) thread_.detach();
  leave();
}

bool ShareMember::owns_entry() const {
  // A forked child never takes mutex_: a thread of the parent may have held it at the fork.
  if (getpid() != pid_) return false;
  std::lock_guard<std::mutex> guard(mutex_);
  return owns_entry_locked();
}

bool ShareMember::owns_entry_locked() const {
  return !left_ && ledger_ && getpid() == pid_ &&
         entry().generation.load(std::memory_order_acquire) == generation_;
}

std::string ShareMember::trouble() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return trouble_;
}

void ShareMember::set_trouble(const std::string& why) {
  std::lock_guard<std::mutex> guard(mutex_);
  trouble_ = why;
}

void ShareMember::notify() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (ledger_) ledger_->notify();
}

void ShareMember::start(std::weak_ptr<PagePool> pool) {
  thread_ = std::thread(&ShareMember::run, shared_from_this(), std::move(pool));
}

void ShareMember::stop(double timeout_s) {
  stopping_ = true;
  if (getpid() != pid_) {
    // A forked child: the watcher is the parent's (it never existed here), and so is the entry.
    // Not under mutex_ (a thread of the parent may have held it at the fork): this copy has no
    // watcher, so nothing re-registers.
    if (thread_.joinable()) thread_.detach();
    left_ = true;
    return;
  }
  wake_.notify();  // a watcher that holds no file sleeps on it
  notify();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    if (exited_.wait_for(std::chrono::duration<double>(std::max(timeout_s, 0.5)))) {
      thread_.join();
    } else {
      thread_.detach();  // ends by itself at its next tick; it publishes nothing after stopping_
    }
  }
  leave();
}

void ShareMember::leave() {
  // A forked child's copy: the entry is the parent's, which still uses it (and mutex_ may have
  // been held by a thread of the parent at the fork).
  if (getpid() != pid_) {
    left_ = true;
    return;
  }
  std::shared_ptr<Ledger> ledger;
  int slot = -1;
  uint32_t generation = 0;
  {
    // Under mutex_: a re-registration in flight sees left_ and abandons (Note [Ledger file
    // identity]), so no entry is taken after this one is freed.
    std::lock_guard<std::mutex> guard(mutex_);
    if (left_.exchange(true)) return;
    if (!ledger_) return;  // no file held (it was truncated): nothing to free
    ledger = ledger_;
    slot = slot_;
    generation = generation_;
  }
  LedgerEntry& e = ledger->file().entries[slot];
  // Without the lock if it stays taken: clearing its own entry is atomic stores, and a slot
  // freed under a lock holder's scan is at worst reclaimed twice.
  const bool locked = ledger->lock(Clock::now() + kLeaveLockTimeout);
  if (!locked && !ledger->size_damage().empty()) return;  // cut short: touch nothing
  // An entry reclaimed meanwhile (its slot perhaps a newcomer's now) is not this member's to clear.
  if (e.generation.load(std::memory_order_acquire) == generation) {
    e.committed_bytes.store(0);
    e.blocked.store(0);
    e.waiters.store(0);
    e.demand_bytes.store(0);
    e.generation.fetch_add(1, std::memory_order_acq_rel);
    e.state.store(0, std::memory_order_release);
  }
  // The last member out removes the file (Note [Share ledger]); only under the lock, so that a
  // joiner cannot take an entry in a file that is being removed.
  if (locked) {
    ledger->remove_if_unused_locked();
    ledger->unlock();
  }
  ledger->notify();
}

ShareMember::Grant ShareMember::grant(int64_t pages, bool refill,
                                      Clock::time_point lock_deadline) noexcept {
  Grant out;
  if (pages <= 0 || getpid() != pid_) return out;  // a forked child: no charge, no mutex_
  std::shared_ptr<Ledger> ledger;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!ledger_ && !left_) {
      out.held = true;  // no file held (truncated): trouble_ says why; the watcher re-registers
      return out;
    }
    if (!owns_entry_locked()) return out;  // a forked child, or an entry lost: no charge
    ledger = ledger_;
  }
  // mutex_ is not held while the ledger's lock is waited for (lock order: Ledger lock -> mutex_).
  if (!ledger->lock(lock_deadline)) {
    if (std::string cut = ledger->size_damage(); !cut.empty()) {
      set_trouble(cut);
      wake_.notify();  // the watcher lets go of it now
      out.held = true;
      return out;
    }
    out.lock_busy = true;  // not a shortage of budget: the caller plans again later
    out.holder_pid = ledger->holder_pid();
    return out;
  }
  // Note [Ledger file identity]: never a charge in a file that is not the one at the path, that
  // is damaged (the one check of Note [Share ledger]), or that is fresh and settling.
  std::string why;
  const bool moved = !ledger->still_linked();
  if (moved) {
    why = "the ledger file " + path_ +
          " was removed or replaced under this allocator: re-registering its pages into the "
          "file now at the path";
  } else if (std::string damage = ledger->damage(); !damage.empty()) {
    why = "cannot charge the share: " + damage;
  } else if (ledger->settling(Clock::now())) {
    why = "the share's ledger file " + path_ + " is fresh: no map is granted in its first " +
          std::to_string(std::chrono::milliseconds(Ledger::kFreshSettle).count()) +
          " ms, so that members of a removed file re-register their pages first";
  }
  if (!why.empty()) {
    ledger->unlock();
    set_trouble(why);
    if (moved) ledger->notify();  // every watcher of the old file, this one's too: notice now
    out.held = true;
    return out;
  }
  ledger->reclaim_dead_locked();
  std::lock_guard<std::mutex> guard(mutex_);
  if (ledger_ != ledger || !owns_entry_locked()) {
    // Reclaimed just now (its slot is not this member's to charge), or re-registered meanwhile.
    ledger->unlock();
    out.held = ledger_ != ledger;
    return out;
  }
  trouble_.clear();
  ShareReading r;
  read_share(ledger_->file(), &entry(), r);
  if (!r.has_budget()) {
    out.granted = pages;
  } else {
    // Note [Fair share under pressure]: never the budget another member is entitled to and
    // wants. Signed: a share already past its budget (lowered by a newcomer) has no headroom.
    int64_t headroom = r.budget - r.committed - r.others_unmet();
    if (refill) {
      // A refill is an optimisation: it never takes memory another allocator is waiting for.
      if (r.other_blocked()) headroom = 0;
    } else if (r.self >= 0) {
      // But a request of a member below budget / members, its guaranteed minimum when it wants
      // more, gets the free budget up to it, whatever the others claim: claims are reported,
      // not checked, and the minima of all members fit the budget together.
      const int64_t equal = r.budget / r.n / page_bytes_ * page_bytes_;
      const int64_t to_minimum =
          std::min(r.budget - r.committed, equal - r.committed_of[r.self]);
      headroom = std::max(headroom, to_minimum);
    }
    out.granted = std::clamp<int64_t>(headroom / page_bytes_, 0, pages);
  }
  entry().committed_bytes.fetch_add(out.granted * page_bytes_);
  charged_pages_ += out.granted;
  ledger->unlock();
  return out;
}

void ShareMember::release(int64_t pages) {
  // Without the ledger's lock, so a reclaim may land between the check and the subtraction; a
  // reclaim needs its owner thought dead (pid gone, or a heartbeat kForeignStaleAfter old), which
  // a member that is releasing is not. Under mutex_: a re-registration carries charged_pages_.
  if (pages <= 0) return;
  std::lock_guard<std::mutex> guard(mutex_);
  charged_pages_ = std::max<int64_t>(0, charged_pages_ - pages);
  if (owns_entry_locked()) entry().committed_bytes.fetch_sub(pages * page_bytes_);
}

void ShareMember::set_blocked(int64_t waiters) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!owns_entry_locked()) return;
  const int64_t before = entry().blocked.exchange(waiters);
  // Newly short of budget: wake the others now, so that they give back their reserves.
  if (before == 0 && waiters > 0) ledger_->notify();
}

bool ShareMember::blocked() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return owns_entry_locked() && entry().blocked.load() > 0;
}

bool ShareMember::set_demand(int64_t pages) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!owns_entry_locked()) return false;
  const int64_t bytes = std::max<int64_t>(0, pages) * page_bytes_;
  return entry().demand_bytes.exchange(bytes, std::memory_order_relaxed) != bytes;
}

ShareMember::Fair ShareMember::fair_share() const {
  Fair out;
  std::lock_guard<std::mutex> guard(mutex_);
  if (!owns_entry_locked()) return out;
  ShareReading r;
  read_share(ledger_->file(), &entry(), r);
  if (!r.has_budget() || r.self < 0) return out;
  // Short: what the members are entitled to and lack exceeds the free budget.
  const bool short_of_budget = r.unmet_total > r.budget - r.committed;
  out.pressure = r.other_blocked() || (short_of_budget && r.others_unmet() > 0);
  out.fair = r.fair_of[r.self] / page_bytes_;
  out.guaranteed = std::min(r.demand_of[r.self], r.budget / r.n) / page_bytes_;
  out.equal_share = r.budget / r.n / page_bytes_;
  return out;
}

int64_t ShareMember::room_pages() const {
  std::lock_guard<std::mutex> guard(mutex_);
  if (left_) return INT64_MAX;
  if (!ledger_) return 0;  // no file held: nothing can be granted (Note [Ledger file identity])
  ShareReading r;
  read_share(ledger_->file(), owns_entry_locked() ? &entry() : nullptr, r);
  if (!r.has_budget()) return INT64_MAX;
  if (r.self < 0) return 0;  // nothing can be granted without an entry
  const int64_t headroom = r.budget - r.committed - r.others_unmet();
  // Its fair share, or the guaranteed minimum it gets by wanting more (budget / members).
  const int64_t share = std::max(r.fair_of[r.self], r.budget / r.n / page_bytes_ * page_bytes_);
  const int64_t share_left = share - r.committed_of[r.self];
  return std::max<int64_t>(0, std::max(headroom, share_left)) / page_bytes_;
}

int64_t ShareMember::budget_pages() const {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!ledger_) return INT64_MAX;  // no file held: the budget is not known
  const int64_t budget = ledger_->budget_locked();  // atomics only: safe without the lock
  return budget == INT64_MAX ? INT64_MAX : budget / page_bytes_;
}

std::string ShareMember::describe_budget() const {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!ledger_) return trouble_;  // no file held (Note [Ledger file identity])
  std::ostringstream out;
  if (getpid() != pid_) {
    out << "this allocator was opened by process " << pid_
        << " before a fork(); it cannot map in this child: open a new allocator here ("
        << path_ << ")";
    return out.str();
  }
  if (!owns_entry_locked() && !left_) {
    out << "this allocator's ledger entry was reclaimed (it was taken for dead): it cannot map "
        << "any more; close it and open a new one (" << path_ << ")";
    return out.str();
  }
  // What holds the budget, as the grants see it (atomics, without the lock): committed by whom,
  // kept for whom (Note [Fair share under pressure]: the unmet entitlement of the others), and
  // free. "Taken" only when nothing is free.
  ShareReading r;
  read_share(ledger_->file(), owns_entry_locked() ? &entry() : nullptr, r);
  if (!r.has_budget()) {
    out << "the share has no device budget (" << ledger_->path() << ")";
    return out.str();
  }
  const auto amount = [&](int64_t bytes) {
    return bytes % page_bytes_ == 0 ? std::to_string(bytes / page_bytes_)
                                    : std::to_string(bytes) + " bytes";
  };
  const auto pages = [&](int64_t bytes) {
    return bytes % page_bytes_ == 0 ? amount(bytes) + " page(s)" : amount(bytes);
  };
  const auto who = [&](int i) {
    const LedgerEntry& e = *r.entry_of[i];
    const std::string name = read_text(e.name, sizeof e.name);
    if (i == r.self) return (name.empty() ? std::string() : name + " ") + "(this allocator)";
    const std::string pid = "pid " + std::to_string(e.pid.load());
    return name.empty() ? pid : name + " (" + pid + ")";
  };
  // The members with a nonzero figure, largest first, at most kNamed of them named.
  constexpr int kNamed = 8;
  const auto listing = [&](const int64_t* figure, bool with_unit, bool others_only) {
    std::vector<int> order;
    for (int i = 0; i < r.n; ++i) {
      if (figure[i] > 0 && !(others_only && i == r.self)) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return figure[a] > figure[b]; });
    std::string text;
    int64_t rest = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      if (k >= static_cast<size_t>(kNamed)) {
        rest += figure[order[k]];
        continue;
      }
      text += (k ? ", " : "") + who(order[k]) + " " +
              (with_unit ? pages(figure[order[k]]) : amount(figure[order[k]]));
    }
    if (order.size() > static_cast<size_t>(kNamed)) {
      text += " and " + std::to_string(order.size() - kNamed) + " more (" + pages(rest) + ")";
    }
    return text.empty() ? std::string("none") : text;
  };
  const int64_t free = r.budget - r.committed;
  const int64_t kept = std::min(std::max<int64_t>(free, 0), r.others_unmet());
  out << "the share's device budget of " << pages(r.budget);
  if (r.budget % page_bytes_ == 0) out << " (" << r.budget << " bytes)";
  if (free <= 0) {
    out << " is taken: " << pages(r.committed)
        << " committed: " << listing(r.committed_of, false, false)
        << ": waiting for memory to be released";
  } else {
    out << " has " << pages(free) << " free";
    if (kept > 0) {
      out << ", " << (kept < free ? pages(kept) + " of it " : std::string())
          << "kept for members that want more and are entitled to it: "
          << listing(r.unmet_of, true, true);
    }
    out << "; " << pages(r.committed)
        << " committed: " << listing(r.committed_of, false, false)
        << ": waiting for memory to be released";
    if (kept > 0) {
      out << ", or for claims that no request follows to lapse ("
          << std::chrono::duration<double>(DemandClaim::kClaimHold).count() << " s)";
    }
  }
  out << " (" << ledger_->path() << ")";
  return out.str();
}

void ShareMember::publish(int64_t mapped, int64_t reserved, int64_t used, int64_t limit,
                          int64_t capacity, int64_t waiters, const std::string& op,
                          double op_age_s) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (stopping_ || !owns_entry_locked()) return;
  LedgerEntry& e = entry();
  e.heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);
  e.mapped_bytes.store(mapped, std::memory_order_relaxed);
  e.reserved_bytes.store(reserved, std::memory_order_relaxed);
  e.used_bytes.store(used, std::memory_order_relaxed);
  e.limit_bytes.store(limit, std::memory_order_relaxed);
  e.capacity_bytes.store(capacity, std::memory_order_relaxed);
  e.waiters.store(waiters, std::memory_order_relaxed);
  if (load_op(e.op, sizeof e.op) != op) {
    e.op_generation.fetch_add(1, std::memory_order_acq_rel);  // odd: writing
    store_op(e.op, sizeof e.op, op);
    e.op_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  e.op_started_ns.store(op.empty() ? 0 : monotonic_ns() - static_cast<int64_t>(op_age_s * 1e9));
}

int64_t ShareMember::take_requested_limit() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!owns_entry_locked()) return -1;
  const uint32_t generation = entry().limit_generation.load(std::memory_order_acquire);
  if (generation == seen_limit_generation_) return -1;
  seen_limit_generation_ = generation;
  return entry().requested_limit.load();
}

std::shared_ptr<Ledger> ShareMember::check_file() {
  std::shared_ptr<Ledger> held;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (left_) return ledger_;
    held = ledger_;
  }
  if (held) {
    // The size first: a file cut short is let go of untouched (its mapping is unmapped when the
    // last holder drops it), and charged nothing more.
    if (const std::string cut = held->size_damage(); !cut.empty()) {
      std::lock_guard<std::mutex> guard(mutex_);
      if (ledger_ == held) {
        ledger_.reset();
        slot_ = -1;
        trouble_ = cut + " (this allocator let go of it: it maps nothing more until the file at "
                   "the path can be used)";
      }
      return nullptr;
    }
    if (held->still_linked()) return held;
  }
  reregister(held);
  std::lock_guard<std::mutex> guard(mutex_);
  return ledger_;
}

void ShareMember::reregister(const std::shared_ptr<Ledger>& old) {
  // Note [Ledger file identity]: the file at the path, created when absent.
  const std::string failed = "cannot re-register this allocator's pages into the ledger file " +
                             path_ + " (its file was removed, replaced or truncated): ";
  const std::string until = " (it maps nothing until it can; it tries again every " +
                            std::to_string(std::chrono::milliseconds(kTick).count()) + " ms)";
  std::shared_ptr<Ledger> fresh;
  try {
    fresh = Ledger::open(path_, true, access_);
  } catch (const std::exception& e) {
    set_trouble(failed + e.what() + until);
    return;
  }
  if (fresh == old) return;  // linked again meanwhile: the same file
  if (!fresh->lock(Clock::now() + Ledger::kLockTimeout)) {
    set_trouble(failed + fresh->lock_failure(
                             std::chrono::duration<double>(Ledger::kLockTimeout).count()) + until);
    return;
  }
  std::string why = fresh->damage();
  int slot = -1;
  if (why.empty()) {
    fresh->reclaim_dead_locked();
    for (int i = 0; i < kLedgerEntries && slot < 0; ++i) {
      if (fresh->file().entries[i].state.load() == 0) slot = i;
    }
    if (slot < 0) why = "it is full (" + std::to_string(kLedgerEntries) + " allocators)";
  }
  std::shared_ptr<Ledger> previous;
  int old_slot = -1;
  uint32_t old_generation = 0;
  bool stopped = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);  // lock order: Ledger lock -> mutex_
    stopped = left_ || stopping_;
    if (why.empty() && !stopped) {
      // Its pages and its demand go with it; the old entry is freed only once this one is live.
      const bool owned = owns_entry_locked();
      const int64_t demand = owned ? entry().demand_bytes.load() : 0;
      if (owned) {
        previous = ledger_;
        old_slot = slot_;
        old_generation = generation_;
      }
      take_entry_locked(*fresh, slot, charged_pages_ * page_bytes_, demand);
      ledger_ = fresh;
      trouble_.clear();
    }
  }
  if (stopped) fresh->remove_if_unused_locked();  // made for a member that left: nobody's
  fresh->unlock();
  if (!why.empty()) {
    set_trouble(failed + why + until);
    return;
  }
  if (stopped) return;
  fresh->notify();  // the others: these pages are charged here now
  if (!previous) return;
  LedgerEntry& e = previous->file().entries[old_slot];
  const bool locked = previous->lock(Clock::now() + kLeaveLockTimeout);
  if (e.generation.load(std::memory_order_acquire) == old_generation) {
    e.committed_bytes.store(0);
    e.blocked.store(0);
    e.waiters.store(0);
    e.demand_bytes.store(0);
    e.generation.fetch_add(1, std::memory_order_acq_rel);
    e.state.store(0, std::memory_order_release);
  }
  if (locked) previous->unlock();
  previous->notify();  // the members still in the old file: look at the path now
}

void ShareMember::run(std::shared_ptr<ShareMember> self, std::weak_ptr<PagePool> weak) {
  auto last_reclaim = Clock::now();
  while (!self->stopping_.load()) {
    // Note [Ledger file identity]: before this tick's first touch of the file.
    const std::shared_ptr<Ledger> ledger = self->check_file();
    const uint32_t seen = ledger ? ledger->seq() : 0;
    if (ledger) {
      {
        // Liveness for readers in other pid namespaces (Note [Share ledger]).
        std::lock_guard<std::mutex> guard(self->mutex_);
        if (self->owns_entry_locked()) self->entry().heartbeat_ns.store(monotonic_ns());
      }
      if (Clock::now() - last_reclaim >= kReclaimEvery) {
        // Dead processes' shares come back within kReclaimEvery + kTick even when nobody maps.
        last_reclaim = Clock::now();
        if (ledger->lock(Clock::now() + Ledger::kLockTimeout)) {
          ledger->reclaim_dead_locked();
          ledger->unlock();
        }
      }
    }
    {
      std::shared_ptr<PagePool> pool = weak.lock();
      if (!pool) break;
      try {
        pool->on_share_tick(*self);
      } catch (const std::exception&) {
        // A closed pool (or a ledger lock that stayed taken): nothing to do until stop().
      }
    }
    if (self->stopping_.load()) break;
    if (!ledger) {
      self->wake_.wait_for(kTick);
      continue;
    }
    // A fresh file's maps are planned again as soon as it has settled, not a tick later.
    const Clock::time_point now = Clock::now();
    auto timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(kTick);
    if (ledger->settling(now)) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(
          ledger->settled_at() - now);
      timeout = std::clamp<std::chrono::nanoseconds>(left + std::chrono::milliseconds(1),
                                                     std::chrono::milliseconds(1), timeout);
    }
    ledger->wait(seen, timeout);
  }
  self->exited_.notify();
}

}  // namespace kvasync
