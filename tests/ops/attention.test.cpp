#include <limits>

#include "support.hpp"

using namespace remat;

namespace {
DoubleTensor explicit_attention(const DoubleTensor& q, const DoubleTensor& k, const DoubleTensor& v, double p, Generator& g) {
  DoubleTensor att = matmul(q, transpose(k, -2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  att = masked_fill(att, causal_mask(q.size(2)), -std::numeric_limits<double>::infinity());
  return matmul(dropout(softmax(att), p, true, g), v);
}
}  // namespace

TEST_CASE("causal_attention: equals the explicit ops, dropout masks included", "[ops][attention]") {
  Generator init(41);
  const DoubleTensor q = randn<double>({2, 3, 5, 4}, init), k = randn<double>({2, 3, 5, 4}, init),
                     v = randn<double>({2, 3, 5, 4}, init);
  for (double p : {0.0, 0.3}) {
    Generator g1(7), g2(7);
    const DoubleTensor fused = causal_attention(q, k, v, p, true, g1);
    const DoubleTensor reference = explicit_attention(q, k, v, p, g2);
    INFO("p = " << p << ", max difference " << (detail::flat(fused) - detail::flat(reference)).abs().maxCoeff());
    CHECK(test::all_close(fused, reference, 1e-12));
    CHECK(g1.state() == g2.state());  // the generator advances as dropout over (B, H, T, T) does
  }
}

TEST_CASE("causal_attention: backward matches finite differences, with and without dropout", "[ops][attention]") {
  for (double p : {0.0, 0.25}) {
    test::require_gradcheck(
        [p](test::Inputs x) {
          Generator g(3);
          return causal_attention(x[0], x[1], x[2], p, true, g);
        },
        {randn<double>({1, 2, 6, 3}), randn<double>({1, 2, 6, 3}), randn<double>({1, 2, 6, 3})});
  }
}

TEST_CASE("causal_attention: saves q, k, v and one statistic a row, never (T, T)", "[ops][attention]") {
  test::FreshTape fresh;
  Tensor q = randn({2, 2, 16, 8}).requires_grad_(), k = randn({2, 2, 16, 8}).requires_grad_(),
         v = randn({2, 2, 16, 8}).requires_grad_();
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y = causal_attention(q, k, v, 0.1);
  CHECK(memory_stats().saved_bytes - before == 3 * q.nbytes() + 2 * 2 * 16 * sizeof(float));
  sum(y).backward();
  CHECK(memory_stats().saved_bytes == before);
}

TEST_CASE("causal_attention: mismatched shapes and a bad probability throw", "[ops][attention]") {
  REQUIRE_ERROR(causal_attention(zeros({1, 1, 4, 2}), zeros({1, 1, 4, 3}), zeros({1, 1, 4, 2})), "causal_attention",
                "(1, 1, 4, 3)");
  REQUIRE_ERROR(causal_attention(zeros({1, 1, 4, 2}), zeros({1, 1, 4, 2}), zeros({1, 1, 4, 2}), 1.0), "causal_attention",
                "dropout");
}
