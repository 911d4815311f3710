#include <functional>
#include <limits>
#include <vector>

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

namespace {
// The copies causal_self_attention avoids: split the packed projection, view the heads as
// (B, H, T, D), attend, merge the heads back.
template <class T>
BasicTensor<T> split_heads_attention(const BasicTensor<T>& qkv, std::int64_t H, double p, Generator& g) {
  const std::int64_t B = qkv.size(0), t = qkv.size(1), C = qkv.size(2) / 3, D = C / H;
  const auto parts = split(qkv, C, -1);
  auto heads = [&](const BasicTensor<T>& x) { return permute(reshape(x, {B, t, H, D}), {0, 2, 1, 3}); };
  const BasicTensor<T> y = causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), p, true, g);
  return reshape(permute(y, {0, 2, 1, 3}), {B, t, C});
}
}  // namespace

TEST_CASE("causal_self_attention: bitwise the split-heads path, forward and backward, dropout included",
          "[ops][attention]") {
  for (double p : {0.0, 0.2}) {
    Tensor a = randn({2, 9, 3 * 12}).requires_grad_();  // B 2, T 9, C 12, 3 heads of 4
    Tensor b = a.detach().requires_grad_();
    const Tensor w = randn({2, 9, 12});
    Generator g1(5), g2(5);
    const Tensor packed = causal_self_attention(a, 3, p, true, g1);
    const Tensor reference = split_heads_attention(b, 3, p, g2);
    CHECK(test::values(packed) == test::values(reference));
    CHECK(g1.state() == g2.state());
    sum(packed * w).backward();
    sum(reference * w).backward();
    CHECK(test::values(a.grad()) == test::values(b.grad()));
  }
}

TEST_CASE("causal_self_attention: backward matches finite differences", "[ops][attention]") {
  for (double p : {0.0, 0.25}) {
    test::require_gradcheck(
        [p](test::Inputs x) {
          Generator g(3);
          return causal_self_attention(x[0], 2, p, true, g);
        },
        {randn<double>({2, 5, 3 * 6})});
  }
}

TEST_CASE("causal_self_attention: saves the projection itself and one statistic a row", "[ops][attention]") {
  test::FreshTape fresh;
  Tensor x = randn({2, 16, 8}).requires_grad_();
  Tensor w = randn({24, 8}).requires_grad_();
  const std::size_t base = memory_stats().saved_bytes;
  Tensor qkv = linear(x, w);  // the projection's output: saved by the attention without a copy
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y = causal_self_attention(qkv, 2, 0.1);
  CHECK(memory_stats().saved_bytes - before == qkv.nbytes() + 2 * 2 * 16 * sizeof(float));
  sum(y).backward();
  CHECK(memory_stats().saved_bytes == base);
}

TEST_CASE("causal_self_attention: a width that does not split into 3 × heads, and a bad probability, throw",
          "[ops][attention]") {
  REQUIRE_ERROR(causal_self_attention(zeros({1, 4, 10}), 2), "causal_self_attention", "(1, 4, 10)", "n_head 2");
  REQUIRE_ERROR(causal_self_attention(zeros({4, 12}), 2), "causal_self_attention", "(4, 12)");
  REQUIRE_ERROR(causal_self_attention(zeros({1, 4, 12}), 2, 1.0), "causal_self_attention", "dropout");
}

namespace {

/// The gradient a backward inside a dual level returns (tangents on the inputs): its values, to
/// compare bit for bit with the plain backward's.
std::vector<DoubleTensor> gradient_carrying_tangents(
    const std::function<DoubleTensor(const std::vector<DoubleTensor>&)>& f, const std::vector<DoubleTensor>& inputs,
    const std::vector<DoubleTensor>& v) {
  dual_level level;
  std::vector<DoubleTensor> leaves, duals;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    leaves.push_back(inputs[i].detach().requires_grad_());
    duals.push_back(make_dual(leaves.back(), v[i]));
  }
  std::vector<DoubleTensor> g = grad(f(duals), leaves);
  for (DoubleTensor& x : g) {
    REQUIRE(detail::has_tangent(x));
    x = x.detach();
  }
  return g;
}

}  // namespace

