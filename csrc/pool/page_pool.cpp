#include "pool/page_pool.h"

#include <algorithm>
#include <cassert>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "common/errors.h"
#include "common/trace.h"

namespace kvasync {
namespace {

// The furthest a deadline may lie, absolute or from now (about 31 years): the clock counts int64
// nanoseconds, so now + 1e10 s would wrap into the past and a job would be dropped at once.
constexpr double kMaxDeadlineSeconds = 1e9;

double clamp_seconds(double seconds) {
  // NaN and negatives become 0 (the past), huge values the bound.
  return seconds >= 0 ? std::min(seconds, kMaxDeadlineSeconds) : 0.0;
}

Clock::time_point to_time_point(double seconds) {
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(clamp_seconds(seconds))));
}

// now + `seconds`, for every deadline computed from a timeout (default_timeout, close's).
Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(clamp_seconds(seconds)));
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Note [Blocks and pages]: bytes of a block and of a page in one range (a pool of uniform pages
// is blocks_per_page one-byte blocks a page).
std::pair<int64_t, int64_t> block_and_page_bytes(const PoolConfig& config) {
  if (config.block_bytes > 0 || config.page_bytes > 0) return {config.block_bytes, config.page_bytes};
  return {1, config.blocks_per_page};
}

// Whole blocks of page `page`, below `num_blocks`: [first, end).
std::pair<int64_t, int64_t> page_blocks(int64_t page, int64_t block_bytes, int64_t page_bytes,
                                        int64_t num_blocks) {
  const int64_t first = (page * page_bytes + block_bytes - 1) / block_bytes;
  const int64_t end = std::min(((page + 1) * page_bytes) / block_bytes, num_blocks);
  return {first, std::max(first, end)};
}

// Note [Limit policy]: the linger, checked before the policy holds it (a day at most).
Clock::duration linger_duration(double seconds) {
  if (!(seconds >= 0.0 && seconds <= 86400.0)) {
    throw std::invalid_argument("linger_s must be between 0 and 86400 seconds, got " +
                                std::to_string(seconds));
  }
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Pages up to the last one holding a whole block below num_blocks (0 when the geometry is bad;
// the constructor says why).
int64_t page_count(const PoolConfig& config) {
  const auto [block_bytes, page_bytes] = block_and_page_bytes(config);
  if (block_bytes <= 0 || page_bytes <= 0 || config.num_blocks <= 0 ||
      config.num_blocks > INT64_MAX / 4 / block_bytes) {
    return 0;
  }
  int64_t pages = (config.num_blocks * block_bytes + page_bytes - 1) / page_bytes;
  // The last page touched may hold only the tail of a block across its start.
  while (pages > 0) {
    const auto [first, end] = page_blocks(pages - 1, block_bytes, page_bytes, config.num_blocks);
    if (end > first) break;
    --pages;
  }
  return pages;
}

}  // namespace

const char* job_name(JobKind kind) {
  switch (kind) {
    case JobKind::kMapForRequest: return "map";
    case JobKind::kRefill: return "refill";
    case JobKind::kUnmap: return "unmap";
  }
  return "?";
}

// Holds mutex_; on leaving the scope (exceptions included) unlocks, then releases the fences
// collected meanwhile. Note [Fences outside the lock].
class PagePool::FenceReleasingLock {
 public:
  explicit FenceReleasingLock(PagePool& pool) : pool_(pool), lock_(pool.mutex_) {}
  ~FenceReleasingLock() {
    std::vector<uintptr_t> fences;
    fences.swap(pool_.unused_fences_);
    lock_.unlock();
    for (uintptr_t fence : fences) {
      try {
        pool_.backend_->release_fence(fence);
      } catch (...) {
        // A destructor must not throw; a fence the driver refused to release is all we lose.
      }
    }
  }
  FenceReleasingLock(const FenceReleasingLock&) = delete;
  FenceReleasingLock& operator=(const FenceReleasingLock&) = delete;

 private:
  PagePool& pool_;
  std::unique_lock<std::mutex> lock_;
};

void PagePool::check_capacity(const PoolConfig& config) {
  // NOTE: the bookkeeping is allocated at open for the whole capacity: a byte per block and a
  // Page per page, mapped or not. Bounded so that a huge max_blocks is refused with a reason
  // rather than costing gigabytes of RAM (max_blocks=2**31 would take over 2 GiB).
  constexpr int64_t kMaxBytes = int64_t{256} << 20;
  if (config.num_blocks <= 0) throw std::invalid_argument("empty pool");
  const int64_t per_page = static_cast<int64_t>(sizeof(Page)) + 1;  // + the page-set bits
  const int64_t pages = page_count(config);
  // page_count is 0 for a geometry the constructor rejects (it says why), and for sizes past
  // 64 bits, which the bound below refuses.
  if (pages <= 0 && config.num_blocks <= kMaxBytes) return;
  const bool fits = config.num_blocks <= kMaxBytes && pages <= kMaxBytes / per_page &&
                    config.num_blocks + pages * per_page <= kMaxBytes;
  if (!fits) {
    const double mib = (static_cast<double>(config.num_blocks) +
                        static_cast<double>(pages) * static_cast<double>(per_page)) /
                       (1 << 20);
    std::ostringstream out;
    out << "max_blocks=" << config.num_blocks << " (" << pages << " pages) needs about " << mib
        << " MiB of host memory for the pool's bookkeeping (1 byte per block and " << per_page
        << " bytes per page), above the bound of " << (kMaxBytes >> 20)
        << " MiB; lower max_blocks, or raise page_size so that fewer pages hold them";
    throw std::invalid_argument(out.str());
  }
}

std::shared_ptr<PagePool> PagePool::create(std::shared_ptr<Backend> backend, PoolConfig config,
                                           std::shared_ptr<ShareMember> share) {
  check_capacity(config);  // before the constructor allocates anything
  std::shared_ptr<PagePool> pool(new PagePool(std::move(backend), config));
  pool->share_ = std::move(share);
  pool->mapper_.start(pool);
  if (pool->share_) pool->share_->start(pool);
  {
    std::lock_guard<std::mutex> lock(pool->mutex_);
    pool->plan_refill();  // start filling the reserve; nothing waits for it
  }
  return pool;
}

PagePool::PagePool(std::shared_ptr<Backend> backend, PoolConfig config)
    : backend_(std::move(backend)),
      config_(config),
      unmapped_(std::max<int64_t>(page_count(config), 1)),
      reserve_(std::max<int64_t>(page_count(config), 1)),
      with_free_(std::max<int64_t>(page_count(config), 1)),
      policy_(config.limit_pages, config.reserve_low, config.reserve_high,
              linger_duration(config.linger_s)) {
  const auto [block_bytes, page_bytes] = block_and_page_bytes(config);
  const int64_t num_pages = page_count(config);
  if (num_pages <= 0) {
    throw std::invalid_argument("empty pool: num_blocks " + std::to_string(config.num_blocks) +
                                ", block_bytes " + std::to_string(block_bytes) +
                                ", page_bytes " + std::to_string(page_bytes));
  }
  if (config.block_bytes > 0 && config.blocks_per_page != 0) {
    throw std::invalid_argument("give blocks_per_page or block_bytes and page_bytes, not both");
  }
  block_bytes_ = block_bytes;
  page_bytes_ = page_bytes;
  if (num_pages > backend_->num_pages()) {
    throw std::invalid_argument("pool needs more pages than the backend reserved");
  }
  if (config.limit_pages <= 0) throw std::invalid_argument("limit_pages must be positive");
  if (config.reserve_low < 0 || config.reserve_high < config.reserve_low) {
    throw std::invalid_argument("reserve watermarks must satisfy 0 <= low <= high");
  }
  pages_.resize(num_pages);
  for (int64_t p = 0; p < num_pages; ++p) {
    const auto [first, end] = page_blocks(p, block_bytes_, page_bytes_, config.num_blocks);
    if (end - first > INT32_MAX) throw std::invalid_argument("too many blocks in a page");
    if (end == first) {
      throw std::invalid_argument("page " + std::to_string(p) + " of " +
                                  std::to_string(page_bytes_) + " bytes holds no whole block of " +
                                  std::to_string(block_bytes_) + " bytes");
    }
    pages_[p].first_block = first;
    pages_[p].num_blocks = static_cast<int32_t>(end - first);
    usable_blocks_ += end - first;
    if (p < num_pages - 1 || num_pages == 1) {
      min_page_blocks_ = p == 0 ? end - first : std::min(min_page_blocks_, end - first);
    }
    unmapped_.insert(p);
  }
  count_[static_cast<int>(PageState::kUnmapped)] = num_pages;
  block_used_.assign(config.num_blocks, 0);
}

PagePool::~PagePool() = default;

void PagePool::check_open() const {
  if (closed_) throw AllocatorClosedError("the allocator is closed");
}

// ---------------------------------------------------------------------------------------------
// Accounting helpers (mutex_ held)

int64_t PagePool::headroom_pages() const {
  // Signed on purpose: a limit lowered below what is mapped gives a negative headroom, "none".
  const int64_t committed = count_[(int)PageState::kMapping] + count_[(int)PageState::kFree] +
                            count_[(int)PageState::kInUse] + count_[(int)PageState::kUnmapping];
  return policy_.headroom(committed);
}

int64_t PagePool::limit_blocks(int64_t limit_pages) const {
  // Note [Blocks and pages]: what any limit_pages pages hold, so a request within it is served
  // whichever pages are mapped (the short last page is swapped out for a full one: plan_maps).
  const int64_t num_pages = static_cast<int64_t>(pages_.size());
  if (limit_pages >= num_pages) return usable_blocks_;
  return limit_pages * min_page_blocks_;
}

int64_t PagePool::page_of(int64_t block) const {
  if (block < 0 || block >= config_.num_blocks) return -1;
  const int64_t page = block * block_bytes_ / page_bytes_;
  if (page >= static_cast<int64_t>(pages_.size())) return -1;
  const Page& p = pages_[page];
  return block - p.first_block < p.num_blocks ? page : -1;
}

int64_t PagePool::available_to_newcomer() const {
  // See Note [Waiters]: only the waiters' demand not covered by their own maps protects blocks.
  // Over the limit, a page still mapping drains when it lands (Note [Limit policy]): no waiter
  // can count on it, and all their demand protects the free blocks (first come, first served).
  const int64_t incoming = headroom_pages() < 0 ? 0 : incoming_for_waiters_;
  const int64_t protected_blocks = std::max<int64_t>(0, waiting_blocks_ - incoming);
  return usable_free_blocks() - protected_blocks;
}

bool PagePool::draining() const {
  // Note [Limit policy]: only while the pool is over its limit; once within it, every page
  // serves again.
  return policy_.draining(headroom_pages());
}

int64_t PagePool::usable_free_blocks() const {
  if (!draining()) return free_blocks_;
  int64_t draining_free = 0;
  for (int64_t page = with_free_.last(); page >= policy_.drain_from_page();
       page = with_free_.prev(page - 1)) {
    draining_free += static_cast<int64_t>(pages_[page].free_slots.size());
  }
  return free_blocks_ - draining_free;
}

void PagePool::plan_drain() {
  // Note [Limit policy]: the pages held over the limit (less those already unmapping),
  // highest first: allocation packs into the lowest pages, so these hold the fewest (and
  // youngest) blocks. Pages still mapping count too, at their place: over the limit no waiter
  // counts on them (available_to_newcomer), and they drain when they land. Left out, a lower
  // page that landed first drained in their stead, unmapped at once while a waiter waited for
  // it, and the waiter was served from the higher page landing after it: a fresh pool in a
  // share whose fair share fell handed out its first blocks from another page than page 0
  // (tests/test_pool_fresh_in_share.py).
  const int64_t over = -headroom_pages() - count_[(int)PageState::kUnmapping];
  policy_.plan_drain(over, static_cast<int64_t>(pages_.size()), [&](int64_t page) {
    const PageState state = pages_[page].state;
    return state == PageState::kFree || state == PageState::kInUse ||
           state == PageState::kMapping;
  });
}

std::vector<int64_t> PagePool::free_draining_pages(int64_t max_pages) const {
  std::vector<int64_t> pages;
  if (!draining()) return pages;
  for (int64_t page = reserve_.last();
       page >= policy_.drain_from_page() && static_cast<int64_t>(pages.size()) < max_pages;
       page = reserve_.prev(page - 1)) {
    pages.push_back(page);
  }
  return pages;
}

void PagePool::set_state(int64_t page, PageState state) {
  Page& p = pages_[page];
  count_[static_cast<int>(p.state)] -= 1;
  count_[static_cast<int>(state)] += 1;
  if (p.state == PageState::kFree) reserve_.erase(page);
  if (p.state == PageState::kUnmapped) unmapped_.erase(page);
  if (state == PageState::kFree) reserve_.insert(page);
  if (state == PageState::kUnmapped) unmapped_.insert(page);
  p.state = state;
  if (state == PageState::kInUse) policy_.in_use_rose(count_[static_cast<int>(state)]);
}

void PagePool::add_mapped_blocks(int64_t page) {
  Page& p = pages_[page];
  p.used = 0;
  p.free_slots.clear();
  // Pushed in reverse so that slots are handed out lowest first.
  for (int32_t slot = p.num_blocks - 1; slot >= 0; --slot) p.free_slots.push_back(slot);
  free_blocks_ += p.num_blocks;
  with_free_.insert(page);
}

void PagePool::remove_mapped_blocks(int64_t page) {
  Page& p = pages_[page];
  free_blocks_ -= static_cast<int64_t>(p.free_slots.size());
  p.free_slots.clear();
  with_free_.erase(page);
}

std::vector<int64_t> PagePool::take_blocks(int64_t n) {
  // Lowest page first, so that high pages empty out and can be unmapped.
  std::vector<int64_t> out;
  out.reserve(n);
  while (static_cast<int64_t>(out.size()) < n) {
    const int64_t page = with_free_.first();
    // Note [Limit policy]: callers check n against usable_free_blocks(), and the lowest pages
    // go first, so none is draining.
    assert(page >= 0 && !(draining() && page >= policy_.drain_from_page()));
    Page& p = pages_[page];
    if (p.used == 0) set_state(page, PageState::kInUse);
    while (!p.free_slots.empty() && static_cast<int64_t>(out.size()) < n) {
      const int64_t block = p.first_block + p.free_slots.back();
      p.free_slots.pop_back();
      block_used_[block] = 1;
      out.push_back(block);
      ++p.used;
    }
    if (p.free_slots.empty()) with_free_.erase(page);
  }
  free_blocks_ -= n;
  used_blocks_ += n;
  return out;
}

std::vector<int64_t> PagePool::claim_unmapped(int64_t max_blocks, int64_t max_pages) {
  std::vector<int64_t> claimed;
  int64_t blocks = 0;
  while (blocks < max_blocks && static_cast<int64_t>(claimed.size()) < max_pages &&
         !unmapped_.empty()) {
    const int64_t page = unmapped_.first();
    set_state(page, PageState::kMapping);
    blocks += pages_[page].num_blocks;
    claimed.push_back(page);
  }
  return claimed;
}

Job PagePool::make_unmap_job(std::vector<int64_t> pages, int64_t request_id,
                             Clock::time_point deadline) {
  std::sort(pages.begin(), pages.end());
  Job job{JobKind::kUnmap, request_id, {}, deadline, {}};
  for (int64_t page : pages) {
    remove_mapped_blocks(page);
    set_state(page, PageState::kUnmapping);
    const std::vector<uintptr_t>& fences = pages_[page].fences;
    job.fences.insert(job.fences.end(), fences.begin(), fences.end());
  }
  std::sort(job.fences.begin(), job.fences.end());
  job.fences.erase(std::unique(job.fences.begin(), job.fences.end()), job.fences.end());
  job.pages = std::move(pages);
  return job;
}

void PagePool::drop_fences(const std::vector<int64_t>& pages) {
  for (int64_t page : pages) {
    for (uintptr_t fence : pages_[page].fences) {
      if (--fence_refs_[fence] == 0) {
        fence_refs_.erase(fence);
        unused_fences_.push_back(fence);  // released after unlocking
      }
    }
    pages_[page].fences.clear();
  }
}

std::vector<int64_t> PagePool::highest_reserve(int64_t max_pages) const {
  // Highest first: allocation packs into the lowest pages, so these are the last to be needed.
  std::vector<int64_t> pages;
  for (int64_t page = reserve_.last(); page >= 0 && (int64_t)pages.size() < max_pages;
       page = reserve_.prev(page - 1)) {
    pages.push_back(page);
  }
  return pages;
}

void PagePool::push_job(Job job) {
  job.seq = next_job_seq_++;
  if (job.charge_pending) uncharged_pages_ += static_cast<int64_t>(job.pages.size());
  (job.kind == JobKind::kUnmap ? unmaps_in_flight_ : maps_in_flight_).insert(job.seq);
  jobs_[job.deadline].push_back(std::move(job));
  trace::mark(trace::kJobQueued);
  mapper_.wake();
}

// ---------------------------------------------------------------------------------------------
// Planning (mutex_ held)

void PagePool::serve_waiters() {
  int64_t usable = usable_free_blocks();  // Note [Limit policy]: never from draining pages
  while (!waiters_.empty() && waiters_.front().n <= usable) {
    const Waiter waiter = waiters_.front();
    waiters_.pop_front();
    waiting_blocks_ -= waiter.n;
    usable -= waiter.n;
    completions_.push({waiter.id, CompletionStatus::kOk, take_blocks(waiter.n), {}});
  }
}

void PagePool::plan_maps() {
  if (share_ && waiters_.empty()) {
    share_->set_blocked(0);
    ledger_busy_pid_ = 0;  // no wait to describe: the next charge finds out afresh
  }
  if (waiters_.empty() || closed_) return;
  const int64_t deficit = waiting_blocks_ - usable_free_blocks() - incoming_for_waiters_;
  const int64_t headroom = headroom_pages();
  if (deficit > 0 && headroom <= 0) {
    // NOTE: the last page may hold fewer blocks than the others, yet it costs a whole page of
    // the limit. Parked in the reserve at the limit, it would keep a waiter that fits the limit
    // from ever being served: give it back, and the full page that replaces it follows.
    const int64_t last = static_cast<int64_t>(pages_.size()) - 1;
    if (pages_[last].num_blocks < min_page_blocks_ &&
        pages_[last].state == PageState::kFree && !unmapped_.empty()) {
      push_job(make_unmap_job({last}, 0, deadline_after(config_.default_timeout_s)));
    }
    return;  // otherwise: waiting for blocks to be freed
  }
  if (deficit <= 0) return;  // covered by free blocks and the pages mapping for waiters
  // The job serves every waiter, so it lives as long as the latest of them.
  Clock::time_point deadline = waiters_.front().deadline;
  for (const Waiter& w : waiters_) deadline = std::max(deadline, w.deadline);
  if (deadline <= Clock::now()) return;
  std::vector<int64_t> pages = claim_unmapped(deficit, headroom);
  bool charge_pending = false;
  if (share_) {
    const size_t wanted = pages.size();
    if (try_charge_share(pages, false)) {
      share_->set_blocked(pages.size() < wanted ? static_cast<int64_t>(waiters_.size()) : 0);
    } else {
      charge_pending = true;  // the mapper charges it (Note [Budget off the caller's thread])
    }
  }
  if (pages.empty()) return;
  for (int64_t page : pages) incoming_for_waiters_ += pages_[page].num_blocks;
  Job job{JobKind::kMapForRequest, waiters_.back().id, std::move(pages), deadline, {}};
  job.charge_pending = charge_pending;
  push_job(std::move(job));
}

void PagePool::plan_refill() {
  // Note [Budget off the caller's thread]: a map for demand still to be charged goes first.
  if (closed_ || uncharged_pages_ > 0) return;
  const int64_t have = count_[(int)PageState::kFree] + refill_pages_;
  const int64_t want = policy_.refill_wanted(have, headroom_pages());  // Note [Limit policy]
  if (want <= 0) return;
  std::vector<int64_t> pages = claim_unmapped(INT64_MAX, want);
  if (!try_charge_share(pages, true)) {
    // The ledger's lock is busy: no refill now (Note [Budget off the caller's thread]).
    for (int64_t page : pages) set_state(page, PageState::kUnmapped);
    return;
  }
  if (pages.empty()) return;
  refill_pages_ += static_cast<int64_t>(pages.size());
  push_job({JobKind::kRefill, 0, std::move(pages), deadline_after(config_.default_timeout_s), {}});
}

void PagePool::plan_unmaps() {
  if (closed_) return;
  // Pages mapped beyond a lowered limit, less those already on their way out.
  const int64_t over_limit = -headroom_pages() - count_[(int)PageState::kUnmapping];
  if (!waiters_.empty()) {
    // Free blocks go to waiters first, except those of draining pages (Note [Limit policy]).
    std::vector<int64_t> pages = free_draining_pages(over_limit);
    if (!pages.empty()) {
      push_job(make_unmap_job(std::move(pages), 0, deadline_after(config_.default_timeout_s)));
      plan_drain();
    }
    return;
  }
  const int64_t reserve = count_[(int)PageState::kFree];
  // Note [Limit policy]: what of the reserve stays (none under the share's pressure).
  const auto now = Clock::now();
  const int64_t in_use = count_[(int)PageState::kInUse];
  policy_.observe_in_use(now, in_use);
  const int64_t keep = policy_.reserve_to_keep(now, min_page_blocks_, in_use);
  const int64_t excess = std::min(reserve, std::max(reserve - keep, over_limit));
  if (excess <= 0) return;
  std::vector<int64_t> pages = highest_reserve(excess);
  push_job(make_unmap_job(std::move(pages), 0, deadline_after(config_.default_timeout_s)));
  if (policy_.drain_planned()) plan_drain();  // fewer pages over the limit now
}

// ---------------------------------------------------------------------------------------------
// The caller's side

std::variant<std::vector<int64_t>, int64_t> PagePool::alloc(int64_t n, double deadline_s) {
  if (n <= 0) throw std::invalid_argument("n must be positive, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mutex_);
  check_open();
  policy_.demanded();  // refills resume after a trim (Note [Limit policy])
  // The own limit, not the effective one: a fair-share limit is temporary, a request above it
  // can still fit (Note [Limit policy]).
  const int64_t limit = limit_blocks(policy_.own_limit());
  if (share_ && n <= usable_blocks_ && n <= limit) {
    // Nor can a request above the whole budget of its share: it would wait out its deadline.
    const int64_t budget_blocks = limit_blocks(share_->budget_pages());
    if (n > budget_blocks) {
      throw OutOfBlocksError("alloc of " + std::to_string(n) +
                             " blocks can never fit: the whole budget of the share holds " +
                             std::to_string(budget_blocks) + " blocks (" +
                             share_->path() + "); allocate fewer blocks at a time");
    }
  }
  if (n > usable_blocks_ || n > limit) {
    const int64_t lost = config_.num_blocks - usable_blocks_;
    throw OutOfBlocksError(
        "alloc of " + std::to_string(n) + " blocks can never fit: capacity is " +
        std::to_string(usable_blocks_) + " blocks" +
        (lost > 0 ? " (" + std::to_string(lost) + " of the " + std::to_string(config_.num_blocks) +
                        " ids lie across page boundaries)"
                  : std::string()) +
        " and the memory limit allows " + std::to_string(std::min(limit, usable_blocks_)) +
        "; raise max_blocks or memory_limit, or allocate fewer blocks at a time");
  }
  if (n <= available_to_newcomer()) {
    std::vector<int64_t> blocks = take_blocks(n);
    plan_refill();
    return blocks;
  }
  const int64_t id = next_request_id_++;
  // A negative deadline means "now + default_timeout": the hot path need not read the clock.
  const Clock::time_point deadline =
      deadline_s < 0 ? deadline_after(config_.default_timeout_s) : to_time_point(deadline_s);
  waiters_.push_back({id, n, deadline});
  waiting_blocks_ += n;
  // A request that needs pages: what the pool claimed counts on (Note [Demand claims]).
  if (share_) publish_demand(Clock::now());  // before the grant: the others see it first
  plan_maps();
  plan_refill();
  return id;
}

std::optional<std::vector<int64_t>> PagePool::alloc_nowait(int64_t n, bool map_on_miss) {
  if (n <= 0) throw std::invalid_argument("n must be positive, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mutex_);
  check_open();
  policy_.demanded();  // refills resume after a trim (Note [Limit policy])
  const int64_t available = available_to_newcomer();
  if (n > available && !map_on_miss) return std::nullopt;
  if (n > available) {
    // Map what the request lacks, less what refills already bring; the reserve holds it for a
    // while (Note [Limit policy]: the nowait hold).
    const int64_t bpp = min_page_blocks_;  // Note [Blocks and pages]: the fewest a page holds
    const int64_t lacking = n - std::max<int64_t>(0, available) - refill_pages_ * bpp;
    const bool can_fit = n <= std::min(limit_blocks(policy_.limit()), usable_blocks_);
    if (can_fit) {  // a request that can never fit (OutOfBlocks) keeps nothing
      policy_.nowait_missed(n, Clock::now());
      claim_.requested(Clock::now());  // Note [Demand claims]: a request that needs pages
      if (share_) publish_demand(Clock::now());
    }
    if (lacking > 0 && can_fit) {
      std::vector<int64_t> pages = claim_unmapped(lacking, headroom_pages());
      // Charged to the share like any map (issue 18: uncharged, a process mapped 3x its
      // budget); demand, not an optimisation, so granted as a waiter's map is.
      const bool charge_pending = !try_charge_share(pages, false);
      if (!pages.empty()) {
        refill_pages_ += static_cast<int64_t>(pages.size());
        Job job{JobKind::kRefill, 0, std::move(pages), deadline_after(config_.default_timeout_s), {}};
        job.charge_pending = charge_pending;
        push_job(std::move(job));
      }
    }
    plan_refill();
    return std::nullopt;
  }
  std::vector<int64_t> blocks = take_blocks(n);
  policy_.nowait_served(n);
  plan_refill();
  return blocks;
}

std::vector<double> PagePool::take_map_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<double> out;
  out.swap(map_seconds_);
  return out;
}

int64_t PagePool::available_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return 0;
  // Mapped free blocks, blocks on their way in, and the blocks of the unmapped pages the limit
  // still allows (lowest first, as claim_unmapped takes them: the short last page comes last).
  // NOTE: a refill counts whole pages: a short last page being refilled overstates it slightly.
  const int64_t bpp = min_page_blocks_;  // Note [Blocks and pages]: the fewest a page holds
  const int64_t unmapped = static_cast<int64_t>(count_[(int)PageState::kUnmapped]);
  int64_t mappable = std::clamp<int64_t>(headroom_pages(), 0, unmapped);
  // In a share, only what its budget leaves this pool, counting on its fair share (the others
  // are held to theirs while it waits: Note [Fair share under pressure]).
  if (share_) mappable = std::min(mappable, share_->room_pages());
  // Over the limit, pages still mapping drain when they land (Note [Limit policy]): none is
  // coming.
  const int64_t incoming =
      headroom_pages() < 0 ? 0 : incoming_for_waiters_ + refill_pages_ * bpp;
  int64_t blocks = usable_free_blocks() + incoming + mappable * bpp;
  const int64_t last = static_cast<int64_t>(pages_.size()) - 1;
  if (mappable > 0 && mappable == unmapped && pages_[last].state == PageState::kUnmapped) {
    blocks -= bpp - pages_[last].num_blocks;
  }
  return std::max<int64_t>(0, blocks - waiting_blocks_);
}

std::vector<int64_t> PagePool::free_blocks_in_order(int64_t limit) const {
  if (limit < 0) throw std::invalid_argument("free_blocks_in_order: limit must be >= 0");
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> out;
  if (closed_) return out;
  // take_blocks' walk without its writes: with_free_ ascending, each page's free_slots from the
  // back. Draining pages are the highest (Note [Limit policy]), so the walk stops at the first.
  const int64_t stop = draining() ? policy_.drain_from_page() : static_cast<int64_t>(pages_.size());
  out.reserve(static_cast<size_t>(std::min(limit, usable_free_blocks())));
  for (int64_t page = with_free_.first();
       page >= 0 && page < stop && static_cast<int64_t>(out.size()) < limit;
       page = with_free_.next(page + 1)) {
    const Page& p = pages_[page];
    for (auto slot = p.free_slots.rbegin();
         slot != p.free_slots.rend() && static_cast<int64_t>(out.size()) < limit; ++slot) {
      out.push_back(p.first_block + *slot);
    }
  }
  return out;
}

int64_t PagePool::drain_from_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_ || !draining()) return -1;
  return pages_[policy_.drain_from_page()].first_block;
}

