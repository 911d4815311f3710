#include <cmath>

#include "support.hpp"

using namespace remat;

TEST_CASE("layer_norm: normalises each row, then scales and shifts", "[ops][layer_norm]") {
  const DoubleTensor x = tensor<double>({1, 2, 3, 4, -1, 0, 1, 6}, {2, 4});
  const DoubleTensor y = layer_norm(x, DoubleTensor(), DoubleTensor(), 0.0);
  const double sd = std::sqrt(1.25);  // row 0: mean 2.5, biased variance 1.25
  CHECK(y.at({0, 0}) == Approx(-1.5 / sd));
  CHECK(y.at({0, 3}) == Approx(1.5 / sd));
  const DoubleTensor w = tensor<double>({1, 2, 3, 4}), b = tensor<double>({0, 0, 0, 1});
  const DoubleTensor z = layer_norm(x, w, b, 0.0);
  CHECK(z.at({0, 3}) == Approx(4 * 1.5 / sd + 1));
}

TEST_CASE("layer_norm: backward matches finite differences for x, weight and bias", "[ops][layer_norm]") {
  test::require_gradcheck([](test::Inputs x) { return layer_norm(x[0], x[1], x[2]); },
                          {randn<double>({2, 3, 6}), randn<double>({6}), randn<double>({6})});
  test::require_gradcheck([](test::Inputs x) { return layer_norm(x[0], DoubleTensor(), DoubleTensor()); },
                          {randn<double>({3, 5})});
}

TEST_CASE("layer_norm: weight or bias of the wrong shape throws", "[ops][layer_norm]") {
  REQUIRE_ERROR(layer_norm(zeros({2, 4}), ones({3}), zeros({4})), "layer_norm", "weight", "(3,)", "(4,)");
  REQUIRE_ERROR(layer_norm(zeros({2, 4}), ones({4}), zeros({2})), "layer_norm", "bias", "(2,)");
}
