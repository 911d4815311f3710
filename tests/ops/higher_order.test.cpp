// Higher-order gradients (create_graph): the recorded backward of every op that has one, checked
// against central differences of first derivatives (gradgradcheck, in double); its first-order
// values bitwise those of the array backward; backward(create_graph) and grad() through a small
// MLP; Hessian-vector products; and the refusals. Forward mode on the same list: every op's
// tangent rule against central differences and against the double-vjp identity, and every op's
// backward carrying tangents (hvp, forward-over-reverse) against double backward.
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "support.hpp"

using namespace remat;

namespace {

using Fn = std::function<DoubleTensor(const std::vector<DoubleTensor>&)>;

void require_gradgradcheck(const Fn& f, std::vector<DoubleTensor> inputs) {
  const testing::GradcheckResult r = testing::gradgradcheck(f, inputs);
  INFO(r.message);
  INFO("max abs error " << r.max_abs_error);
  REQUIRE(r.ok);
}

/// The first derivatives a create_graph backward returns equal, bit for bit, those of the plain
/// backward (the recorded formulas make the same operations in the same order).
template <class T>
void require_same_first_order(const std::function<BasicTensor<T>(const std::vector<BasicTensor<T>>&)>& f,
                              const std::vector<BasicTensor<T>>& inputs, bool bitwise = true) {
  std::vector<BasicTensor<T>> xs;
  for (const auto& x : inputs) xs.push_back(detail::copy_of(x).requires_grad_());
  const BasicTensor<T> y = f(xs);
  Generator gen(3);
  const BasicTensor<T> w = randn<T>(y.shape(), gen);
  GradOptions keep;
  keep.retain_graph = true;
  const std::vector<BasicTensor<T>> plain = grad(std::vector<BasicTensor<T>>{y}, xs, {w}, keep);
  GradOptions recorded;
  recorded.create_graph = true;
  const std::vector<BasicTensor<T>> graph = grad(std::vector<BasicTensor<T>>{y}, xs, {w}, recorded);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    INFO("input " << i);
    REQUIRE(graph[i].shape() == plain[i].shape());
    if (bitwise) CHECK(graph[i].to_vector() == plain[i].to_vector());
    else CHECK(test::all_close(graph[i], plain[i], 1e-14 * (1 + detail::flat(plain[i]).abs().maxCoeff())));
  }
}

struct Case {
  std::string name;
  Fn f;
  std::vector<DoubleTensor> inputs;
  /// Whether its recorded first derivatives are bitwise the array backward's: not for a fused op
  /// whose recorded form is its unfused composition (bias_gelu's row-by-row kernel evaluates erf
  /// and exp on Eigen's scalar path where a row's start is unaligned; the composition does not).
  bool bitwise = true;
};

