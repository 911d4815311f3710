#include "support.hpp"

using namespace remat;

TEST_CASE("embedding: picks rows of the table by id", "[ops][embedding]") {
  const Tensor table = reshape(arange(6.0f), {3, 2});
  const LongTensor ids = tensor<std::int64_t>({2, 0, 2, 1}, {2, 2});
  const Tensor y = embedding(ids, table);
  CHECK(y.shape() == Shape{2, 2, 2});
  CHECK(test::values(y) == std::vector<float>{4, 5, 0, 1, 4, 5, 2, 3});
}

TEST_CASE("embedding: backward scatter-adds, matching finite differences", "[ops][embedding]") {
  const LongTensor ids = tensor<std::int64_t>({1, 3, 1, 0, 1, 2}, {2, 3});
  test::require_gradcheck([&](test::Inputs x) { return embedding(ids, x[0]); }, {randn<double>({4, 3})});
  Tensor table = zeros({3, 2}).requires_grad_();
  sum(embedding(tensor<std::int64_t>({1, 1}), table)).backward();
  CHECK(test::values(table.grad()) == std::vector<float>{0, 0, 2, 2, 0, 0});
}

TEST_CASE("embedding: an id outside the table throws, naming it", "[ops][embedding]") {
  REQUIRE_ERROR(embedding(tensor<std::int64_t>({0, 3}), zeros({3, 2})), "embedding", "index 3", "3 rows");
  REQUIRE_ERROR(embedding(tensor<std::int64_t>({-1}), zeros({3, 2})), "embedding", "index -1");
  REQUIRE_ERROR(embedding(tensor<std::int64_t>({0}), zeros({3})), "embedding", "2-D", "(3,)");
}
