#include "support.hpp"

using namespace remat;

TEST_CASE("reshape: a view sharing storage, with one inferred size", "[ops][reshape]") {
  const Tensor a = arange(12.0f);
  const Tensor b = reshape(a, {3, -1});
  CHECK(b.shape() == Shape{3, 4});
  CHECK(b.same_storage(a));
  CHECK(unsqueeze(b, 0).shape() == Shape{1, 3, 4});
  CHECK(unsqueeze(b, -1).shape() == Shape{3, 4, 1});
  CHECK(squeeze(unsqueeze(b, 1), 1).shape() == Shape{3, 4});
  CHECK(flatten(b).shape() == Shape{12});
  CHECK(view(b, {2, 6}).shape() == Shape{2, 6});
}

TEST_CASE("reshape: backward matches finite differences", "[ops][reshape]") {
  test::require_gradcheck([](test::Inputs x) { return reshape(x[0], {4, -1}) * 2.0; }, {randn<double>({2, 3, 2})});
  test::require_gradcheck([](test::Inputs x) { return unsqueeze(x[0], 1); }, {randn<double>({2, 3})});
}

TEST_CASE("reshape: incompatible sizes throw", "[ops][reshape]") {
  REQUIRE_ERROR(reshape(zeros({2, 3}), {4, 2}), "reshape", "(4, 2)", "(2, 3)");
  REQUIRE_ERROR(reshape(zeros({2, 3}), {-1, -1}), "reshape", "only one");
  REQUIRE_ERROR(reshape(zeros({2, 3}), {4, -1}), "reshape", "invalid");
  REQUIRE_ERROR(squeeze(zeros({2, 3}), 0), "squeeze", "not 1");
}
