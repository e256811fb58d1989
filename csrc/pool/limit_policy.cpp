#include "pool/limit_policy.h"

#include <algorithm>

namespace kvasync {

// Note [Limit policy]: the effective limit is the own limit, held to the share cap.
bool LimitPolicy::update() {
  const int64_t limit = std::min(own_limit(), share_cap_);
  const bool changed = limit != limit_;
  limit_ = limit;
  return changed;
}

bool LimitPolicy::set_configured(int64_t pages) {
  configured_ = pages;
  return update();
}

bool LimitPolicy::set_operator(int64_t pages) {
  operator_ = pages;
  return update();
}

bool LimitPolicy::set_share(bool pressure, int64_t fair_pages, int64_t guaranteed_pages,
                            int64_t equal_share_pages, Clock::time_point now) {
  pressure_ = pressure;
  const int64_t target = pressure && fair_pages >= 0 ? std::max<int64_t>(1, fair_pages) : kNoCap;
  if (target < share_cap_) {
    share_cap_ = target;  // a step-down serves a waiter: at once
    stepped_down_at_ = now;
  } else if (target > share_cap_ && now - stepped_down_at_ >= kRegrowHold) {
    share_cap_ = target;
  }
  // Held down, the cap never stays below the guaranteed minimum (Note [Fair share under
  // pressure] in ledger.h). The minimum in force is the highest of the last kRegrowHold: it rises
  // at once and falls as its peak ages past the hold (an engine's demand flaps from loop to loop,
  // a waiting request coming and going; following each flap, the cap would fall and rise with
  // it, the hold notwithstanding). The highest of the hold, not the one seen at the tick its
  // peak lapses at: falling to that (1) let a flap back up (2) lift the cap again within the
  // hold of a step-down, though the minimum had been 3 within it (two turns in 210 ms).
  const int64_t guaranteed = std::max<int64_t>(1, guaranteed_pages);
  while (!minima_.empty() && minima_.back().second <= guaranteed) minima_.pop_back();
  minima_.emplace_back(now, guaranteed);
  while (now - minima_.front().first >= kRegrowHold) minima_.pop_front();  // never the newest
  // But never above budget / members: a member joining is no flap of this one's demand, and
  // the newcomer's minimum comes out of what this one held (a held minimum of the whole budget
  // kept it waiting for the hold). The minima over it are held at it, for as long as the newest
  // of them would have been.
  if (equal_share_pages > 0) {
    const int64_t equal = std::max<int64_t>(1, equal_share_pages);
    size_t over = 0;  // minima_ decreases from the front: those over `equal` lead it
    while (over < minima_.size() && minima_[over].second > equal) ++over;
    if (over > 0) {
      minima_.erase(minima_.begin(), minima_.begin() + static_cast<std::ptrdiff_t>(over - 1));
      minima_.front().second = equal;
      if (minima_.size() > 1 && minima_[1].second == equal) minima_.pop_front();
    }
  }
  floor_ = minima_.front().second;
  if (share_cap_ != kNoCap) share_cap_ = std::max(share_cap_, floor_);
  return update();
}

void LimitPolicy::nowait_missed(int64_t blocks, Clock::time_point now) {
  hold_blocks_ = blocks;
  hold_until_ = now + kNowaitHold;
}

void LimitPolicy::nowait_served(int64_t blocks) {
  hold_blocks_ = std::max<int64_t>(0, hold_blocks_ - blocks);  // claimed
}

bool LimitPolicy::hold_lapsed(Clock::time_point now) {
  if (hold_blocks_ == 0 || now < hold_until_) return false;
  hold_blocks_ = 0;  // what nobody claimed is trimmed as usual
  return true;
}

void LimitPolicy::observe_in_use(Clock::time_point now, int64_t in_use) {
  if (linger_ == Clock::duration::zero()) return;
  if (linger_restart_) {
    linger_restart_ = false;
    linger_until_ = now + linger_;
  } else if (now >= linger_until_) {
    linger_peak_ = in_use;  // lapsed: the peak starts again from what is in use now
  }
  linger_armed_ = now < linger_until_ && linger_peak_ > in_use;
}

bool LimitPolicy::linger_lapsed(Clock::time_point now) {
  if (!linger_armed_ || now < linger_until_) return false;
  linger_armed_ = false;
  return true;
}

int64_t LimitPolicy::reserve_to_keep(Clock::time_point now, int64_t min_page_blocks,
                                     int64_t in_use) const {
  if (pressure_) return 0;  // the reserve goes back to the member short of budget
  const int64_t held =
      now < hold_until_ ? (hold_blocks_ + min_page_blocks - 1) / min_page_blocks : 0;
  const int64_t lingering =
      now < linger_until_ ? std::max<int64_t>(0, linger_peak_ - in_use) : 0;
  return std::max({reserve_high_, held, lingering});
}

int64_t LimitPolicy::refill_wanted(int64_t have, int64_t headroom) const {
  if (refill_paused_ || reserve_high_ == 0 || have >= reserve_low_) return 0;
  return std::min(reserve_high_ - have, headroom);
}

}  // namespace kvasync
