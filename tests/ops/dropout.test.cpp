#include "support.hpp"

using namespace remat;

TEST_CASE("dropout: zeroes about p of the elements and scales the rest by 1/(1-p)", "[ops][dropout]") {
  Generator g(11);
  const Tensor y = dropout(ones({10000}), 0.25, true, g);
  std::int64_t zeros = 0;
  for (float v : y.to_vector()) {
    if (v == 0.f) ++zeros;
    else CHECK(v == Approx(1 / 0.75));
  }
  CHECK(zeros == Approx(2500).margin(150));  // ~3.5 sigma of Binomial(10000, 0.25)
  CHECK(g.state().offset == 2500);           // one 128-bit block per four elements
}

TEST_CASE("dropout: identity in evaluation or at p = 0, all zeros at p = 1", "[ops][dropout]") {
  const Tensor x = randn({5});
  CHECK(dropout(x, 0.5, false).same_storage(x));
  CHECK(dropout(x, 0.0, true).same_storage(x));
  CHECK(test::values(dropout(x, 1.0, true)) == std::vector<float>(5, 0.f));
}

TEST_CASE("dropout: the same generator state gives the same mask", "[ops][dropout]") {
  Generator g(5);
  const Generator::State s = g.state();
  const Tensor a = dropout(ones({64}), 0.5, true, g);
  g.set_state(s);
  const Tensor b = dropout(ones({64}), 0.5, true, g);
  CHECK(test::values(a) == test::values(b));
}

TEST_CASE("dropout: backward regenerates the forward mask, matching finite differences", "[ops][dropout]") {
  test::require_gradcheck(
      [](test::Inputs x) {
        Generator g(9);  // each evaluation draws the same mask
        return dropout(x[0], 0.3, true, g);
      },
      {randn<double>({4, 6})});
  Generator g(2);
  Tensor x = ones({32}).requires_grad_();
  const Tensor y = dropout(x, 0.5, true, g);
  sum(y).backward();
  CHECK(test::values(x.grad()) == test::values(y));  // dx = mask / (1-p) = y for x = 1
}

TEST_CASE("dropout: a probability outside the unit interval throws", "[ops][dropout]") {
  REQUIRE_ERROR(dropout(ones({2}), 1.5), "dropout", "1.5");
}
