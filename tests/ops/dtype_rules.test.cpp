// The dtype rules (ops/detail/dtype.hpp): the differentiable cast, every op on bfloat16 inputs
// bitwise to<bfloat16>(op(to<float>(x))) forward and backward, and mixed element types promoting.
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "support.hpp"

using namespace remat;

namespace {

/// Whether a and b have one shape and the same bytes (bitwise, NaNs included).
template <class T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

using BFloat16s = std::vector<BFloat16Tensor>;
using Floats = std::vector<Tensor>;

/// One row of the table: an op written once over its inputs' element type, and its inputs' shapes.
struct DtypeCase {
  std::string name;
  std::vector<Shape> shapes;
  bool positive;  ///< inputs drawn from [0.5, 1.5) (log, sqrt, pow, division) rather than N(0, 1)
  std::function<BFloat16Tensor(const BFloat16s&)> on_bfloat16;
  std::function<Tensor(const Floats&)> on_float;
};

template <class F>
DtypeCase row(std::string name, std::vector<Shape> shapes, F f, bool positive = false) {
  return {std::move(name), std::move(shapes), positive, f, f};
}

const LongTensor& targets() {
  static const LongTensor t = tensor<std::int64_t>({3, -100, 0, 4, 1, 2}, {2, 3});
  return t;
}
const LongTensor& token_ids() {
  static const LongTensor t = tensor<std::int64_t>({5, 0, 2, 2, 5, 1}, {2, 3});
  return t;
}
const BoolTensor& future() {
  static const BoolTensor m = causal_mask(7);
  return m;
}

std::vector<DtypeCase> every_op() {
  const Shape m{3, 7}, row7{7};
  return {
      row("add", {m, row7}, [](const auto& x) { return add(x[0], x[1]); }),
      row("add_scalar", {m}, [](const auto& x) { return x[0] + 0.1; }),
      row("sub", {m, row7}, [](const auto& x) { return x[0] - x[1]; }),
      row("sub_scalar", {m}, [](const auto& x) { return x[0] - 0.3f; }),
      row("rsub_scalar", {m}, [](const auto& x) { return 2.5 - x[0]; }),
      row("mul", {m, row7}, [](const auto& x) { return mul(x[0], x[1]); }),
      row("mul_scalar", {m}, [](const auto& x) { return 3 * x[0]; }),
      row("div", {m, row7}, [](const auto& x) { return x[0] / x[1]; }, true),
      row("div_scalar", {m}, [](const auto& x) { return x[0] / 7.0; }),
      row("rdiv_scalar", {m}, [](const auto& x) { return 1.0 / x[0]; }, true),
      row("pow", {m}, [](const auto& x) { return pow(x[0], 2.5); }, true),
      row("exp", {m}, [](const auto& x) { return exp(x[0]); }),
      row("log", {m}, [](const auto& x) { return log(x[0]); }, true),
      row("sqrt", {m}, [](const auto& x) { return sqrt(x[0]); }, true),
      row("tanh", {m}, [](const auto& x) { return tanh(x[0]); }),
      row("erf", {m}, [](const auto& x) { return erf(x[0]); }),
      row("matmul", {{2, 3, 5}, {5, 4}}, [](const auto& x) { return matmul(x[0], x[1]); }),
      row("matmul_transposed", {{2, 5, 3}, {2, 4, 5}}, [](const auto& x) { return matmul(x[0], x[1], true, true); }),
      row("linear", {{2, 3, 5}, {4, 5}, {4}}, [](const auto& x) { return linear(x[0], x[1], x[2]); }),
      row("causal_attention", {{1, 2, 5, 4}, {1, 2, 5, 4}, {1, 2, 5, 4}},
          [](const auto& x) { return causal_attention(x[0], x[1], x[2]); }),
      row("causal_self_attention", {{2, 5, 12}}, [](const auto& x) {
        Generator gen(13);
        return causal_self_attention(x[0], 2, 0.2, true, gen);
      }),
      row("sigmoid", {m}, [](const auto& x) { return sigmoid(x[0]); }),
      row("relu", {m}, [](const auto& x) { return relu(x[0]); }),
      row("neg", {m}, [](const auto& x) { return -x[0]; }),
      row("gelu", {m}, [](const auto& x) { return gelu(x[0]); }),
      row("gelu_tanh", {m}, [](const auto& x) { return gelu(x[0], "tanh"); }),
      row("bias_gelu", {m, row7}, [](const auto& x) { return bias_gelu(x[0], x[1]); }),
      row("layer_norm", {m, row7, row7}, [](const auto& x) { return layer_norm(x[0], x[1], x[2]); }),
      row("layer_norm without weight and bias", {m}, [](const auto& x) { return layer_norm(x[0], {}, {}); }),
      row("softmax", {m}, [](const auto& x) { return softmax(x[0]); }),
      row("log_softmax", {m}, [](const auto& x) { return log_softmax(x[0]); }),
      row("cross_entropy", {{2, 3, 5}}, [](const auto& x) { return cross_entropy(x[0], targets()); }),
      row("embedding", {{6, 4}}, [](const auto& x) { return embedding(token_ids(), x[0]); }),
      row("dropout", {m}, [](const auto& x) {
        Generator gen(11);
        return dropout(x[0], 0.3, true, gen);
      }),
      row("dropout_add", {m, m}, [](const auto& x) {
        Generator gen(12);
        return dropout_add(x[0], x[1], 0.3, true, gen);
      }),
      row("sum", {m}, [](const auto& x) { return sum(x[0]); }),
      row("sum_dim", {m}, [](const auto& x) { return sum(x[0], 0); }),
      row("mean", {m}, [](const auto& x) { return mean(x[0]); }),
      row("mean_dim", {m}, [](const auto& x) { return mean(x[0], -1, true); }),
      row("max_dim", {m}, [](const auto& x) { return max(x[0], 1).values; }),
      row("masked_fill", {{2, 7, 7}}, [](const auto& x) { return masked_fill(x[0], future(), -1e9); }),
      row("cat", {m, {2, 7}}, [](const auto& x) {
        using Same = std::decay_t<decltype(x[0])>;
        return cat(std::vector<Same>{x[0], x[1]}, 0);
      }),
      row("narrow", {m}, [](const auto& x) { return narrow(x[0], 1, 2, 4); }),
      row("split", {m}, [](const auto& x) { return split(x[0], 3, 1)[1]; }),
      row("permute", {{2, 3, 7}}, [](const auto& x) { return permute(x[0], {2, 0, 1}); }),
      row("transpose", {m}, [](const auto& x) { return transpose(x[0], 0, 1); }),
      row("reshape", {m}, [](const auto& x) { return reshape(x[0], {7, 3}); }),
      row("unsqueeze", {m}, [](const auto& x) { return unsqueeze(x[0], 1); }),
  };
}

}  // namespace