std::vector<Case> recordable_ops() {
  Generator g(11);
  const auto r = [&](Shape s) { return randn<double>(s, g); };
  const auto positive = [&](Shape s) { return (rand<double>(s, g) + 0.5).detach(); };
  return {
      {"add (broadcast)", [](auto& x) { return pow(x[0] + x[1], 2); }, {r({3, 4}), r({4})}},
      {"sub (broadcast)", [](auto& x) { return pow(x[0] - x[1], 2); }, {r({2, 1, 4}), r({3, 4})}},
      {"mul (broadcast)", [](auto& x) { return x[0] * x[1]; }, {r({3, 4}), r({3, 1})}},
      {"div (broadcast)", [](auto& x) { return x[0] / x[1]; }, {r({3, 4}), positive({4})}},
      {"neg", [](auto& x) { return neg(x[0]) * x[0]; }, {r({5})}},
      {"scalar add, sub, rsub", [](auto& x) { return pow((x[0] + 1.5) - 0.5, 2) * (2.0 - x[0]); }, {r({5})}},
      {"scalar mul, div, rdiv", [](auto& x) { return (x[0] * 3.0) / 2.0 + 2.0 / x[0]; }, {positive({5})}},
      {"tanh", [](auto& x) { return tanh(x[0]); }, {r({3, 4})}},
      {"sigmoid", [](auto& x) { return sigmoid(x[0]); }, {r({3, 4})}},
      {"relu", [](auto& x) { return relu(x[0]) * x[0]; }, {r({3, 4})}},
      {"exp", [](auto& x) { return exp(x[0]); }, {r({3, 4})}},
      {"log", [](auto& x) { return log(x[0]); }, {positive({3, 4})}},
      {"sqrt", [](auto& x) { return sqrt(x[0]); }, {positive({3, 4})}},
      {"pow", [](auto& x) { return pow(x[0], 3); }, {r({3, 4})}},
      {"sum", [](auto& x) { return pow(sum(x[0]), 2); }, {r({3, 4})}},
      {"sum over a dim", [](auto& x) { return pow(sum(x[0], 0), 2); }, {r({3, 4})}},
      {"mean", [](auto& x) { return pow(mean(x[0]), 2); }, {r({3, 4})}},
      {"mean over a dim, kept", [](auto& x) { return pow(mean(x[0], 1, true), 2); }, {r({3, 4})}},
      {"reshape", [](auto& x) { return pow(reshape(x[0], {4, 3}), 2); }, {r({3, 4})}},
      {"masked_fill", [](auto& x) { return pow(masked_fill(x[0], causal_mask(3), 0.0), 2); }, {r({2, 3, 3})}},
      {"broadcast_to", [](auto& x) { return pow(broadcast_to(x[0], Shape{2, 3, 4}), 2); }, {r({3, 1})}},
      {"sum_to_size", [](auto& x) { return pow(sum_to_size(x[0], Shape{1, 4}), 2); }, {r({3, 4})}},
      {"matmul", [](auto& x) { return matmul(x[0], x[1]); }, {r({3, 4}), r({4, 5})}},
      {"matmul, batched, folded", [](auto& x) { return matmul(x[0], x[1]); }, {r({2, 3, 4}), r({4, 5})}},
      {"matmul, both transposed", [](auto& x) { return matmul(x[0], x[1], true, true); }, {r({2, 4, 3}), r({2, 5, 4})}},
      {"matmul, broadcast batch", [](auto& x) { return matmul(x[0], x[1], false, true); }, {r({2, 3, 4}), r({1, 5, 4})}},
      {"linear", [](auto& x) { return linear(x[0], x[1], x[2]); }, {r({2, 3, 4}), r({5, 4}), r({5})}},
      {"erf", [](auto& x) { return erf(x[0]); }, {r({3, 4})}},
      {"gelu", [](auto& x) { return gelu(x[0]); }, {r({3, 4})}},
      {"gelu, tanh approximation", [](auto& x) { return gelu(x[0], GeluApproximation::tanh); }, {r({3, 4})}},
      {"bias_gelu (its unfused composition)", [](auto& x) { return bias_gelu(x[0], x[1]); }, {r({2, 3, 5}), r({5})},
       false},
      {"bias_gelu, tanh approximation", [](auto& x) { return bias_gelu(x[0], x[1], GeluApproximation::tanh); },
       {r({3, 5}), r({5})}, false},
      {"softmax", [](auto& x) { return softmax(x[0]); }, {r({2, 3, 5})}},
      {"log_softmax", [](auto& x) { return log_softmax(x[0]); }, {r({3, 5})}},
      {"layer_norm (its composition: mean, sub, mul, sqrt, rdiv)",
       [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, {r({2, 3, 5}), r({5}), r({5})}, false},
      {"layer_norm without weight and bias", [](auto& x) { return layer_norm(x[0], {}, {}); }, {r({3, 6})}, false},
      {"cross_entropy (a row ignored)",
       [](auto& x) { return cross_entropy(x[0], tensor<std::int64_t>({3, -100, 0, 4, 1, 2}, {2, 3})); },
       {r({2, 3, 5})}},
      {"embedding", [](auto& x) { return pow(embedding(tensor<std::int64_t>({2, 0, 2, 1}, {2, 2}), x[0]), 2); },
       {r({4, 3})}},
      {"narrow", [](auto& x) { return pow(narrow(x[0], 1, 1, 2), 2); }, {r({2, 4, 3})}},
      {"narrow_backward (narrow's adjoint)",
       [](auto& x) { return pow(detail::narrow_backward(x[0], Shape{2, 5, 3}, 1, 2), 2); }, {r({2, 2, 3})}},
      {"embedding_backward (embedding's adjoint)",
       [](auto& x) { return pow(detail::embedding_backward(x[0], tensor<std::int64_t>({2, 0, 2, 1}, {2, 2}), 4), 2); },
       {r({2, 2, 3})}},
      {"cat", [](auto& x) { return pow(cat(std::vector<DoubleTensor>{x[0], x[1]}, 1), 2); }, {r({2, 2}), r({2, 3})}},
      {"max over a dim", [](auto& x) { return pow(max(x[0], 1).values, 2); }, {r({3, 5})}},
      {"permute", [](auto& x) { return pow(permute(x[0], {2, 0, 1}), 2); }, {r({2, 3, 4})}},
      {"dropout (one mask: a fresh generator per call)",
       [](auto& x) {
         Generator gen(7);
         return dropout(x[0], 0.3, true, gen) * x[0];
       },
       {r({4, 5})}},
      {"dropout_add",
       [](auto& x) {
         Generator gen(7);
         return pow(dropout_add(x[0], x[1], 0.3, true, gen), 2);
       },
       {r({4, 5}), r({4, 5})}},
      {"causal_attention (its composition)", [](auto& x) { return causal_attention(x[0], x[1], x[2]); },
       {r({1, 2, 4, 3}), r({1, 2, 4, 3}), r({1, 2, 4, 3})}, false},
      {"causal_attention with dropout",
       [](auto& x) {
         Generator gen(7);
         return causal_attention(x[0], x[1], x[2], 0.3, true, gen);
       },
       {r({1, 2, 4, 3}), r({1, 2, 4, 3}), r({1, 2, 4, 3})}, false},
      {"causal_self_attention (packed, dropout)",
       [](auto& x) {
         Generator gen(7);
         return causal_self_attention(x[0], 2, 0.2, true, gen);
       },
       {r({2, 4, 12})}, false},
      {"to", [](auto& x) { return pow(to<double>(x[0]), 2); }, {r({3, 4})}},
      {"an MLP's loss", [](auto& x) { return mean(pow(tanh(linear(x[0], x[1], x[2])), 2)); },
       {r({2, 3, 4}), r({5, 4}), r({5})}},
  };
}

}  // namespace

