// What the stress harnesses (pool_stress.cpp, group_stress.cpp) check with: a broken invariant
// ends the run at once with the harness's name and the check, so a sanitizer run fails loudly.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)

#include <chrono>
#include <cstdint>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "pool/page_pool.h"

namespace stress {

using Seconds = std::chrono::duration<double>;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "%s: FAILED: %s\n", program_invocation_short_name, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

// A harness's backend over another: the geometry is the inner one's; the harness overrides map
// and unmap (and its name) to watch or fault them.
template <class Inner>
class WrappingBackend : public kvasync::Backend {
 public:
  explicit WrappingBackend(std::shared_ptr<Inner> inner) : inner_(std::move(inner)) {}
  int64_t page_size() const override { return inner_->page_size(); }
  int num_ranges() const override { return inner_->num_ranges(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  uintptr_t range_base(int range) const override { return inner_->range_base(range); }
  const char* out_of_memory_name() const override { return inner_->out_of_memory_name(); }

 protected:
  std::shared_ptr<Inner> inner_;
};

// A harness's command line: --seconds S (how long to run) and --seed N (repeats each thread's
// choices); `seconds` and `seed` keep their defaults where not given.
inline void parse_args(int argc, char** argv, double& seconds, uint64_t& seed) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--seconds") == 0) seconds = std::atof(argv[i + 1]);
    if (std::strcmp(argv[i], "--seed") == 0) seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
}

// The pool's clock in seconds, as its deadlines take them.
inline double monotonic_s() { return Seconds(kvasync::Clock::now().time_since_epoch()).count(); }

}  // namespace stress

#define CHECK(cond, what)                                                       \
  do {                                                                          \
    if (!(cond)) stress::fail(std::string(#cond) + " -- " + std::string(what)); \
  } while (0)
