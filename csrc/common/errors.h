// C++ exceptions that cross into Python as kvasync's own errors (translators in bindings.cpp).
// A caller's mistake is std::invalid_argument (ValueError); these are the domain errors.
#pragma once

#include <stdexcept>

namespace kvasync {

struct OutOfBlocksError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct AllocatorClosedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct BackendError : std::runtime_error {  // the driver is missing or failed outside a map
  using std::runtime_error::runtime_error;
};

}  // namespace kvasync