TEST_CASE("create_graph: every recordable op's second derivatives match finite differences of its first",
          "[ops][higher_order]") {
  test::FreshTape fresh;
  for (const Case& c : recordable_ops()) {
    INFO(c.name);
    require_gradgradcheck(c.f, c.inputs);
  }
}

TEST_CASE("create_graph: the recorded backward's first derivatives are bitwise the array backward's (a fused "
          "op's composition: to rounding)",
          "[ops][higher_order]") {
  test::FreshTape fresh;
  for (const Case& c : recordable_ops()) {
    INFO(c.name << " (double)");
    require_same_first_order<double>(c.f, c.inputs, c.bitwise);
  }
  Generator g(5);
  const std::vector<Tensor> mlp{randn<float>({8, 16}, g), randn<float>({32, 16}, g), randn<float>({32}, g),
                                randn<float>({4, 32}, g)};
  INFO("an MLP in float32");
  require_same_first_order<float>(
      [](const std::vector<Tensor>& x) { return sum(relu(linear(sigmoid(linear(x[0], x[1], x[2])), x[3]))); }, mlp);
  // Rows of 21: most start unaligned, where a reduction's order depends on the alignment.
  const std::vector<Tensor> head{randn<float>({8, 16}, g), randn<float>({32, 16}, g), randn<float>({32}, g),
                                 randn<float>({21, 32}, g)};
  INFO("casts float32 -> float64 -> float32");
  require_same_first_order<float>(
      [](const std::vector<Tensor>& x) { return to<float>(pow(to<double>(x[0]), 2) * 0.5); }, {randn<float>({3, 5}, g)});
  INFO("gelu, then softmax and log_softmax heads, in float32");
  require_same_first_order<float>(
      [](const std::vector<Tensor>& x) {
        const Tensor logits = linear(gelu(linear(x[0], x[1], x[2])), x[3]);
        return softmax(logits) + log_softmax(logits * 0.5f) + gelu(logits, GeluApproximation::tanh);
      },
      head);
}

