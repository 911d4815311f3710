// Forward mode's mechanics (core/forward_ad.hpp): dual levels, make_dual and tangent(), jvp's
// contract and its bad input, the refusal of an op without a tangent rule, gradients through a
// dual tensor, and tangent rules unseen by observers. Each op's rule is checked in
// tests/ops/higher_order.test.cpp.
#include <string>
#include <vector>

#include "support.hpp"

using namespace remat;

TEST_CASE("dual_level: tangents live inside it and are cleared when it ends, levels do not nest",
          "[core][forward_ad]") {
  Generator g(1);
  const DoubleTensor x = randn<double>({3, 4}, g), v = randn<double>({3, 4}, g);
  DoubleTensor y;
  {
    dual_level level;
    const DoubleTensor dual = make_dual(x, v);
    CHECK(tangent(dual).to_vector() == v.to_vector());
    CHECK_FALSE(tangent(x).defined());  // the primal itself carries none
    y = exp(dual) * 2.0;
    REQUIRE(tangent(y).defined());
    CHECK(test::all_close(tangent(y), exp(x) * v * 2.0, 1e-15));
    REQUIRE_ERROR(dual_level(), "already open");
    REQUIRE_ERROR(make_dual(dual, v), "already has a tangent");
  }
  CHECK_FALSE(tangent(y).defined());
  REQUIRE_ERROR(make_dual(x, v), "no dual level is open");
  // Outside a level no op computes a tangent, dual or not: the same bits as ever.
  CHECK(exp(x).to_vector() == exp(x.detach()).to_vector());
}

TEST_CASE("jvp: outputs, zero tangents for outputs that do not depend on the primals, bad input named",
          "[core][forward_ad]") {
  Generator g(2);
  const DoubleTensor a = randn<double>({2, 3}, g), b = randn<double>({3, 2}, g);
  const DoubleTensor ta = randn<double>({2, 3}, g), tb = randn<double>({3, 2}, g);
  const DoubleTensor unrelated = randn<double>({4}, g);
  const auto [outs, tangents] = jvp(
      [&](const std::vector<DoubleTensor>& p) { return std::vector<DoubleTensor>{matmul(p[0], p[1]), unrelated * 2.0}; },
      std::vector<DoubleTensor>{a, b}, std::vector<DoubleTensor>{ta, tb});
  REQUIRE(outs.size() == 2);
  CHECK(test::all_close(tangents[0], matmul(ta, b) + matmul(a, tb), 1e-14));
  CHECK(tangents[1].to_vector() == std::vector<double>(4, 0.0));
  // One tensor in, one out.
  const auto [y, ty] = jvp([](const DoubleTensor& x) { return tanh(x); }, a, ta);
  CHECK(test::all_close(ty, ta * (1.0 - tanh(a) * tanh(a)), 1e-15));
  CHECK(y.to_vector() == tanh(a).to_vector());

  REQUIRE_ERROR(jvp([](const DoubleTensor& x) { return x; }, a, tb), "jvp: tangent 0 has shape (3, 2), its primal (2, 3)");
  REQUIRE_ERROR((jvp([](const std::vector<DoubleTensor>& p) { return p[0]; }, std::vector<DoubleTensor>{a, b},
                     std::vector<DoubleTensor>{ta})),
                "jvp: 2 primals but 1 tangents");
}

TEST_CASE("jvp: an op without a tangent rule is an error naming it, never a dropped tangent", "[core][forward_ad]") {
  Generator g(3);
  const Tensor x = randn<float>({4}, g), v = randn<float>({4}, g);
  REQUIRE_ERROR(jvp([](const Tensor& t) { return test::unrecordable_square(t * 2.0f); }, x, v), "unrecordable_square",
                "no tangent rule", "mul_scalar");
  // Without a tangent among its inputs, the op runs as ever inside a level.
  dual_level level;
  CHECK(test::unrecordable_square(x).to_vector() == (x * x).to_vector());
}

