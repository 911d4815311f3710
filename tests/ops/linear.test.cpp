#include "support.hpp"

using namespace remat;

TEST_CASE("linear: equals x Wᵀ + b", "[ops][linear]") {
  Generator g(4);
  const DoubleTensor x = randn<double>({2, 3, 4}, g), w = randn<double>({5, 4}, g), b = randn<double>({5}, g);
  CHECK(test::all_close(linear(x, w, b), matmul(x, transpose(w, 0, 1)) + b, 1e-12));
  CHECK(test::all_close(linear(x, w), matmul(x, transpose(w, 0, 1)), 1e-12));
}

TEST_CASE("linear: backward matches finite differences, with and without bias", "[ops][linear]") {
  test::require_gradcheck([](test::Inputs x) { return linear(x[0], x[1], x[2]); },
                          {randn<double>({2, 3, 4}), randn<double>({5, 4}), randn<double>({5})});
  test::require_gradcheck([](test::Inputs x) { return linear(x[0], x[1]); }, {randn<double>({3, 4}), randn<double>({2, 4})});
}

TEST_CASE("linear: mismatched features and bad bias throw", "[ops][linear]") {
  REQUIRE_ERROR(linear(zeros({2, 3}), zeros({5, 4})), "linear", "(2, 3)", "(5, 4)");
  REQUIRE_ERROR(linear(zeros({2, 4}), zeros({5, 4}), zeros({4})), "linear", "bias", "(4,)", "(5,)");
  REQUIRE_ERROR(linear(zeros({2, 4}), zeros({4})), "linear", "2-D");
}
