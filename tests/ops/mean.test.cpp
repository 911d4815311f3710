#include "support.hpp"

using namespace remat;

TEST_CASE("mean: over all elements and over a dim, with keepdim", "[ops][mean]") {
  const Tensor a = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  CHECK(mean(a).item() == 3.5f);
  CHECK(test::values(mean(a, 0)) == std::vector<float>{2.5f, 3.5f, 4.5f});
  CHECK(test::values(mean(a, 1, true)) == std::vector<float>{2, 5});
  CHECK(mean(a, 1, true).shape() == Shape{2, 1});
}

TEST_CASE("mean: backward matches finite differences", "[ops][mean]") {
  test::require_gradcheck([](test::Inputs x) { return mean(x[0]); }, {randn<double>({2, 3})});
  test::require_gradcheck([](test::Inputs x) { return mean(x[0], 1); }, {randn<double>({2, 3, 4})});
  test::require_gradcheck([](test::Inputs x) { return mean(x[0], -1, true); }, {randn<double>({2, 3, 4})});
}

TEST_CASE("mean: empty input and bad dims throw", "[ops][mean]") {
  REQUIRE_ERROR(mean(zeros({0})), "mean", "no elements");
  REQUIRE_ERROR(mean(zeros({2}), 1), "mean", "dim 1");
}
