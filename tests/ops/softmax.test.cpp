#include <cmath>

#include "support.hpp"

using namespace remat;

TEST_CASE("softmax and log_softmax: rows sum to one and stay finite for large inputs", "[ops][softmax]") {
  const DoubleTensor x = tensor<double>({1, 2, 3, 1000, 1000, -1000}, {2, 3});
  const DoubleTensor p = softmax(x);
  const double e = std::exp(1.0);
  CHECK(p.at({0, 0}) == Approx(1 / (1 + e + e * e)));
  CHECK(p.at({1, 0}) == Approx(0.5));
  CHECK(p.at({1, 2}) == 0.0);
  const DoubleTensor lp = log_softmax(x);
  CHECK(lp.at({1, 0}) == Approx(std::log(0.5)));
  CHECK(lp.at({1, 2}) == Approx(-2000 - std::log(2.0)));
  for (std::int64_t i = 0; i < 6; ++i) CHECK(std::isfinite(lp.data()[i]));
}

TEST_CASE("softmax: masked (-inf) and underflowing entries are exactly 0, and take no gradient", "[ops][softmax]") {
  // 40 columns: whole vector registers on any instruction set, where exp is vectorised.
  std::vector<float> row(40, -std::numeric_limits<float>::infinity());
  row[0] = 1.0f;
  row[7] = 0.5f;
  row[9] = -200.0f;  // e^-201 underflows float
  Tensor x = tensor(row, {1, 40}).requires_grad_();
  const Tensor p = softmax(x);
  for (std::int64_t j = 0; j < 40; ++j)
    if (j != 0 && j != 7) CHECK(p.at({0, j}) == 0.0f);
  CHECK(p.at({0, 0}) + p.at({0, 7}) == Approx(1.0f));
  sum(p * randn({1, 40})).backward();
  for (std::int64_t j = 0; j < 40; ++j)
    if (j != 0 && j != 7) CHECK(x.grad().at({0, j}) == 0.0f);
}

TEST_CASE("softmax and log_softmax: backward matches finite differences", "[ops][softmax]") {
  test::require_gradcheck([](test::Inputs x) { return softmax(x[0]); }, {randn<double>({2, 3, 5})});
  test::require_gradcheck([](test::Inputs x) { return log_softmax(x[0], -1); }, {randn<double>({4, 5})});
}

TEST_CASE("softmax: only the last dim is supported, and says so", "[ops][softmax]") {
  REQUIRE_ERROR(softmax(zeros({2, 3}), 0), "softmax", "last dim", "(2, 3)");
  REQUIRE_ERROR(log_softmax(zeros({2, 3}), 5), "log_softmax", "dim 5");
}
