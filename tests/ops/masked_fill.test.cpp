#include <limits>

#include "support.hpp"

using namespace remat;

TEST_CASE("masked_fill: fills where the mask is true, broadcasting the mask", "[ops][masked_fill]") {
  const Tensor x = ones({2, 3, 3});
  const Tensor y = masked_fill(x, causal_mask(3), -std::numeric_limits<float>::infinity());
  CHECK(y.at({1, 0, 0}) == 1.f);
  CHECK(y.at({1, 0, 1}) == -std::numeric_limits<float>::infinity());
  CHECK(y.at({1, 2, 1}) == 1.f);
  CHECK(test::values(causal_mask(2)) == std::vector<bool>{false, true, false, false});
}

TEST_CASE("masked_fill: backward zeroes the filled positions, matching finite differences", "[ops][masked_fill]") {
  test::require_gradcheck([](test::Inputs x) { return masked_fill(x[0], causal_mask(4), 0.5); }, {randn<double>({2, 4, 4})});
}

TEST_CASE("masked_fill: a mask that does not broadcast to the input throws", "[ops][masked_fill]") {
  REQUIRE_ERROR(masked_fill(zeros({2, 3}), causal_mask(2), 0), "masked_fill", "(2, 2)", "(2, 3)");
  REQUIRE_ERROR(masked_fill(zeros({3}), causal_mask(3), 0), "masked_fill", "(3, 3)", "(3,)");
}

namespace {

/// where(mask, fill, x) element by element, the mask broadcast by hand: the reference the op's
/// row kernels (a mask row as stored, one value per row, strided) must agree with bit for bit.
template <class T>
std::vector<T> reference_fill(const BasicTensor<T>& x, const BoolTensor& mask, T fill) {
  const Shape& s = x.shape();
  const Shape& m = mask.shape();
  const std::vector<T> xs = x.to_vector();
  const std::vector<bool> ms = mask.to_vector();
  std::vector<T> out(xs.size());
  for (std::int64_t i = 0; i < s.numel(); ++i) {
    std::int64_t at = 0, rest = i;
    for (int d = s.rank() - 1, md = m.rank() - 1; d >= 0; --d, --md) {
      const std::int64_t coord = rest % s[d];
      rest /= s[d];
      if (md >= 0 && m[md] != 1) at += coord * m.stride(md);
    }
    out[static_cast<std::size_t>(i)] = ms[static_cast<std::size_t>(at)] ? fill : xs[static_cast<std::size_t>(i)];
  }
  return out;
}

BoolTensor pattern_mask(const Shape& s) {
  BoolTensor m(s);
  bool* p = m.data();
  for (std::int64_t i = 0; i < s.numel(); ++i) p[i] = (i * 7 + i / 3) % 5 < 2;
  return m;
}

template <class T>
void require_reference_fill() {
  Generator gen(3);
  // 4 × 3 × 37 × 37: rows of 37 (vector tails), enough rows to split over threads.
  const Shape shape{4, 3, 37, 37};
  const BasicTensor<T> x = to<T>(randn({4, 3, 37, 37}, gen)).requires_grad_();
  for (const Shape& ms : {Shape{37, 37}, Shape{37, 1}, Shape{1, 37}, Shape{4, 1, 1, 37}, Shape{4, 3, 37, 1}, shape}) {
    INFO("mask " << fmt::format("{}", ms));
    const BoolTensor mask = ms == Shape{37, 37} ? causal_mask(37) : pattern_mask(ms);
    const BasicTensor<T> y = masked_fill(x, mask, -2.5);
    CHECK(y.to_vector() == reference_fill(x.detach(), mask, T(-2.5)));
    const BasicTensor<T> g = to<T>(randn({4, 3, 37, 37}, gen));
    CHECK(grad(sum(y * g), {x})[0].to_vector() == reference_fill(g, mask, T(0)));
  }
}

}  // namespace

TEST_CASE("masked_fill: every element is where(mask, value, x), for each way the mask broadcasts", "[ops][masked_fill]") {
  require_reference_fill<float>();
  require_reference_fill<double>();
  require_reference_fill<bfloat16>();
}