void PagePool::free(const std::vector<int64_t>& blocks, uintptr_t fence) {
  FenceReleasingLock lock(*this);
  // Validate everything before changing anything: mark each block 2 ("seen") on the way, undo.
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t block = blocks[i];
    const bool in_range = block >= 0 && block < config_.num_blocks;
    const uint8_t state = in_range ? block_used_[block] : 0;
    if (state != 1) {
      for (size_t j = 0; j < i; ++j) block_used_[blocks[j]] = 1;
      if (fence != 0) unused_fences_.push_back(fence);  // we own it, and nothing will use it
      if (!in_range) {
        throw std::invalid_argument("free: block id " + std::to_string(block) +
                                    " is out of range [0, " + std::to_string(config_.num_blocks) +
                                    "); nothing was freed");
      }
      const char* why = state == 2            ? " appears twice"
                        : page_of(block) < 0    ? " is never allocated: it lies across a page boundary"
                                                : " is not allocated";
      throw std::invalid_argument("free: block " + std::to_string(block) + why +
                                  "; nothing was freed");
    }
    block_used_[block] = 2;
  }
  if (closed_) {
    // The pages are gone (or going) with the allocator: record the blocks as freed, nothing more.
    for (int64_t block : blocks) block_used_[block] = 0;
    used_blocks_ -= static_cast<int64_t>(blocks.size());
    if (fence != 0) unused_fences_.push_back(fence);
    return;
  }
  for (int64_t block : blocks) {
    block_used_[block] = 0;
    const int64_t page = block * block_bytes_ / page_bytes_;  // allocated: whole in this page
    Page& p = pages_[page];
    if (fence != 0 && (p.fences.empty() || p.fences.back() != fence)) {
      p.fences.push_back(fence);
      ++fence_refs_[fence];
    }
    p.free_slots.push_back(static_cast<int32_t>(block - p.first_block));
    if (p.free_slots.size() == 1) with_free_.insert(page);
    if (--p.used == 0) set_state(page, PageState::kFree);
  }
  if (fence != 0 && fence_refs_.count(fence) == 0) unused_fences_.push_back(fence);  // no blocks
  const int64_t n = static_cast<int64_t>(blocks.size());
  used_blocks_ -= n;
  free_blocks_ += n;
  serve_waiters();
  plan_maps();  // a waiter still short at the memory limit may need the pages reshuffled
  plan_unmaps();
}

