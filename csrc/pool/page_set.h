// PageSet: a set of page ids in [0, capacity), as a two-level bitmap.
//
// The pool asks "the lowest page with a free block", "the lowest unmapped page" and "the highest
// reserve pages" on every allocation; a balanced tree answers with a pointer chase per step and
// an allocation per insert. Here an insert or erase is two bit operations and a search scans one
// summary word per 4096 pages (a 128 GiB cache of 2 MiB pages is 16 summary words).
#pragma once

#include <cstdint>
#include <vector>

namespace kvasync {

class PageSet {
 public:
  explicit PageSet(int64_t capacity)
      : words_((capacity + 63) / 64, 0), summary_((words_.size() + 63) / 64, 0) {}

  bool empty() const { return size_ == 0; }
  int64_t size() const { return size_; }
  bool contains(int64_t page) const { return (words_[page >> 6] >> (page & 63)) & 1; }

  void insert(int64_t page) {
    uint64_t& word = words_[page >> 6];
    const uint64_t bit = uint64_t{1} << (page & 63);
    if (word & bit) return;
    word |= bit;
    summary_[page >> 12] |= uint64_t{1} << ((page >> 6) & 63);
    ++size_;
  }

  void erase(int64_t page) {
    uint64_t& word = words_[page >> 6];
    const uint64_t bit = uint64_t{1} << (page & 63);
    if (!(word & bit)) return;
    word &= ~bit;
    if (word == 0) summary_[page >> 12] &= ~(uint64_t{1} << ((page >> 6) & 63));
    --size_;
  }

  // The smallest page >= from in the set, or -1.
  int64_t next(int64_t from) const {
    if (from < 0) from = 0;
    int64_t w = from >> 6;
    if (w >= static_cast<int64_t>(words_.size())) return -1;
    const uint64_t here = words_[w] & (~uint64_t{0} << (from & 63));
    if (here) return (w << 6) + __builtin_ctzll(here);
    // Later words: through the summary.
    int64_t s = (w + 1) >> 6;
    uint64_t mask = ((w + 1) & 63) ? (~uint64_t{0} << ((w + 1) & 63)) : ~uint64_t{0};
    for (; s < static_cast<int64_t>(summary_.size()); ++s, mask = ~uint64_t{0}) {
      const uint64_t bits = summary_[s] & mask;
      if (bits) {
        const int64_t word = (s << 6) + __builtin_ctzll(bits);
        return (word << 6) + __builtin_ctzll(words_[word]);
      }
    }
    return -1;
  }

  // The largest page <= from in the set, or -1.
  int64_t prev(int64_t from) const {
    const int64_t max = static_cast<int64_t>(words_.size()) * 64 - 1;
    if (from > max) from = max;
    if (from < 0) return -1;
    int64_t w = from >> 6;
    const int shift = 63 - static_cast<int>(from & 63);
    const uint64_t here = words_[w] & (~uint64_t{0} >> shift);
    if (here) return (w << 6) + 63 - __builtin_clzll(here);
    for (int64_t word = w - 1; word >= 0; --word) {
      if (summary_[word >> 6] == 0) {  // skip a whole summary word at once
        word &= ~int64_t{63};
        continue;
      }
      if (words_[word]) return (word << 6) + 63 - __builtin_clzll(words_[word]);
    }
    return -1;
  }

  int64_t first() const { return next(0); }
  int64_t last() const { return prev(INT64_MAX); }

 private:
  std::vector<uint64_t> words_;
  std::vector<uint64_t> summary_;  // bit w set <=> words_[w] != 0
  int64_t size_ = 0;
};

}  // namespace kvasync
