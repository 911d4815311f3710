#include "support.hpp"

using namespace remat;

TEST_CASE("bias_gelu: equals gelu(x + bias) in both forms", "[ops][bias_gelu]") {
  for (const auto approximate : {GeluApproximation::none, GeluApproximation::tanh}) {
    const DoubleTensor x = randn<double>({3, 5, 7}) * 2.0, b = randn<double>({7});
    const auto fused = test::values(bias_gelu(x, b, approximate));
    const auto reference = test::values(gelu(x + b, approximate));
    REQUIRE(fused.size() == reference.size());
    for (std::size_t i = 0; i < fused.size(); ++i) CHECK(fused[i] == Approx(reference[i]).epsilon(1e-14).margin(1e-15));
  }
}

TEST_CASE("bias_gelu: backward matches finite differences, with and without the bias gradient", "[ops][bias_gelu]") {
  for (const auto approximate : {GeluApproximation::none, GeluApproximation::tanh}) {
    // 130 rows: more than one fixed block of the bias sum, so its partial sums are exercised.
    test::require_gradcheck([=](test::Inputs in) { return bias_gelu(in[0], in[1], approximate); },
                            {randn<double>({130, 3}) * 2.0, randn<double>({3})});
    const DoubleTensor b = randn<double>({4});  // a constant bias: only dx
    test::require_gradcheck([=](test::Inputs in) { return bias_gelu(in[0], b, approximate); },
                            {randn<double>({2, 3, 4}) * 2.0});
  }
}

TEST_CASE("bias_gelu: the gradients equal the unfused ops' to rounding", "[ops][bias_gelu]") {
  Tensor x1 = randn({200, 16}).requires_grad_(), b1 = randn({16}).requires_grad_();
  Tensor x2 = x1.detach().requires_grad_(), b2 = b1.detach().requires_grad_();
  const Tensor w = randn({200, 16});
  sum(bias_gelu(x1, b1) * w).backward();
  sum(gelu(x2 + b2) * w).backward();
  const auto dx1 = test::values(x1.grad()), dx2 = test::values(x2.grad());
  for (std::size_t i = 0; i < dx1.size(); ++i) CHECK(dx1[i] == Approx(dx2[i]).epsilon(1e-5).margin(1e-6));
  const auto db1 = test::values(b1.grad()), db2 = test::values(b2.grad());
  for (std::size_t i = 0; i < db1.size(); ++i) CHECK(db1[i] == Approx(db2[i]).epsilon(1e-4).margin(1e-5));
}

TEST_CASE("bias_gelu: a bias that does not match the last dim throws", "[ops][bias_gelu]") {
  REQUIRE_ERROR(bias_gelu(ones({2, 3}), ones({2})), "bias_gelu", "(2,)", "(2, 3)");
  REQUIRE_ERROR(bias_gelu(ones({2, 3}), ones({1, 3})), "bias_gelu", "(1, 3)");
}
