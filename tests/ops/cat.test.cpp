#include "support.hpp"

using namespace remat;

TEST_CASE("cat, split and chunk: join and cut along a dim", "[ops][cat]") {
  const Tensor a = reshape(arange(4.0f), {2, 2});
  const Tensor b = reshape(arange(4.0f, 6.0f), {2, 1});
  const Tensor c = cat<float>({a, b}, 1);
  CHECK(test::values(c) == std::vector<float>{0, 1, 4, 2, 3, 5});
  const auto pieces = split(c, 2, 1);
  REQUIRE(pieces.size() == 2);
  CHECK(test::values(pieces[0]) == test::values(a));
  CHECK(test::values(pieces[1]) == test::values(b));
  const auto parts = chunk(arange(7.0f), 3, 0);
  REQUIRE(parts.size() == 3);
  CHECK(parts[2].shape() == Shape{1});
}

TEST_CASE("cat, split and chunk: backward matches finite differences", "[ops][cat]") {
  test::require_gradcheck([](test::Inputs x) { return cat<double>({x[0], x[1], x[0]}, 0); },
                          {randn<double>({2, 3}), randn<double>({1, 3})});
  test::require_gradcheck(
      [](test::Inputs x) {
        auto q = chunk(x[0], 3, -1);
        return q[0] * q[1] + q[2];
      },
      {randn<double>({2, 6})});
}

TEST_CASE("cat: mismatched shapes and empty lists throw", "[ops][cat]") {
  REQUIRE_ERROR(cat<float>({zeros({2, 2}), zeros({3, 3})}, 0), "cat", "(3, 3)", "(2, 2)");
  REQUIRE_ERROR(cat<float>({}, 0), "cat", "at least one");
  REQUIRE_ERROR(split(zeros({4}), 0, 0), "split", "positive");
}