TEST_CASE("dtype rules: every op on bfloat16 is bitwise to<bfloat16>(op(to<float>(x))), forward and backward",
          "[ops][dtype][bfloat16]") {
  Generator gen(2027);
  for (const DtypeCase& c : every_op()) {
    INFO("op: " << c.name);
    // The inputs' values, exactly representable in bfloat16.
    std::vector<Tensor> values;
    for (const Shape& s : c.shapes) {
      const Tensor drawn = c.positive ? rand(s, gen) + 0.5f : randn(s, gen);
      values.push_back(to<float>(to<bfloat16>(drawn)));
    }
    const auto bfloat16_leaves = [&] {
      BFloat16s leaves;
      for (const Tensor& v : values) leaves.push_back(to<bfloat16>(v).requires_grad_());
      return leaves;
    };
    // The op on bfloat16 leaves; the same leaves through the float32 route spelled out; and the
    // float32 op on float32 leaves holding the same values.
    const BFloat16s direct = bfloat16_leaves(), routed = bfloat16_leaves();
    Floats widened, reference;
    for (const BFloat16Tensor& x : routed) widened.push_back(to<float>(x));
    for (const Tensor& v : values) reference.push_back(detail::copy_of(v).requires_grad_());

    const BFloat16Tensor y = c.on_bfloat16(direct);
    const BFloat16Tensor y_routed = to<bfloat16>(c.on_float(widened));
    const Tensor y_float = c.on_float(reference);
    REQUIRE(y.requires_grad());
    CHECK(same_bits(y, y_routed));
    CHECK(same_bits(y, to<bfloat16>(y_float.detach())));

    const BFloat16Tensor dy = to<bfloat16>(randn(y.shape(), gen));
    y.backward(dy);
    y_routed.backward(dy);
    y_float.backward(to<float>(dy));
    for (std::size_t i = 0; i < direct.size(); ++i) {
      INFO("input " << i);
      const BFloat16Tensor g = direct[i].grad();
      REQUIRE(g.defined());
      CHECK(same_bits(g, routed[i].grad()));
      // Gradients flow in bfloat16: the float32 op's gradient, rounded once to nearest even.
      CHECK(same_bits(g, to<bfloat16>(reference[i].grad())));
    }
  }
}