std::string PagePool::describe_wait(const Waiter& waiter) const {
  std::ostringstream out;
  out << waiter.n << " blocks";
  size_t ahead = 0;
  while (ahead < waiters_.size() && waiters_[ahead].id != waiter.id) ++ahead;
  if (ahead > 0) out << ", queued behind " << ahead << " earlier request(s)";
  const int64_t mapping = count_[(int)PageState::kMapping];
  if (mapping > 0) out << ", " << mapping << " page(s) mapping";
  if (current_job_) {
    out << " (mapper busy on " << job_name(current_job_->kind) << " of "
        << current_job_->pages.size() << " page(s) for " << seconds_since(current_job_start_)
        << " s)";
  }
  // Note [Limit policy]: under the share's pressure the limit in force is the fair share.
  const bool held_to_fair_share = share_ && policy_.limit() < policy_.own_limit();
  if (headroom_pages() <= 0 && mapping == 0) {
    if (held_to_fair_share) {
      out << ", held to its fair share of the share's budget, " << policy_.limit()
          << " page(s) of its own limit of " << policy_.own_limit() << ", with " << free_blocks_
          << " free block(s): waiting for blocks to be freed, or for the share's pressure to ease";
    } else {
      out << ", at the memory limit of " << policy_.limit() << " page(s) with " << free_blocks_
          << " free block(s): waiting for blocks to be freed";
    }
  }
  if (share_ && (share_->blocked() || held_to_fair_share)) {
    out << ", " << share_->describe_budget();
  }
  if (share_ && ledger_busy_pid_ != 0) {
    out << ", the share's ledger lock (" << share_->path() << ") is held by "
        << (ledger_busy_pid_ > 0 ? "pid " + std::to_string(ledger_busy_pid_)
                                 : std::string("an unknown process"))
        << ": no budget can be charged until it lets go (is that process stopped or stuck?)";
  }
  // Note [Ledger file identity] in ledger.h: the share grants nothing now, and why.
  if (share_) {
    if (const std::string trouble = share_->trouble(); !trouble.empty()) out << ", " << trouble;
  }
  return out.str();
}

