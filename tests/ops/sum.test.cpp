#include "support.hpp"

using namespace remat;

TEST_CASE("sum: over all elements and over a dim, with keepdim", "[ops][sum]") {
  const Tensor a = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  CHECK(sum(a).item() == 21.f);
  CHECK(sum(a).dim() == 0);
  CHECK(test::values(sum(a, 0)) == std::vector<float>{5, 7, 9});
  CHECK(test::values(sum(a, -1)) == std::vector<float>{6, 15});
  CHECK(sum(a, 1, true).shape() == Shape{2, 1});
  CHECK(sum(a, 0).shape() == Shape{3});
}

TEST_CASE("sum: backward matches finite differences", "[ops][sum]") {
  test::require_gradcheck([](test::Inputs x) { return sum(x[0]); }, {randn<double>({2, 3})});
  test::require_gradcheck([](test::Inputs x) { return sum(x[0], 1); }, {randn<double>({2, 3, 4})});
  test::require_gradcheck([](test::Inputs x) { return sum(x[0], 0, true); }, {randn<double>({2, 3, 4})});
  test::require_gradcheck([](test::Inputs x) { return sum(x[0], -1); }, {randn<double>({2, 3, 4})});
}

TEST_CASE("sum: a dim out of range throws", "[ops][sum]") {
  REQUIRE_ERROR(sum(zeros({2, 3}), 2), "sum", "dim 2", "(2, 3)");
}
