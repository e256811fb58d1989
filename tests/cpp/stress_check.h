// What the stress harnesses (pool_stress.cpp, group_stress.cpp) check with: a broken invariant
// ends the run at once with the harness's name and the check, so a sanitizer run fails loudly.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "pool/page_pool.h"

namespace stress {

using Seconds = std::chrono::duration<double>;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "%s: FAILED: %s\n", program_invocation_short_name, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

// The pool's clock in seconds, as its deadlines take them.
inline double monotonic_s() { return Seconds(kvasync::Clock::now().time_since_epoch()).count(); }

}  // namespace stress

#define CHECK(cond, what)                                                       \
  do {                                                                          \
    if (!(cond)) stress::fail(std::string(#cond) + " -- " + std::string(what)); \
  } while (0)