std::optional<std::string> PagePool::cancel(int64_t request_id, bool timed_out) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(waiters_.begin(), waiters_.end(),
                         [&](const Waiter& w) { return w.id == request_id; });
  if (it == waiters_.end()) {
    // A trim given up: forget it (its unmaps, if any, still run). The caller describes the wait
    // from the mapper's current op.
    trims_.erase(std::remove_if(trims_.begin(), trims_.end(),
                                [&](const PendingTrim& t) { return t.id == request_id; }),
                 trims_.end());
    return std::nullopt;
  }
  std::string what = describe_wait(*it);
  waiting_blocks_ -= it->n;
  waiters_.erase(it);
  if (timed_out) ++timeouts_;
  serve_waiters();  // the head may have been the one blocking the others
  plan_unmaps();
  return what;
}

void PagePool::fail_waiter(int64_t request_id, CompletionStatus status, const std::string& message) {
  auto it = std::find_if(waiters_.begin(), waiters_.end(),
                         [&](const Waiter& w) { return w.id == request_id; });
  if (it == waiters_.end()) return;
  waiting_blocks_ -= it->n;
  waiters_.erase(it);
  completions_.push({request_id, status, {}, message});
}

int64_t PagePool::trim(double deadline_s, bool release_cached) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_open();
  // Note [Limit policy]: no refill until the next alloc, and a refill not started yet never
  // starts.
  policy_.trimmed();
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    std::vector<Job>& queued = it->second;
    for (size_t k = 0; k < queued.size();) {
      if (queued[k].kind == JobKind::kRefill) {
        revert_job(queued[k]);
        queued.erase(queued.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        ++k;
      }
    }
    it = queued.empty() ? jobs_.erase(it) : std::next(it);
  }
  PendingTrim trim{next_request_id_++, next_job_seq_, to_time_point(deadline_s), 0, false, 0,
                   !release_cached};
  if (trim_done(trim)) return 0;
  trims_.push_back(trim);
  return trim.id;
}

