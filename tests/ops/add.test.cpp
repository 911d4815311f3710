#include "support.hpp"

using namespace remat;

TEST_CASE("add: values with numpy broadcasting and scalars", "[ops][add]") {
  const Tensor a = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  CHECK(test::values(a + tensor({10.f, 20.f, 30.f})) == std::vector<float>{11, 22, 33, 14, 25, 36});
  CHECK(test::values(a + tensor({100.f, 200.f}, {2, 1})) == std::vector<float>{101, 102, 103, 204, 205, 206});
  CHECK(test::values(tensor({1.f, 2.f}, {2, 1}) + tensor({10.f, 20.f, 30.f}, {1, 3})) ==
        std::vector<float>{11, 21, 31, 12, 22, 32});
  CHECK(test::values(a + 1) == std::vector<float>{2, 3, 4, 5, 6, 7});
  CHECK(test::values(1.5f + tensor({1.f})) == std::vector<float>{2.5f});
}

TEST_CASE("add: backward matches finite differences, broadcast operands included", "[ops][add]") {
  test::require_gradcheck([](test::Inputs x) { return x[0] + x[1]; }, {randn<double>({2, 3}), randn<double>({2, 3})});
  test::require_gradcheck([](test::Inputs x) { return x[0] + x[1]; }, {randn<double>({4, 2, 3}), randn<double>({3})});
  test::require_gradcheck([](test::Inputs x) { return x[0] + x[1]; }, {randn<double>({2, 1, 3}), randn<double>({4, 1})});
  test::require_gradcheck([](test::Inputs x) { return x[0] + 2.0; }, {randn<double>({3})});
}

TEST_CASE("add: shapes that do not broadcast throw, naming both", "[ops][add]") {
  REQUIRE_ERROR(zeros({2, 3}) + zeros({2}), "add", "(2, 3)", "(2,)", "broadcast");
}