TEST_CASE("to: float32 <-> bfloat16 gradients round to nearest even toward bfloat16 and widen exactly toward float32",
          "[ops][dtype][bfloat16][to]") {
  // bfloat16 keeps 7 fraction bits: 1 + 2^-8 is a tie that goes to the even 1, 1 + 3·2^-8 a tie that
  // goes to the even 1 + 2^-6, and just above a tie rounds up.
  const Tensor w = tensor({1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -3.0f});
  const std::vector<float> rounded{1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -3.0f};

  Tensor x = tensor({0.5f, 1.5f, -2.0f, 4.0f}).requires_grad_();
  BFloat16Tensor h = to<bfloat16>(x);
  h.retain_grad();
  sum(to<float>(h) * w).backward();
  CHECK(test::values(to<float>(h.grad())) == rounded);  // the cast back to bfloat16 rounded
  CHECK(test::values(x.grad()) == rounded);             // and widened to float32 exactly

  // A bfloat16 leaf takes its gradient in bfloat16; a bfloat16 tensor times a float32 one promotes.
  BFloat16Tensor leaf = to<bfloat16>(tensor({0.5f, 1.5f, -2.0f, 4.0f})).requires_grad_();
  sum(leaf * w).backward();
  CHECK(test::values(to<float>(leaf.grad())) == rounded);

  // float64 -> float32 rounds to nearest too; float32 -> float64 is exact.
  Tensor f = tensor({1.0f, 2.0f}).requires_grad_();
  sum(to<double>(f) * tensor<double>({1.0 + 0x1p-30, 1.0 + 0x1p-23 + 0x1p-30})).backward();
  CHECK(test::values(f.grad()) == std::vector<float>{1.0f, 1.0f + 0x1p-23f});
}

TEST_CASE("to: backward matches finite differences, float64 <-> float32", "[ops][dtype][to]") {
  test::require_gradcheck([](test::Inputs x) { return to<double>(x[0]); }, {randn<double>({3, 4})});
  // Through float32 the differences see its rounding (6e-8 of |f|, over a step of 2e-3): a wide step
  // and a tolerance of 1e-4.
  testing::GradcheckOptions through_float;
  through_float.eps = 1e-3;
  through_float.atol = 1e-4;
  through_float.rtol = 1e-4;
  test::require_gradcheck([](test::Inputs x) { return to<double>(tanh(to<float>(x[0]))); }, {randn<double>({3, 4})},
                          through_float);
  // float32 times float64 promotes to float64; the float32 operand's gradient comes back through the cast.
  test::require_gradcheck([](test::Inputs x) { return to<float>(x[0]) * x[1]; },
                          {randn<double>({3, 4}), randn<double>({4})}, through_float);
}