TEST_CASE("broadcast_to and sum_to_size: values, shapes, first-order gradients, bad shapes", "[ops][higher_order]") {
  test::FreshTape fresh;
  const Tensor x = tensor({1.f, 2.f, 3.f}, Shape{3, 1});
  const Tensor b = broadcast_to(x, Shape{2, 3, 2});
  CHECK(b.shape() == Shape{2, 3, 2});
  CHECK(b.to_vector() == std::vector<float>{1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3});
  const Tensor s = sum_to_size(b, Shape{3, 1});
  CHECK(s.to_vector() == std::vector<float>{4, 8, 12});
  CHECK(sum_to_size(b, Shape{2}).to_vector() == std::vector<float>{12, 12});
  test::require_gradcheck([](auto& v) { return broadcast_to(v[0], Shape{4, 2, 3}); }, {randn<double>({2, 1})});
  test::require_gradcheck([](auto& v) { return sum_to_size(v[0], Shape{2, 1}); }, {randn<double>({3, 2, 4})});
  REQUIRE_ERROR(broadcast_to(x, Shape{3, 2, 2}), "broadcast_to", "(3, 1)", "(3, 2, 2)");
  REQUIRE_ERROR(sum_to_size(x, Shape{2}), "sum_to_size", "(2,)", "(3, 1)");
}

TEST_CASE("create_graph: backward writes a .grad with a graph, the graph is kept, and grad_outputs carry theirs",
          "[ops][higher_order]") {
  test::FreshTape fresh;
  DoubleTensor x = tensor<double>({0.5, -1.0, 2.0}).requires_grad_();
  DoubleTensor y = sum(pow(x, 3));
  y.backward(DoubleTensor(), false, true);
  const DoubleTensor gx = x.grad();  // 3 x²
  REQUIRE(gx.requires_grad());
  CHECK(gx.to_vector() == std::vector<double>{0.75, 3.0, 12.0});
  x.zero_grad();
  sum(gx).backward();  // 6 x
  CHECK(x.grad().to_vector() == std::vector<double>{3.0, -6.0, 12.0});
  x.zero_grad();
  y.backward();  // create_graph kept the first graph: a second backward through it runs
  CHECK(x.grad().to_vector() == std::vector<double>{0.75, 3.0, 12.0});
  CHECK_FALSE(x.grad().requires_grad());

  // A weight that requires grad: ∂⟨Jᵀv, u⟩/∂v = J u. For y = W x, J = W.
  DoubleTensor w = tensor<double>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  DoubleTensor xin = tensor<double>({1, 1, 1}, Shape{3, 1}).requires_grad_();
  DoubleTensor v = tensor<double>({1, -1}, Shape{2, 1}).requires_grad_();
  DoubleTensor u = tensor<double>({1, 0, 2}, Shape{3, 1});
  GradOptions recorded;
  recorded.create_graph = true;
  const DoubleTensor jtv = grad<double>({matmul(w, xin)}, {xin}, {v}, recorded)[0];
  CHECK(jtv.to_vector() == std::vector<double>{-3, -3, -3});
  CHECK(grad(sum(jtv * u), {v})[0].to_vector() == std::vector<double>{7, 16});
}

