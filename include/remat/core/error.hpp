#pragma once
// remat::Error and the checking macros every op uses on entry.

#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace remat {

/// Thrown for every misuse the library can detect: bad shapes, bad dims, out-of-range indices,
/// backward through a freed graph, tensors modified after they were saved. The message names the
/// op, the arguments and what was expected.
class Error : public std::runtime_error {
 public:
  /// An error with the complete message (what happened, with shapes or numbers).
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace remat

/// Throws remat::Error with a fmt-formatted message when `cond` is false.
#define REMAT_CHECK(cond, ...)                                 \
  do {                                                         \
    if (!(cond)) throw ::remat::Error(::fmt::format(__VA_ARGS__)); \
  } while (false)

/// Internal invariant: a failure is a bug in remat, not in the caller; still an exception, never
/// an abort, so a user's process survives and the message reaches them.
#define REMAT_ASSERT(cond)                                                                  \
  do {                                                                                      \
    if (!(cond))                                                                            \
      throw ::remat::Error(::fmt::format("remat internal error: {} ({}:{})", #cond, __FILE__, \
                                         __LINE__));                                        \
  } while (false)