bool PagePool::trim_done(PendingTrim& trim) {
  if (!trim.swept) {
    // Unmap the reserve now, and again each time a map queued before the trim lands (Note
    // [Trim]); so a trim ends after a bounded number of sweeps even while frees go on. Free
    // blocks go to waiters first: a reserve that a waiter counts on stays.
    if (waiters_.empty() && !reserve_.empty()) {
      Job job = make_unmap_job(highest_reserve(reserve_.size()), trim.id, trim.deadline);
      job.keep_cached = trim.keep_cached;
      push_job(std::move(job));
      ++trim.unmap_jobs;
    }
    if (!maps_in_flight_.empty() && *maps_in_flight_.begin() < trim.before_seq) return false;
    trim.swept = true;
    trim.unmaps_before_seq = next_job_seq_;
  }
  // And the memory is given back: every unmap queued up to the last sweep (the trim's own, and
  // those planned as the maps it waited for landed) is done.
  const bool unmapping =
      !unmaps_in_flight_.empty() && *unmaps_in_flight_.begin() < trim.unmaps_before_seq;
  return trim.unmap_jobs == 0 && !unmapping;
}

void PagePool::settle_trims() {
  const auto now = Clock::now();
  for (size_t k = 0; k < trims_.size();) {
    PendingTrim& trim = trims_[k];
    if (trim_done(trim)) {
      completions_.push({trim.id, CompletionStatus::kOk, {}, {}});
    } else if (trim.deadline <= now && trim.unmap_jobs == 0) {
      // Normally cancelled by the caller's timer first; this bounds a trim nobody cancels.
      completions_.push({trim.id, CompletionStatus::kMapError, {},
                         "trim: its deadline passed while maps queued before it were in flight"});
    } else {
      ++k;
      continue;
    }
    trims_.erase(trims_.begin() + static_cast<std::ptrdiff_t>(k));
  }
}

