#include "support.hpp"

using namespace remat;

TEST_CASE("div: values with broadcasting and both scalar sides", "[ops][div]") {
  const Tensor a = tensor({2.f, 4.f, 6.f, 8.f}, {2, 2});
  CHECK(test::values(a / tensor({2.f, 4.f})) == std::vector<float>{1, 1, 3, 2});
  CHECK(test::values(a / 2) == std::vector<float>{1, 2, 3, 4});
  CHECK(test::values(8 / a) == std::vector<float>{4, 2, 8.f / 6.f, 1});
}

TEST_CASE("div: backward matches finite differences", "[ops][div]") {
  auto away_from_zero = [](Shape s) { return rand<double>(s) + 0.5; };
  test::require_gradcheck([](test::Inputs x) { return x[0] / x[1]; }, {randn<double>({2, 3}), away_from_zero({2, 3}).detach()});
  test::require_gradcheck([](test::Inputs x) { return x[0] / x[1]; }, {randn<double>({2, 3}), away_from_zero({3}).detach()});
  test::require_gradcheck([](test::Inputs x) { return x[0] / 4.0; }, {randn<double>({3})});
  test::require_gradcheck([](test::Inputs x) { return 2.0 / x[0]; }, {away_from_zero({3}).detach()});
}

TEST_CASE("div: shapes that do not broadcast throw", "[ops][div]") {
  REQUIRE_ERROR(ones({2}) / ones({3}), "div", "(2,)", "(3,)");
}
