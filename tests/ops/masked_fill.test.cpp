#include <limits>

#include "support.hpp"

using namespace remat;

TEST_CASE("masked_fill: fills where the mask is true, broadcasting the mask", "[ops][masked_fill]") {
  const Tensor x = ones({2, 3, 3});
  const Tensor y = masked_fill(x, causal_mask(3), -std::numeric_limits<float>::infinity());
  CHECK(y.at({1, 0, 0}) == 1.f);
  CHECK(y.at({1, 0, 1}) == -std::numeric_limits<float>::infinity());
  CHECK(y.at({1, 2, 1}) == 1.f);
  CHECK(test::values(causal_mask(2)) == std::vector<bool>{false, true, false, false});
}

TEST_CASE("masked_fill: backward zeroes the filled positions, matching finite differences", "[ops][masked_fill]") {
  test::require_gradcheck([](test::Inputs x) { return masked_fill(x[0], causal_mask(4), 0.5); }, {randn<double>({2, 4, 4})});
}

TEST_CASE("masked_fill: a mask that does not broadcast to the input throws", "[ops][masked_fill]") {
  REQUIRE_ERROR(masked_fill(zeros({2, 3}), causal_mask(2), 0), "masked_fill", "(2, 2)", "(2, 3)");
  REQUIRE_ERROR(masked_fill(zeros({3}), causal_mask(3), 0), "masked_fill", "(3, 3)", "(3,)");
}
