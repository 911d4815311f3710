#include "support.hpp"

using namespace remat;

TEST_CASE("narrow and slice: copy a range along a dim", "[ops][narrow]") {
  const Tensor a = reshape(arange(12.0f), {3, 4});
  CHECK(test::values(narrow(a, 1, 1, 2)) == std::vector<float>{1, 2, 5, 6, 9, 10});
  CHECK(test::values(narrow(a, 0, -1, 1)) == std::vector<float>{8, 9, 10, 11});
  CHECK(test::values(slice(a, 1, -2, 100)) == std::vector<float>{2, 3, 6, 7, 10, 11});
  CHECK(slice(a, 0, 2, 1).shape() == Shape{0, 4});
}

TEST_CASE("narrow: backward matches finite differences", "[ops][narrow]") {
  test::require_gradcheck([](test::Inputs x) { return narrow(x[0], 1, 1, 2); }, {randn<double>({2, 4, 3})});
  test::require_gradcheck([](test::Inputs x) { return slice(x[0], -1, 0, 2); }, {randn<double>({2, 3})});
}

TEST_CASE("narrow: a range outside the dim throws", "[ops][narrow]") {
  REQUIRE_ERROR(narrow(zeros({2, 3}), 1, 2, 2), "narrow", "[2, 4)", "(2, 3)");
}
