#include "support.hpp"

using namespace remat;

TEST_CASE("mul: values with broadcasting and scalars", "[ops][mul]") {
  const Tensor a = tensor({1.f, 2.f, 3.f, 4.f}, {2, 2});
  CHECK(test::values(a * tensor({10.f, 100.f})) == std::vector<float>{10, 200, 30, 400});
  CHECK(test::values(a * 2) == std::vector<float>{2, 4, 6, 8});
  CHECK(test::values(0.5f * a) == std::vector<float>{0.5f, 1, 1.5f, 2});
}

TEST_CASE("mul: backward matches finite differences", "[ops][mul]") {
  test::require_gradcheck([](test::Inputs x) { return x[0] * x[1]; }, {randn<double>({2, 3}), randn<double>({2, 3})});
  test::require_gradcheck([](test::Inputs x) { return x[0] * x[1]; }, {randn<double>({2, 2, 3}), randn<double>({2, 1, 1})});
  test::require_gradcheck([](test::Inputs x) { return x[0] * x[0]; }, {randn<double>({3})});
  test::require_gradcheck([](test::Inputs x) { return x[0] * -1.5; }, {randn<double>({3})});
}

TEST_CASE("mul: shapes that do not broadcast throw", "[ops][mul]") {
  REQUIRE_ERROR(zeros({2, 3}) * zeros({3, 2}), "mul", "(2, 3)", "(3, 2)");
}