bool PagePool::finish_trim_unmap(int64_t request_id, const BackendResult& result) {
  auto it = std::find_if(trims_.begin(), trims_.end(),
                         [&](const PendingTrim& t) { return t.id == request_id; });
  if (it == trims_.end()) return false;
  --it->unmap_jobs;
  if (!result.ok) {  // pages stayed mapped: the trim failed, whatever its other unmaps do
    completions_.push({request_id, CompletionStatus::kMapError, {}, result.error});
    trims_.erase(it);
  }
  return true;  // settle_trims completes it once nothing is left to wait for
}

void PagePool::job_left_flight(const Job& job) {
  std::multiset<int64_t>& in_flight =
      job.kind == JobKind::kUnmap ? unmaps_in_flight_ : maps_in_flight_;
  auto it = in_flight.find(job.seq);
  if (it != in_flight.end()) in_flight.erase(it);
}

int64_t PagePool::set_limit_pages(int64_t limit_pages, double deadline_s) {
  if (limit_pages <= 0) throw std::invalid_argument("the memory limit must allow at least one page");
  std::lock_guard<std::mutex> lock(mutex_);
  check_open();
  policy_.set_configured(limit_pages);
  const int64_t limit = limit_blocks(limit_pages);
  std::vector<int64_t> too_big;
  for (const Waiter& w : waiters_) {
    if (w.n > limit) too_big.push_back(w.id);
  }
  for (int64_t id : too_big) {
    fail_waiter(id, CompletionStatus::kOutOfBlocks,
                "the memory limit was lowered to " + std::to_string(limit) +
                    " blocks, fewer than this request needs");
  }
  plan_drain();
  serve_waiters();
  plan_maps();
  const int64_t over = -headroom_pages() - count_[(int)PageState::kUnmapping];
  if (over > 0 && !waiters_.empty()) plan_unmaps();  // free draining pages (Note [Limit policy])
  if (over <= 0 || !waiters_.empty() || reserve_.empty()) return 0;
  std::vector<int64_t> pages = highest_reserve(over);
  const int64_t id = next_request_id_++;
  push_job(make_unmap_job(std::move(pages), id, to_time_point(deadline_s)));
  plan_drain();  // the free pages unmapped first: fewer (or no) pages in use need to drain
  return id;
}

