#include <cmath>

#include "support.hpp"

using namespace remat;

TEST_CASE("gelu: exact and tanh forms match their formulas", "[ops][gelu]") {
  const std::vector<double> xs{-3, -1, -0.1, 0, 0.5, 2};
  const DoubleTensor exact = gelu(tensor(xs));
  const DoubleTensor approx = gelu(tensor(xs), "tanh");
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    CHECK(exact.data()[i] == Approx(0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))).epsilon(1e-12));
    const double u = std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v);
    CHECK(approx.data()[i] == Approx(0.5 * v * (1 + std::tanh(u))).epsilon(1e-12));
  }
}

TEST_CASE("gelu: backward matches finite differences in both forms", "[ops][gelu]") {
  test::require_gradcheck([](test::Inputs x) { return gelu(x[0]); }, {randn<double>({4, 5}) * 2.0});
  test::require_gradcheck([](test::Inputs x) { return gelu(x[0], GeluApproximation::tanh); }, {randn<double>({4, 5}) * 2.0});
}

TEST_CASE("gelu: an unknown approximation name throws", "[ops][gelu]") {
  REQUIRE_ERROR(gelu(ones({2}), "fast"), "gelu", "\"fast\"");
}