TEST_CASE("create_graph: a Hessian-vector product of an MLP's loss by double backward matches differences of gradients",
          "[ops][higher_order]") {
  test::FreshTape fresh;
  Generator g(21);
  std::vector<DoubleTensor> params{randn<double>({6, 5}, g), randn<double>({6}, g), randn<double>({1, 6}, g)};
  for (auto& p : params) p.requires_grad_();
  const DoubleTensor data = randn<double>({7, 5}, g), target = randn<double>({7, 1}, g);
  const auto loss = [&](const std::vector<DoubleTensor>& p) {
    return mean(pow(linear(tanh(linear(data, p[0], p[1])), p[2]) - target, 2));
  };
  std::vector<DoubleTensor> direction;
  for (const auto& p : params) direction.push_back(randn<double>(p.shape(), g));
  GradOptions recorded;
  recorded.create_graph = true;
  const std::vector<DoubleTensor> first = grad(std::vector<DoubleTensor>{loss(params)}, params, {}, recorded);
  DoubleTensor dot;
  for (std::size_t i = 0; i < params.size(); ++i) {
    DoubleTensor term = sum(first[i] * direction[i]);
    dot = dot.defined() ? dot + term : term;
  }
  const std::vector<DoubleTensor> hv = grad(std::vector<DoubleTensor>{dot}, params);
  // (∇L(p + εd) - ∇L(p - εd)) / 2ε
  const double eps = 1e-5;
  const auto shifted_grad = [&](double sign) {
    std::vector<DoubleTensor> p;
    for (std::size_t i = 0; i < params.size(); ++i)
      p.push_back((params[i].detach() + direction[i] * (sign * eps)).detach().requires_grad_());
    return grad(std::vector<DoubleTensor>{loss(p)}, p);
  };
  const std::vector<DoubleTensor> plus = shifted_grad(1), minus = shifted_grad(-1);
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::int64_t j = 0; j < params[i].numel(); ++j) {
      const double numeric = (plus[i].data()[j] - minus[i].data()[j]) / (2 * eps);
      CHECK(hv[i].data()[j] == Approx(numeric).epsilon(1e-6).margin(1e-8));
    }
}

TEST_CASE("create_graph: what it cannot record yet is an error naming the op or the setting", "[ops][higher_order]") {
  test::FreshTape fresh;
  Tensor x = tensor({0.5f, -1.f, 2.f}).requires_grad_();
  GradOptions recorded;
  recorded.create_graph = true;
  REQUIRE_ERROR(grad(sum(test::unrecordable_square(x)), {x}, recorded), "'unrecordable_square'", "create_graph",
                "second differentiation");
  {
    Tensor y = sum(x * x);
    autocast on;
    REQUIRE_ERROR(grad(y, {x}, recorded), "grad", "create_graph", "autocast");
  }
  // A gradient computed without create_graph has no graph: differentiating it again says so.
  const Tensor plain = grad(sum(x * x), {x})[0];
  REQUIRE_ERROR(grad(sum(plain), {x}), "grad", "output 0", "does not require grad", "create_graph");
}

