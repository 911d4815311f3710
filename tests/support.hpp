#pragma once
// Helpers shared by the tests: gradient checks as Catch assertions, error-message matching.

#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <remat/remat.hpp>
#include <remat/testing/compare.hpp>
#include <remat/testing/gradcheck.hpp>

namespace remat::test {

using Inputs = const std::vector<DoubleTensor>&;

/// REQUIREs that f's tape gradients match central differences, printing the first mismatch.
template <class F>
void require_gradcheck(F f, std::vector<DoubleTensor> inputs, testing::GradcheckOptions opt = {}) {
  const testing::GradcheckResult r = testing::gradcheck(f, inputs, opt);
  INFO(r.message);
  INFO("max abs error " << r.max_abs_error);
  REQUIRE(r.ok);
}

/// Elementwise equality of two tensors' values within `tol` (0 means bitwise).
template <class T>
bool all_close(const BasicTensor<T>& a, const BasicTensor<T>& b, double tol = 0) {
  if (a.shape() != b.shape()) return false;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i]);
    if (!(d <= tol && -d <= tol)) return false;
  }
  return true;
}

/// A tape of the test's own, current while it lives: counts of nodes and saved bytes then do not
/// see nodes that earlier tests left on the thread's root tape (those are pruned lazily).
struct FreshTape {
  Tape tape;
  TapeGuard guard{tape};
};

template <class T>
std::vector<T> values(const BasicTensor<T>& t) {
  return t.to_vector();
}

}  // namespace remat::test

/// REQUIRE that `expr` throws remat::Error whose message contains every given fragment.
#define REQUIRE_ERROR(expr, ...)                                                    \
  do {                                                                              \
    bool remat_threw = false;                                                       \
    try {                                                                           \
      (void)(expr);                                                                 \
    } catch (const ::remat::Error& e) {                                             \
      remat_threw = true;                                                           \
      const std::string remat_msg = e.what();                                       \
      INFO("message: " << remat_msg);                                              \
      for (const char* fragment : {__VA_ARGS__})                                    \
        CHECK(remat_msg.find(fragment) != std::string::npos);                       \
    }                                                                               \
    INFO("expected remat::Error from " #expr);                                     \
    REQUIRE(remat_threw);                                                           \
  } while (false)
