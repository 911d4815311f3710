#include "support.hpp"

using namespace remat;

TEST_CASE("dropout_add: bitwise residual + dropout(h), same draw, same generator state after", "[ops][dropout_add]") {
  for (const double p : {0.1, 0.5, 1.0}) {
    Generator g1(3), g2(3);
    const Tensor h = randn({5, 37}), r = randn({5, 37});  // 185 elements: ragged last run and block
    const Tensor fused = dropout_add(h, r, p, true, g1);
    const Tensor reference = r + dropout(h, p, true, g2);
    CHECK(test::values(fused) == test::values(reference));
    CHECK(g1.state() == g2.state());
  }
}

TEST_CASE("dropout_add: evaluation and p = 0 are the plain sum", "[ops][dropout_add]") {
  Generator g(1);
  const Tensor h = randn({4, 3}), r = randn({4, 3});
  CHECK(test::values(dropout_add(h, r, 0.5, false, g)) == test::values(r + h));
  CHECK(test::values(dropout_add(h, r, 0.0, true, g)) == test::values(r + h));
  CHECK(g.state().offset == 0);  // nothing drawn
}

TEST_CASE("dropout_add: backward matches finite differences and the unfused ops bitwise", "[ops][dropout_add]") {
  test::require_gradcheck(
      [](test::Inputs x) {
        Generator g(9);  // each evaluation draws the same mask
        return dropout_add(x[0], x[1], 0.3, true, g);
      },
      {randn<double>({4, 6}), randn<double>({4, 6})});
  Tensor h1 = randn({3, 70}).requires_grad_(), r1 = randn({3, 70}).requires_grad_();
  Tensor h2 = h1.detach().requires_grad_(), r2 = r1.detach().requires_grad_();
  const Tensor w = randn({3, 70});
  Generator g1(4), g2(4);
  sum(dropout_add(h1, r1, 0.25, true, g1) * w).backward();
  sum((r2 + dropout(h2, 0.25, true, g2)) * w).backward();
  CHECK(test::values(h1.grad()) == test::values(h2.grad()));
  CHECK(test::values(r1.grad()) == test::values(r2.grad()));
}

TEST_CASE("dropout_add: mismatched shapes and a bad probability throw", "[ops][dropout_add]") {
  REQUIRE_ERROR(dropout_add(ones({2, 3}), ones({3}), 0.1), "dropout_add", "(2, 3)", "(3,)");
  REQUIRE_ERROR(dropout_add(ones({2}), ones({2}), -0.5), "dropout_add", "-0.5");
}