namespace {

/// f(a, b) for tensors of element types A and B: of element type P, bitwise f on both promoted to
/// P first, and each gradient that of the promoted operand cast back to the operand's own type.
template <class A, class B, class P, class F>
void check_promotes(F f) {
  Generator gen(31);
  BasicTensor<A> a = to<A>(randn({3, 4}, gen)).requires_grad_();
  BasicTensor<B> b = to<B>(rand({4}, gen) + 0.5f).requires_grad_();
  const auto z = f(a, b);
  static_assert(std::is_same_v<std::decay_t<decltype(z)>, BasicTensor<P>>, "the promoted type");
  BasicTensor<P> pa = to<P>(a.detach()).requires_grad_(), pb = to<P>(b.detach()).requires_grad_();
  const BasicTensor<P> expected = f(pa, pb);
  CHECK(same_bits(z, expected));
  const BasicTensor<P> dz = to<P>(randn(z.shape(), gen));
  z.backward(dz);
  expected.backward(dz);
  CHECK(same_bits(a.grad(), to<A>(pa.grad())));
  CHECK(same_bits(b.grad(), to<B>(pb.grad())));
}

template <class A, class B, class P>
void check_arithmetic_promotes() {
  check_promotes<A, B, P>([](const auto& a, const auto& b) { return add(a, b); });
  check_promotes<A, B, P>([](const auto& a, const auto& b) { return a - b; });
  check_promotes<A, B, P>([](const auto& a, const auto& b) { return a * b; });
  check_promotes<A, B, P>([](const auto& a, const auto& b) { return div(a, b); });
}

}  // namespace

TEST_CASE("dtype rules: add, sub, mul and div of two element types promote as torch.promote_types, gradients in each "
          "operand's own type", "[ops][dtype][add][sub][mul][div]") {
  SECTION("bfloat16 with float32 is float32") { check_arithmetic_promotes<bfloat16, float, float>(); }
  SECTION("float32 with bfloat16 is float32") { check_arithmetic_promotes<float, bfloat16, float>(); }
  SECTION("float32 with float64 is float64") { check_arithmetic_promotes<float, double, double>(); }
  SECTION("float64 with float32 is float64") { check_arithmetic_promotes<double, float, double>(); }
  SECTION("bfloat16 with float64 is float64") { check_arithmetic_promotes<bfloat16, double, double>(); }
}

TEST_CASE("dtype rules: layer_norm of a bfloat16 input with float32 weight and bias (PyTorch's mixed type) is bfloat16, "
          "computed in float32", "[ops][dtype][layer_norm]") {
  Generator gen(41);
  const Tensor xv = to<float>(to<bfloat16>(randn({4, 9}, gen)));
  BFloat16Tensor x = to<bfloat16>(xv).requires_grad_();
  Tensor w = (randn({9}, gen) + 1.0f).detach().requires_grad_(), b = randn({9}, gen).requires_grad_();
  Tensor xf = detail::copy_of(xv).requires_grad_(), wf = detail::copy_of(w).requires_grad_(),
         bf = detail::copy_of(b).requires_grad_();
  const BFloat16Tensor y = layer_norm(x, w, b);
  const Tensor yf = layer_norm(xf, wf, bf);
  CHECK(same_bits(y, to<bfloat16>(yf.detach())));
  const BFloat16Tensor dy = to<bfloat16>(randn({4, 9}, gen));
  y.backward(dy);
  yf.backward(to<float>(dy));
  CHECK(same_bits(x.grad(), to<bfloat16>(xf.grad())));
  CHECK(same_bits(w.grad(), wf.grad()));  // float32 parameters take float32 gradients
  CHECK(same_bits(b.grad(), bf.grad()));
  // Shape errors still name the op and the shapes.
  REQUIRE_ERROR(layer_norm(x, ones({8}), b), "layer_norm", "weight", "(8,)", "(4, 9)");
}
