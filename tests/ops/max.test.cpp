#include "support.hpp"

using namespace remat;

TEST_CASE("max: values and first-occurrence indices over a dim", "[ops][max]") {
  const Tensor a = tensor({1.f, 9.f, 3.f, 7.f, 5.f, 7.f}, {2, 3});
  auto [v, i] = max(a, 1);
  CHECK(test::values(v) == std::vector<float>{9, 7});
  CHECK(test::values(i) == std::vector<std::int64_t>{1, 0});
  auto [v0, i0] = max(a, 0, true);
  CHECK(v0.shape() == Shape{1, 3});
  CHECK(test::values(v0) == std::vector<float>{7, 9, 7});
  CHECK(test::values(i0) == std::vector<std::int64_t>{1, 0, 1});
}

TEST_CASE("max: backward matches finite differences and routes to the argmax", "[ops][max]") {
  test::require_gradcheck([](test::Inputs x) { return max(x[0], 1).values; }, {randn<double>({2, 3, 4})});
  test::require_gradcheck([](test::Inputs x) { return max(x[0], -1, true).values; }, {randn<double>({3, 5})});
  Tensor x = tensor({1.f, 4.f, 2.f}).requires_grad_();
  sum(max(x, 0).values).backward();
  CHECK(test::values(x.grad()) == std::vector<float>{0, 1, 0});
}

TEST_CASE("max: an empty dim and a bad dim throw", "[ops][max]") {
  REQUIRE_ERROR(max(zeros({2, 0}), 1), "max", "empty");
  REQUIRE_ERROR(max(zeros({2}), 3), "max", "dim 3");
}