bool PagePool::close(double timeout_s) {
  {
    FenceReleasingLock lock(*this);
    if (closed_) return mapper_.joined();
    closed_ = true;
    // An idle mapper wakes at once when told to stop: give it a moment even at timeout 0, so
    // that close() can still unmap everything. A mapper inside a backend call gets `timeout_s`.
    if (!current_job_) timeout_s = std::max(timeout_s, 1.0);
    for (auto& [deadline, jobs] : jobs_) {
      for (const Job& job : jobs) revert_job(job);
    }
    jobs_.clear();
    for (const Waiter& w : waiters_) {
      completions_.push({w.id, CompletionStatus::kClosed, {}, "the allocator was closed"});
    }
    waiters_.clear();
    waiting_blocks_ = 0;
    for (const PendingTrim& trim : trims_) {
      completions_.push({trim.id, CompletionStatus::kClosed, {}, "the allocator was closed"});
    }
    trims_.clear();
  }
  const bool joined = mapper_.stop_and_join(timeout_s);
  // NOTE: an abandoned mapper keeps its mappings, and its pages stay charged to the share.
  if (!joined) return false;  // the thread still owns the backend: leave the mappings alone
  std::vector<int64_t> unmapping;
  std::set<uintptr_t> fences;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t page = 0; page < static_cast<int64_t>(pages_.size()); ++page) {
      const PageState state = pages_[page].state;
      if (state == PageState::kFree || state == PageState::kInUse) {
        remove_mapped_blocks(page);
        set_state(page, PageState::kUnmapping);
        unmapping.push_back(page);
        fences.insert(pages_[page].fences.begin(), pages_[page].fences.end());
      }
    }
  }
  // The mapper is gone, so this thread is the backend's only caller now; the lock is not held
  // across these calls. Note [Unmap safety]: device work still using a page must finish first,
  // within the timeout; otherwise the mappings stay (and go with the backend).
  const auto deadline = deadline_after(timeout_s);
  bool idle = true;
  // A backend exception is a failure here too (DESIGN.md): the pool must still end closed.
  for (uintptr_t fence : fences) {
    try {
      idle = backend_->wait_fence(fence, deadline).ok && idle;
    } catch (...) {
      idle = false;
    }
  }
  if (idle) {
    // Note [Views outlive close] (backend.h): retired, not unmapped. The memory goes back, but a
    // torch view taken before the close still finds every address it could use mapped (to
    // scratch memory) until the view and the backend are gone. One call per run of pages.
    for (size_t i = 0; i < unmapping.size();) {
      size_t end = i + 1;
      while (end < unmapping.size() && unmapping[end] == unmapping[end - 1] + 1) ++end;
      try {
        backend_->retire(unmapping[i], static_cast<int64_t>(end - i), deadline);
      } catch (...) {
        // Left mapped: the backend's reservation goes with it.
      }
      i = end;
    }
  }
  {
    FenceReleasingLock lock(*this);
    for (int64_t page : unmapping) set_state(page, PageState::kUnmapped);
    drop_fences(unmapping);
    release_share(static_cast<int64_t>(unmapping.size()));  // reverted jobs released theirs
  }
  // Not under mutex_: the watcher takes it on each tick.
  if (share_) share_->stop(1.0);
  return true;
}

// ---------------------------------------------------------------------------------------------
// The mapper's side

void PagePool::revert_job(const Job& job) {
  for (int64_t page : job.pages) {
    if (job.kind == JobKind::kUnmap) {
      set_state(page, PageState::kFree);
      add_mapped_blocks(page);
    } else {
      set_state(page, PageState::kUnmapped);
      if (job.kind == JobKind::kMapForRequest) incoming_for_waiters_ -= pages_[page].num_blocks;
    }
  }
  if (job.kind == JobKind::kRefill) refill_pages_ -= static_cast<int64_t>(job.pages.size());
  job_left_flight(job);
  // A job still waiting for its charge was never charged (Note [Budget off the caller's thread]).
  if (job.charge_pending) {
    uncharged_pages_ -= static_cast<int64_t>(job.pages.size());
  } else if (job.kind != JobKind::kUnmap) {
    release_share(static_cast<int64_t>(job.pages.size()));
  }
}

std::vector<Job> PagePool::next_batch() {
  std::lock_guard<std::mutex> lock(mutex_);
  current_job_.reset();
  const auto now = Clock::now();
  // Note [Limit policy]: once the nowait hold lapses, what nobody claimed is trimmed as usual.
  // And once a linger lapses, what lingered goes back.
  const bool hold_lapsed = policy_.hold_lapsed(now);
  const bool linger_lapsed = policy_.linger_lapsed(now);
  if (hold_lapsed || linger_lapsed) plan_unmaps();
  // Note [Mapper deadlines]: jobs already too late to help anyone never reach the backend.
  // Deadline order puts them all at the front.
  std::vector<Job> expired;
  while (!jobs_.empty() && jobs_.begin()->first <= now) {
    for (Job& job : jobs_.begin()->second) expired.push_back(std::move(job));
    jobs_.erase(jobs_.begin());
  }
  for (const Job& job : expired) {
    ++dropped_jobs_;
    revert_job(job);
    if (job.request_id != 0 && job.kind == JobKind::kUnmap) {
      const BackendResult dropped = BackendResult::failure(
          "unmap job dropped: its deadline passed before the mapper reached it");
      if (!finish_trim_unmap(job.request_id, dropped)) {
        completions_.push({job.request_id, CompletionStatus::kMapError, {}, dropped.error});
      }
    }
    if (job.kind == JobKind::kUnmap) {
      // Its pages are mapped-free again: a trim that waited for this unmap sweeps again (Note
      // [Limit policy]: trim), else it would complete with them still mapped.
      for (PendingTrim& trim : trims_) {
        if (trim.swept && job.seq < trim.unmaps_before_seq) trim.swept = false;
      }
    }
  }
  if (!expired.empty()) {
    serve_waiters();
    plan_maps();  // new jobs, if any, have a deadline still ahead
    settle_trims();
  }
  std::vector<Job> batch;
  if (jobs_.empty()) return batch;
  // The earliest job, and with a map for requests every other queued one: the pages of many
  // requests then reach the backend together and consecutive ones become one run (one access
  // call on cuda). Refills are not merged with them: a refill that fails (a full device) must
  // not fail a request with it (the reserve is never a dependency).
  const JobKind kind = jobs_.begin()->second.front().kind;
  const bool maps = kind == JobKind::kMapForRequest;
  int64_t num_pages = 0;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    std::vector<Job>& queued = it->second;
    for (size_t k = 0; k < queued.size();) {
      const bool fits = batch.empty() ||
                        (maps && queued[k].kind == kind &&
                         num_pages + static_cast<int64_t>(queued[k].pages.size()) <= kMaxBatchPages);
      if (!fits) {
        ++k;
        continue;
      }
      num_pages += static_cast<int64_t>(queued[k].pages.size());
      batch.push_back(std::move(queued[k]));
      queued.erase(queued.begin() + static_cast<std::ptrdiff_t>(k));
      if (!maps) break;
    }
    it = queued.empty() ? jobs_.erase(it) : std::next(it);
    if (!maps) break;
  }
  ++batches_;
  current_job_ = batch.size() == 1 ? batch.front() : merge_jobs(batch);
  current_job_start_ = now;
  return batch;
}

Job merge_jobs(const std::vector<Job>& jobs) {
  Job merged{jobs.front().kind, 0, {}, jobs.front().deadline, {}};
  for (const Job& job : jobs) {
    merged.pages.insert(merged.pages.end(), job.pages.begin(), job.pages.end());
    merged.deadline = std::min(merged.deadline, job.deadline);
  }
  std::sort(merged.pages.begin(), merged.pages.end());
  return merged;
}

