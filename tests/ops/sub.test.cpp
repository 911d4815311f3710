#include "support.hpp"

using namespace remat;

TEST_CASE("sub: values, broadcasting and both scalar sides", "[ops][sub]") {
  const Tensor a = tensor({5.f, 7.f}, {2});
  CHECK(test::values(a - tensor({1.f, 2.f})) == std::vector<float>{4, 5});
  CHECK(test::values(a - 1) == std::vector<float>{4, 6});
  CHECK(test::values(10 - a) == std::vector<float>{5, 3});
  CHECK(test::values(-a) == std::vector<float>{-5, -7});
}

TEST_CASE("sub: backward matches finite differences", "[ops][sub]") {
  test::require_gradcheck([](test::Inputs x) { return x[0] - x[1]; }, {randn<double>({2, 3}), randn<double>({2, 1})});
  test::require_gradcheck([](test::Inputs x) { return 3.0 - x[0]; }, {randn<double>({4})});
  test::require_gradcheck([](test::Inputs x) { return x[0] - 3.0; }, {randn<double>({4})});
  test::require_gradcheck([](test::Inputs x) { return -x[0]; }, {randn<double>({4})});
}

TEST_CASE("sub: shapes that do not broadcast throw", "[ops][sub]") {
  REQUIRE_ERROR(zeros({3}) - zeros({4}), "sub", "(3,)", "(4,)");
}