TEST_CASE("make_dual: gradients pass through the dual to its primal, the tangent rides along the graph",
          "[core][forward_ad]") {
  Generator g(4);
  const DoubleTensor w = randn<double>({3, 3}, g).requires_grad_();
  const DoubleTensor v = randn<double>({3, 3}, g);
  DoubleTensor plain_grad;
  {
    const DoubleTensor w2 = w.detach().requires_grad_();
    sum(pow(tanh(w2), 2)).backward();
    plain_grad = w2.grad();
  }
  {
    dual_level level;
    const DoubleTensor dual = make_dual(w, v);
    const DoubleTensor loss = sum(pow(tanh(dual), 2));
    CHECK(tangent(loss).defined());
    loss.backward();
  }
  CHECK(w.grad().to_vector() == plain_grad.to_vector());
}

namespace {

class OpNames : public Observer {
 public:
  void op(const OpOutput& out, const OpValues&) override { names.push_back(out.op.name()); }
  std::vector<std::string> names;
};

}  // namespace

TEST_CASE("jvp: tangent rules compute unseen, so observers and scopes hear the primal ops only",
          "[core][forward_ad]") {
  Generator g(5);
  const Tensor x = randn<float>({2, 8}, g), w = randn<float>({4, 8}, g), v = randn<float>({2, 8}, g);
  const auto f = [&](const Tensor& t) { return softmax(linear(tanh(t), w)); };
  OpNames plain;
  const Tensor y = f(x);
  const std::vector<std::string> expected = plain.names;
  plain.names.clear();
  const auto [out, tout] = jvp(f, x, v);
  CHECK(plain.names == expected);
  CHECK(out.to_vector() == y.to_vector());
  CHECK(tout.defined());
}

TEST_CASE("hvp: forward-over-reverse matches the analytic Hessian, unused inputs get zeros, bad input named",
          "[core][forward_ad][hvp]") {
  Generator g(6);
  const DoubleTensor x = randn<double>({4}, g), v = randn<double>({4}, g), unused = randn<double>({2}, g);
  // f = Σ x³ / 3 + (Σ x)²: H = diag(2x) + 2·11ᵀ, so H v = 2 x ⊙ v + 2 Σv.
  const auto f = [](const std::vector<DoubleTensor>& p) { return sum(pow(p[0], 3)) / 3.0 + pow(sum(p[0]), 2); };
  const auto [y, products] =
      hvp(f, std::vector<DoubleTensor>{x, unused}, std::vector<DoubleTensor>{v, randn<double>({2}, g)});
  CHECK(y.item() == f({x}).item());
  CHECK(test::all_close(products[0], x * v * 2.0 + sum(v).item() * 2.0, 1e-14));
  CHECK(products[1].to_vector() == std::vector<double>(2, 0.0));
  CHECK_FALSE(x.requires_grad());  // the inputs are left as they were
  // After hvp no tangent is left anywhere, and a plain backward is first order again.
  const DoubleTensor w = x.detach().requires_grad_();
  f({w}).backward();
  CHECK(test::all_close(w.grad(), x * x + sum(x).item() * 2.0, 1e-14));

  REQUIRE_ERROR(hvp([](const DoubleTensor& t) { return t * 2.0; }, x, v), "hvp: f must return one element, got shape (4,)");
  REQUIRE_ERROR(hvp([](const DoubleTensor& t) { return sum(t); }, x, unused), "hvp: direction 0 has shape (2,), its input (4,)");
}

namespace {

/// The live bytes as the walk reaches its first node.
class LiveAtFirstNode : public Observer {
 public:
  void backward_op(const char*) override {
    if (!seen) live = memory_stats().live_bytes;
    seen = true;
  }
  std::size_t live = 0;
  bool seen = false;
};

/// y = x with a backward that asks for its input's tangent through a gradient it did not save: a
/// node that reads a tangent without saving anything, which the tangent books cannot tell.
Tensor identity_reading_unsaved_tangent(const Tensor& x) {
  static const OpId id = register_op("identity_reading_unsaved_tangent", tangent_rule);
  Tensor y = detail::produce<float>(id, x.shape(), 0.0, {x}, [=] { return detail::copy_of(x); });
  if (detail::grad_needed(x))
    detail::record<float>(id, {x}, {&y}, {}, [](detail::BackwardContext<float>& ctx) {
      if (ctx.create_graph()) return ctx.accumulate(0, ctx.as_input(0, ctx.grad_output()) * 1.0f);
      ctx.accumulate(0, ctx.grad_output());
    });
  detail::push_tangent(y, [](const Tensor& t) { return t; }, x);
  return y;
}

}  // namespace