namespace {

/// The ops a function runs (their names, as observers hear them).
class OpNames : public Observer {
 public:
  void op(const OpOutput& out, const OpValues&) override { names.insert(out.op.name()); }
  std::set<std::string> names;
};

/// jvp(f, inputs, v) for a random direction v: the primal bitwise f's own; the tangent against
/// central differences of f along v (step 1e-6, in double) and against the double-vjp identity
/// J v = ∂/∂u ⟨Jᵀu, v⟩, with Jᵀu from a create_graph backward.
void require_tangent(const Case& c) {
  Generator g(21);
  std::vector<DoubleTensor> v;
  for (const DoubleTensor& x : c.inputs) v.push_back(randn<double>(x.shape(), g));
  const auto [outputs, tangents] = jvp(c.f, c.inputs, v);
  REQUIRE(outputs.size() == 1);
  CHECK(outputs[0].to_vector() == c.f(c.inputs).to_vector());  // tangents change no primal bit
  const DoubleTensor& t = tangents[0];

  const double eps = 1e-6;
  const auto along = [&](double step) {
    std::vector<DoubleTensor> moved;
    for (std::size_t i = 0; i < v.size(); ++i) moved.push_back((c.inputs[i] + v[i] * step).detach());
    return c.f(moved);
  };
  const DoubleTensor differences = (along(eps) - along(-eps)) / (2 * eps);
  const double scale = 1 + detail::flat(differences).abs().maxCoeff();
  INFO("largest |tangent - differences| " << (detail::flat(t) - detail::flat(differences)).abs().maxCoeff());
  CHECK(test::all_close(t, differences, 1e-6 * scale));

  std::vector<DoubleTensor> xs;
  for (const DoubleTensor& x : c.inputs) xs.push_back(detail::copy_of(x).requires_grad_());
  const DoubleTensor y = c.f(xs);
  const DoubleTensor u = randn<double>(y.shape(), g).requires_grad_();
  GradOptions recorded;
  recorded.create_graph = true;
  const std::vector<DoubleTensor> jtu = grad(std::vector<DoubleTensor>{y}, xs, {u}, recorded);
  DoubleTensor dot;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const DoubleTensor term = sum(jtu[i] * v[i]);
    dot = dot.defined() ? dot + term : term;
  }
  const DoubleTensor jv = grad(dot, {u})[0];
  INFO("largest |tangent - double vjp| " << (detail::flat(t) - detail::flat(jv)).abs().maxCoeff());
  CHECK(test::all_close(t, jv, 1e-12 * scale));
}

}  // namespace

TEST_CASE("jvp: every op's tangent rule matches central differences and the double-vjp identity, the primal keeps "
          "its bits",
          "[ops][forward_ad]") {
  test::FreshTape fresh;
  for (const Case& c : recordable_ops()) {
    INFO(c.name);
    require_tangent(c);
  }
}

TEST_CASE("jvp: the cases above reach every op registered with a tangent rule", "[ops][forward_ad]") {
  OpNames ran;
  for (const Case& c : recordable_ops()) (void)c.f(c.inputs);
  for (const std::string& op : ops_with_tangent_rules()) {
    INFO(op);
    CHECK(ran.names.count(op) == 1);
  }
}

TEST_CASE("hvp: forward-over-reverse through every op's backward equals double backward (reverse-over-reverse)",
          "[ops][forward_ad][hvp]") {
  test::FreshTape fresh;
  for (const Case& c : recordable_ops()) {
    INFO(c.name);
    Generator g(23);
    // A scalar of the op's output: ⟨f(x)², w⟩, whose Hessian sees every second partial, and
    // whose gradient at f(x) carries a tangent into the op's backward (⟨f(x), w⟩'s would not).
    const DoubleTensor w = randn<double>(c.f(c.inputs).shape(), g);
    const auto scalar = [&](const std::vector<DoubleTensor>& x) {
      const DoubleTensor y = c.f(x);
      return sum(y * y * w);
    };
    std::vector<DoubleTensor> v;
    for (const DoubleTensor& x : c.inputs) v.push_back(randn<double>(x.shape(), g));
    const auto [value, products] = hvp(scalar, c.inputs, v);
    CHECK(value.item() == scalar(c.inputs).item());

    const std::vector<DoubleTensor> reference = test::double_backward_hvp(scalar, c.inputs, v);
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      INFO("input " << i);
      const DoubleTensor& expected = reference[i];
      const double scale = 1 + detail::flat(expected).abs().maxCoeff();
      INFO("largest difference " << (detail::flat(products[i]) - detail::flat(expected)).abs().maxCoeff());
      CHECK(test::all_close(products[i], expected, 1e-12 * scale));
    }
  }
}
