#include "support.hpp"

using namespace remat;

TEST_CASE("permute and transpose: reorder dims into a contiguous copy", "[ops][permute]") {
  const Tensor a = arange(6.0f);
  const Tensor m = reshape(a, {2, 3});
  const Tensor t = transpose(m, 0, 1);
  CHECK(t.shape() == Shape{3, 2});
  CHECK(test::values(t) == std::vector<float>{0, 3, 1, 4, 2, 5});
  const Tensor p = permute(reshape(arange(24.0f), {2, 3, 4}), {2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p.at({3, 1, 2}) == 1 * 12 + 2 * 4 + 3);
}

TEST_CASE("permute and transpose: backward matches finite differences", "[ops][permute]") {
  test::require_gradcheck([](test::Inputs x) { return permute(x[0], {1, 2, 0}); }, {randn<double>({2, 3, 4})});
  test::require_gradcheck([](test::Inputs x) { return transpose(x[0], -1, -2); }, {randn<double>({2, 2, 3, 4})});
}

TEST_CASE("permute: a wrong order throws", "[ops][permute]") {
  REQUIRE_ERROR(permute(zeros({2, 3}), {0, 0}), "permute", "twice");
  REQUIRE_ERROR(permute(zeros({2, 3}), {0}), "permute", "1 dims", "(2, 3)");
  REQUIRE_ERROR(transpose(zeros({2, 3}), 0, 2), "transpose", "dim 2");
}