// A backward inside a dual level reads a tangent only through a node that saved something: the
// tangents of intermediates held by nodes that save nothing (a scaled copy summed into a residual)
// go before the walk, not when their producers' backward runs.
TEST_CASE("hvp: tangents no backward reads are dropped before the walk, a read of one after all is an error",
          "[core][forward_ad][hvp]") {
  test::FreshTape fresh;
  Generator g(3);
  const std::int64_t n = 1 << 14;
  const Tensor x = randn<float>({n}, g), v = randn<float>({n}, g);
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(float);
  const auto run = [&](bool keep_handles) {
    dual_level level;
    const Tensor leaf = x.detach().requires_grad_();
    const Tensor dual = make_dual(leaf, v);
    std::vector<Tensor> kept;
    Tensor s = tanh(dual);  // tanh saves its output: its tangent is read
    for (int k = 1; k <= 4; ++k) {
      Tensor h = dual * static_cast<float>(k);  // saves nothing; the sum below saves nothing either
      if (keep_handles) kept.push_back(h);
      s = s + h;
    }
    const Tensor y = sum(tanh(s));
    const auto before = static_cast<long long>(memory_stats().live_bytes);
    LiveAtFirstNode watch;
    const Tensor gx = grad(y, {leaf})[0];
    REQUIRE(detail::has_tangent(gx));
    return std::make_pair(before - static_cast<long long>(watch.live), detail::tangent_of(gx).to_vector());
  };
  const auto [freed, hv] = run(false);
  const auto [freed_kept, hv_kept] = run(true);
  // Four scaled copies and their sums' tangents, n floats each, none read by a backward.
  CHECK(freed >= static_cast<long long>(4 * bytes));
  CHECK(freed_kept < freed);  // a tangent a user's handle can reach stays
  CHECK(hv == hv_kept);

  dual_level level;
  const Tensor leaf = x.detach().requires_grad_();
  const Tensor y = sum(tanh(identity_reading_unsaved_tangent(make_dual(leaf, v) * 2.0f)));
  REQUIRE_ERROR(grad(y, {leaf}), "tangent", "dropped", "must save something");
}

// An input that needs no gradient may still carry a tangent (a constant made dual): a backward
// inside the level carries it into the gradients' tangents as any other.
TEST_CASE("backward inside a dual level: a tangent on an input that needs no gradient reaches the gradients' "
          "tangents",
          "[core][forward_ad]") {
  test::FreshTape fresh;
  Generator g(5);
  const DoubleTensor x0 = randn<double>({6}, g), v = randn<double>({6}, g), w0 = randn<double>({6}, g);
  // gw = ∂/∂w Σ tanh(w x) = x (1 − tanh²(w x)); along x + εv it moves by d/dε at ε = 0.
  const auto gradient_at = [&](const DoubleTensor& x) {
    const DoubleTensor w = detail::copy_of(w0).requires_grad_();
    return grad(sum(tanh(w * x)), {w})[0];
  };
  const double eps = 1e-6;
  const DoubleTensor differences = (gradient_at(x0 + v * eps) - gradient_at(x0 - v * eps)) / (2 * eps);
  dual_level level;
  const DoubleTensor w = detail::copy_of(w0).requires_grad_();
  const DoubleTensor gw = grad(sum(tanh(w * make_dual(x0, v))), {w})[0];
  REQUIRE(detail::has_tangent(gw));
  CHECK(test::all_close(detail::tangent_of(gw), differences, 1e-6));
}