// The fused kernels carrying tangents (the forward's tangent pass, and the backward's gradients
// with their tangents) take each tangent as present or absent: every subset of q, k, v differentiated
// (the others constants, with no tangent), with a tangent on the incoming gradient (⟨y², w⟩) and
// without (⟨y, w⟩, whose gradient at y is w).
TEST_CASE("causal_attention: hvp through the fused kernels equals double backward for every subset of q, k, v and "
          "either incoming gradient, the first derivatives are bitwise the plain backward's",
          "[ops][attention][hvp]") {
  test::FreshTape fresh;
  Generator g(31);
  const std::vector<DoubleTensor> qkv{randn<double>({2, 2, 5, 3}, g), randn<double>({2, 2, 5, 3}, g),
                                      randn<double>({2, 2, 5, 3}, g)};
  const DoubleTensor w = randn<double>({2, 2, 5, 3}, g);
  for (int subset = 1; subset < 8; ++subset) {
    for (const bool squared : {true, false}) {
      std::vector<std::size_t> which;
      for (std::size_t i = 0; i < 3; ++i)
        if ((subset >> i) & 1) which.push_back(i);
      INFO("inputs differentiated (bits of q, k, v): " << subset << (squared ? ", <y^2, w>" : ", <y, w>"));
      const auto f = [&](const std::vector<DoubleTensor>& x) {
        std::vector<DoubleTensor> all = qkv;
        for (std::size_t j = 0; j < which.size(); ++j) all[which[j]] = x[j];
        Generator drop(7);
        const DoubleTensor y = causal_attention(all[0], all[1], all[2], 0.3, true, drop);
        return squared ? sum(y * y * w) : sum(y * w);
      };
      std::vector<DoubleTensor> inputs, v;
      for (const std::size_t i : which) {
        inputs.push_back(qkv[i]);
        v.push_back(randn<double>(qkv[i].shape(), g));
      }
      const auto products = hvp(f, inputs, v).second;
      const std::vector<DoubleTensor> expected = test::double_backward_hvp(f, inputs, v);
      const std::vector<DoubleTensor> first = gradient_carrying_tangents(f, inputs, v);
      std::vector<DoubleTensor> leaves;
      for (const DoubleTensor& x : inputs) leaves.push_back(detail::copy_of(x).requires_grad_());
      const std::vector<DoubleTensor> plain = grad(f(leaves), leaves);
      for (std::size_t j = 0; j < which.size(); ++j) {
        INFO("input " << which[j]);
        const double scale = 1 + detail::flat(expected[j]).abs().maxCoeff();
        INFO("largest difference " << (detail::flat(products[j]) - detail::flat(expected[j])).abs().maxCoeff());
        CHECK(test::all_close(products[j], expected[j], 1e-12 * scale));
        CHECK(first[j].to_vector() == plain[j].to_vector());
      }
    }
  }
}

TEST_CASE("causal_self_attention: hvp through the fused kernels equals double backward with and without a tangent "
          "on the incoming gradient, the first derivative is bitwise the plain backward's",
          "[ops][attention][hvp]") {
  test::FreshTape fresh;
  Generator g(37);
  const DoubleTensor qkv = randn<double>({2, 5, 12}, g), w = randn<double>({2, 5, 4}, g);
  const DoubleTensor v = randn<double>({2, 5, 12}, g);
  for (const bool squared : {true, false}) {
    INFO((squared ? "<y^2, w>" : "<y, w>"));
    const auto f = [&](const std::vector<DoubleTensor>& x) {
      Generator drop(7);
      const DoubleTensor y = causal_self_attention(x[0], 2, 0.2, true, drop);
      return squared ? sum(y * y * w) : sum(y * w);
    };
    const std::vector<DoubleTensor> inputs{qkv}, directions{v};
    const DoubleTensor product = hvp(f, inputs, directions).second[0];
    const DoubleTensor expected = test::double_backward_hvp(f, inputs, directions)[0];
    const double scale = 1 + detail::flat(expected).abs().maxCoeff();
    INFO("largest difference " << (detail::flat(product) - detail::flat(expected)).abs().maxCoeff());
    CHECK(test::all_close(product, expected, 1e-12 * scale));
    const DoubleTensor leaf = detail::copy_of(qkv).requires_grad_();
    CHECK(gradient_carrying_tangents(f, inputs, directions)[0].to_vector() == grad(f({leaf}), {leaf})[0].to_vector());
  }
}