void PagePool::finish_job(const Job& job, const BackendResult& result,
                          const std::vector<int64_t>& still_mapped) {
  FenceReleasingLock lock(*this);
  current_job_.reset();
  const int64_t num_pages = static_cast<int64_t>(job.pages.size());
  if (!result.ok) {
    ++map_errors_;
    last_error_ = result.error;
  } else if (!result.warning.empty()) {
    last_error_ = result.warning;
  }
  if (job.kind == JobKind::kUnmap) {
    // Runs the backend failed to unmap are still mapped: they go back to the reserve. The
    // others are gone, whatever happened to their neighbours.
    std::vector<int64_t> unmapped;
    for (int64_t page : job.pages) {
      if (std::binary_search(still_mapped.begin(), still_mapped.end(), page)) {
        set_state(page, PageState::kFree);
        add_mapped_blocks(page);
      } else {
        set_state(page, PageState::kUnmapped);
        unmapped.push_back(page);
      }
    }
    drop_fences(unmapped);
    job_left_flight(job);
    release_share(static_cast<int64_t>(unmapped.size()));
    unmaps_done_ += static_cast<int64_t>(unmapped.size());
    if (job.request_id != 0 && !finish_trim_unmap(job.request_id, result)) {
      completions_.push({job.request_id,
                         result.ok ? CompletionStatus::kOk : CompletionStatus::kMapError, {},
                         result.error});
    }
  } else if (result.ok) {
    for (int64_t page : job.pages) {
      set_state(page, PageState::kFree);
      add_mapped_blocks(page);
      if (job.kind == JobKind::kMapForRequest) incoming_for_waiters_ -= pages_[page].num_blocks;
    }
    if (job.kind == JobKind::kRefill) refill_pages_ -= num_pages;
    maps_done_ += num_pages;
    job_left_flight(job);
    if (map_seconds_.size() < kMaxMapSamples) {
      map_seconds_.push_back(seconds_since(current_job_start_));
    }
  } else {
    // Pages whose rollback unmap failed too are still mapped: they join the reserve, counted as
    // mapped (a later unmap retries them). Only the others go back to unmapped.
    Job rolled_back = job;
    rolled_back.pages.clear();
    for (int64_t page : job.pages) {
      if (!std::binary_search(still_mapped.begin(), still_mapped.end(), page)) {
        rolled_back.pages.push_back(page);
        continue;
      }
      set_state(page, PageState::kFree);
      add_mapped_blocks(page);
      if (job.kind == JobKind::kMapForRequest) incoming_for_waiters_ -= pages_[page].num_blocks;
      if (job.kind == JobKind::kRefill) --refill_pages_;
    }
    revert_job(rolled_back);
    if (job.kind == JobKind::kMapForRequest) {
      fail_waiter(job.request_id, CompletionStatus::kMapError,
                  "mapping " + std::to_string(num_pages) + " page(s) failed: " + result.error);
    }
  }
  if (closed_) return;
  // Pages landed or left while over the limit: the drain covers what is over now.
  if (policy_.drain_planned() || headroom_pages() < 0) plan_drain();
  serve_waiters();
  // After a failure too: each failed job fails the waiter it was for, so a driver that keeps
  // failing ends every waiter's wait instead of looping.
  plan_maps();
  // Not after a failed unmap: its pages went back to the reserve, and retrying them at once
  // would spin on a driver that keeps refusing. The next free or map retries.
  if (result.ok || job.kind != JobKind::kUnmap) plan_unmaps();
  settle_trims();
}

void PagePool::record_job_time(JobKind kind, double seconds, int64_t pages) {
  if (pages <= 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  double& average = seconds_per_page_[kind == JobKind::kUnmap ? 1 : 0];
  const double sample = seconds / static_cast<double>(pages);
  average = average == 0.0 ? sample : 0.75 * average + 0.25 * sample;
}

std::optional<Completion> PagePool::take_completion(int64_t request_id, double max_spin_s) {
  double expected = 0.0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto cost = [&](const Job& job) {
      return seconds_per_page_[job.kind == JobKind::kUnmap ? 1 : 0] *
             static_cast<double>(job.pages.size());
    };
    for (const auto& [deadline, jobs] : jobs_) {
      for (const Job& job : jobs) expected += cost(job);
    }
    if (current_job_) {
      expected += std::max(0.0, cost(*current_job_) - seconds_since(current_job_start_));
    }
  }
  // Not learnt yet (0), too long to spin for, or one CPU (spinning would only delay the mapper):
  // the caller sleeps until the loop is woken.
  constexpr double kMargin = 20e-6;
  static const bool several_cpus = std::thread::hardware_concurrency() > 1;
  if (expected == 0.0 || expected > max_spin_s || !several_cpus) {
    return completions_.take(request_id, Clock::now());  // only if it is already there
  }
  const double spin = std::min(max_spin_s, 1.5 * expected + kMargin);
  return completions_.take(request_id, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(spin)));
}

// ---------------------------------------------------------------------------------------------

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolStats s{};
  s.num_blocks = config_.num_blocks;
  s.used_blocks = used_blocks_;
  s.free_blocks = free_blocks_;
  s.mapped_pages = count_[(int)PageState::kFree] + count_[(int)PageState::kInUse];
  s.reserve_pages = count_[(int)PageState::kFree];
  s.mapping_pages = count_[(int)PageState::kMapping];
  s.unmapping_pages = count_[(int)PageState::kUnmapping];
  s.unmapped_pages = count_[(int)PageState::kUnmapped];
  s.waiters = static_cast<int64_t>(waiters_.size());
  s.queued_jobs = 0;
  for (const auto& entry : jobs_) s.queued_jobs += static_cast<int64_t>(entry.second.size());
  s.maps_done = maps_done_;
  s.mapper_batches = batches_;
  s.unmaps_done = unmaps_done_;
  s.map_errors = map_errors_;
  s.dropped_jobs = dropped_jobs_;
  s.timeouts = timeouts_;
  s.limit_pages = policy_.limit();
  s.limit_blocks = limit_blocks(policy_.limit());
  s.unusable_blocks = config_.num_blocks - usable_blocks_;
  s.mapper_op_age_s = 0.0;
  if (current_job_) {
    s.mapper_op = std::string(job_name(current_job_->kind)) + " of " +
                  std::to_string(current_job_->pages.size()) + " page(s)";
    s.mapper_op_age_s = seconds_since(current_job_start_);
  }
  s.last_error = last_error_;
  return s;
}

bool PagePool::is_allocated(int64_t block) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return block >= 0 && block < config_.num_blocks && block_used_[block] == 1;
}

}  // namespace kvasync
