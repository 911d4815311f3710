#include <cmath>
#include <limits>

#include "support.hpp"

using namespace remat;

TEST_CASE("cross_entropy: mean negative log-likelihood, ignoring ignore_index rows", "[ops][cross_entropy]") {
  const DoubleTensor logits = tensor<double>({0, 0, 0, 1, 2, 3, 5, 5, 5}, {3, 3});
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double row0 = std::log(3.0), row1 = lse - 3.0;
  CHECK(cross_entropy(logits, tensor<std::int64_t>({0, 2, -100})).item() == Approx((row0 + row1) / 2));
  CHECK(cross_entropy(logits, tensor<std::int64_t>({0, 2, 1}), 1).item() == Approx((row0 + row1) / 2));
  CHECK(std::isnan(cross_entropy(logits, tensor<std::int64_t>({-100, -100, -100})).item()));
  // (B, T, C) logits with (B, T) targets.
  const DoubleTensor l3 = reshape(logits, {1, 3, 3});
  CHECK(cross_entropy(l3, tensor<std::int64_t>({0, 2, 0}, {1, 3})).item() == Approx((row0 + row1 + std::log(3.0)) / 3));
  // Far-apart logits stay finite where a naive softmax would underflow.
  const DoubleTensor extreme = tensor<double>({0, -1000}, {1, 2});
  CHECK(cross_entropy(extreme, tensor<std::int64_t>({1})).item() == Approx(1000));
}

TEST_CASE("cross_entropy: backward matches finite differences", "[ops][cross_entropy]") {
  const LongTensor targets = tensor<std::int64_t>({3, -100, 0, 4, 1, 1}, {2, 3});
  test::require_gradcheck([&](test::Inputs x) { return cross_entropy(x[0], targets); }, {randn<double>({2, 3, 5})});
}

TEST_CASE("cross_entropy: a masked (-inf) logit takes exactly no probability and no gradient", "[ops][cross_entropy]") {
  std::vector<float> row(40, -std::numeric_limits<float>::infinity());  // 40 classes, 2 allowed
  row[3] = 0.5f;
  row[17] = -0.25f;
  Tensor logits = tensor(row, {1, 40}).requires_grad_();
  cross_entropy(logits, tensor<std::int64_t>({3})).backward();
  for (std::int64_t j = 0; j < 40; ++j)
    if (j != 3 && j != 17) CHECK(logits.grad().at({0, j}) == 0.0f);
  CHECK(logits.grad().at({0, 17}) > 0.0f);
}

TEST_CASE("cross_entropy: targets out of range and mismatched shapes throw", "[ops][cross_entropy]") {
  REQUIRE_ERROR(cross_entropy(zeros({2, 3}), tensor<std::int64_t>({0, 3})), "cross_entropy", "target 3", "3 classes");
  REQUIRE_ERROR(cross_entropy(zeros({2, 3}), tensor<std::int64_t>({0, 1, 2})), "cross_entropy", "(3,)", "(2, 3)");
}
