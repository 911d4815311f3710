// Forward mode and Hessian-vector products through chain schedules: the states carry their
// tangents from step to step and every snapshot keeps its state's tangent beside it, so jvp and
// hvp (forward-over-reverse) run under every schedule — uniform, sqrt, binomial, budget, two-tier
// with states on disk, online — bitwise equal to the steps run plainly, dropout on.
#include <functional>
#include <memory>
#include <vector>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace chain_second_order {

/// L residual steps h + W2 tanh(W1 dropout(h) + b1) + b2, each with parameters of its own; the
/// parameters are the first 4L entries of a flat list and the chain's input the last.
struct Chain {
  std::int64_t steps = 0;
  std::vector<Tensor> primals;  // the parameters, then x
  explicit Chain(std::int64_t n) : steps(n) {
    Generator g(17);
    for (std::int64_t i = 0; i < n; ++i)
      for (const Shape& s : {Shape{12, 6}, Shape{12}, Shape{6, 12}, Shape{6}})
        primals.push_back((randn<float>(s, g) * 0.3f).detach());
    primals.push_back(randn<float>({3, 6}, g));
  }
  /// A random direction: one tensor per primal, of its shape.
  std::vector<Tensor> direction(std::uint64_t seed) const {
    Generator g(seed);
    std::vector<Tensor> out;
    for (const Tensor& p : primals) out.push_back(randn<float>(p.shape(), g));
    return out;
  }
  /// The steps reading their parameters from `p` (the duals that jvp and hvp hand f).
  static std::vector<ChainStep> step_functions(const std::vector<Tensor>& p) {
    std::vector<ChainStep> out;
    for (std::size_t i = 0; i + 4 < p.size(); i += 4)
      out.push_back([w1 = p[i], b1 = p[i + 1], w2 = p[i + 2], b2 = p[i + 3]](const Tensor& h) {
        return h + linear(tanh(linear(dropout(h, 0.2), w1, b1)), w2, b2);
      });
    return out;
  }
};

/// How the chain runs: plainly (no policy), under a policy, or as an online chain with s slots.
struct ChainPlacement {
  std::string name;
  std::optional<Policy> policy;
  std::int64_t online_slots = 0;
};

/// The chain's final state under `how`; `counts` receives what the executor did.
Tensor run(const std::vector<Tensor>& p, const ChainPlacement& how, const std::shared_ptr<ChainCounts>& counts) {
  manual_seed(5);  // the same dropout masks in every run
  const std::vector<ChainStep> steps = Chain::step_functions(p);
  if (how.policy) return checkpoint_sequential(steps, p.back(), *how.policy, nullptr, counts);
  if (how.online_slots > 0) {
    OnlineChain chain(p.back(), how.online_slots);
    for (const ChainStep& f : steps) chain.advance(f);
    return chain.finish(counts);
  }
  Tensor h = p.back();
  for (const ChainStep& f : steps) h = f(h);
  return h;
}

std::vector<ChainPlacement> placements(const Chain& c, const std::string& dir) {
  std::vector<ChainPlacement> out{{"none", policy::none(), 0},           {"uniform:3", policy::uniform(3), 0},
                             {"sqrt", policy::sqrt_segments(), 0},  {"binomial:2", policy::binomial(2), 0},
                             {"binomial:3", policy::binomial(3), 0}, {"two_tier:0,3", policy::two_tier(0, 3, dir, {0, 0}), 0},
                             {"two_tier:1,2", policy::two_tier(1, 2, dir, {0, 0}), 0}, {"online:3", std::nullopt, 3}};
  const std::vector<Tensor> params(c.primals);
  const std::vector<StepCost> costs = measure_steps(Chain::step_functions(params), params.back());
  out.push_back({"budget", policy::budget(plan(policy::none(), c.steps, &costs).peak_bytes * 2 / 3), 0});
  return out;
}

}  // namespace chain_second_order

using chain_second_order::Chain;
using chain_second_order::ChainPlacement;
using chain_second_order::run;

TEST_CASE("jvp through every chain schedule: the final state's tangent bitwise the plain loop's (dropout on), and "
          "the gradient after it too",
          "[chain][forward_ad]") {
  test::TempDir dir;
  const Chain c(7);
  const std::vector<Tensor> tangents = c.direction(3);
  // The final state, its tangent, then the gradients of sum(state²).
  const auto result = [&](const ChainPlacement& how) {
    test::FreshTape fresh;
    std::vector<Tensor> leaves;
    for (const Tensor& p : c.primals) leaves.push_back(p.detach().requires_grad_());
    auto [outputs, out_tangents] = jvp([&](const std::vector<Tensor>& p) { return run(p, how, nullptr); }, leaves,
                                       tangents);
    // Outside the dual level: the chain's backward replays without tangents.
    std::vector<Tensor> values{outputs[0], out_tangents[0]};
    for (const Tensor& gr : grad(std::vector<Tensor>{sum(pow(outputs[0], 2))}, leaves)) values.push_back(gr);
    return values;
  };
  const std::vector<Tensor> reference = result({"plain", std::nullopt, 0});
  for (const ChainPlacement& how : chain_second_order::placements(c, dir.path)) {
    INFO(how.name);
    test::require_bitwise(result(how), reference, "state, tangent, gradient");
    CHECK(dir.files().empty());  // the snapshots' files, values and tangents, are gone
  }
}

TEST_CASE("hvp through every chain schedule: forward-over-reverse bitwise the plain loop's, with the schedule's "
          "replays and snapshots (tangents kept beside the states, on disk too)",
          "[chain][forward_ad][hvp]") {
  test::TempDir dir;
  const Chain c(7);
  const std::vector<Tensor> direction = c.direction(4);
  const auto products = [&](const ChainPlacement& how, const std::shared_ptr<ChainCounts>& counts) {
    test::FreshTape fresh;
    const auto loss = [&](const std::vector<Tensor>& p) { return mean(pow(run(p, how, counts), 2)); };
    return hvp(loss, c.primals, direction).second;
  };
  const std::vector<Tensor> reference = products({"plain", std::nullopt, 0}, nullptr);
  for (const ChainPlacement& how : chain_second_order::placements(c, dir.path)) {
    INFO(how.name);
    auto counts = std::make_shared<ChainCounts>();
    test::require_bitwise(products(how, counts), reference, "H·v");
    CHECK(counts->records >= c.steps);
    CHECK(counts->rebuilt == 0);  // inside a dual level every step is recorded in full
    if (how.name == "binomial:2" || how.name == "online:3") {
      CHECK(counts->advances > 0);  // states rebuilt by replays, carrying their tangents
      CHECK(counts->peak_snapshots <= (how.name == "binomial:2" ? 2 : 3));
    }
    if (how.name.rfind("two_tier", 0) == 0) CHECK(counts->disk_writes > 0);
    CHECK(dir.files().empty());
  }
  // Against differences of gradients along the direction (float32, so loosely): the chain's
  // H·v is a Hessian-vector product, not merely the plain loop's bits.
  const auto gradient_at = [&](float t) {
    test::FreshTape fresh;
    std::vector<Tensor> at;
    for (std::size_t i = 0; i < c.primals.size(); ++i)
      at.push_back((c.primals[i] + direction[i] * t).detach().requires_grad_());
    return grad(std::vector<Tensor>{mean(pow(run(at, {"binomial:2", policy::binomial(2), 0}, nullptr), 2))}, at);
  };
  const float eps = 1e-3f;
  const std::vector<Tensor> plus = gradient_at(eps), minus = gradient_at(-eps);
  const test::Agreement a = test::against_differences(reference, plus, minus, eps);
  INFO("largest |H·v - differences| " << a.worst << " of a largest entry " << a.scale);
  CHECK(a.worst <= 2e-3 * a.scale);
}

TEST_CASE("create_graph through every chain schedule: a gradient penalty's gradients the same under every "
          "schedule, first derivatives bitwise the plain loop's, second ones to rounding",
          "[chain][higher_order]") {
  test::TempDir dir;
  const Chain c(7);
  // The gradients of mean(state²) (recorded), then those of loss + ½‖gradients‖² (dropout on).
  const auto penalty = [&](const ChainPlacement& how) {
    test::FreshTape fresh;
    std::vector<Tensor> leaves;
    for (const Tensor& p : c.primals) leaves.push_back(p.detach().requires_grad_());
    const Tensor loss = mean(pow(run(leaves, how, nullptr), 2));
    GradOptions recorded;
    recorded.create_graph = true;
    const std::vector<Tensor> g = grad(std::vector<Tensor>{loss}, leaves, {}, recorded);
    Tensor total = loss;
    for (const Tensor& gi : g) total = total + sum(gi * gi) * 0.5f;
    total.backward();
    std::pair<std::vector<Tensor>, std::vector<Tensor>> out;
    for (std::size_t i = 0; i < g.size(); ++i) {
      out.first.push_back(g[i].detach());
      out.second.push_back(leaves[i].grad());
    }
    return out;
  };
  const auto plain = penalty({"plain", std::nullopt, 0});
  std::optional<std::vector<Tensor>> first_schedule;
  for (const ChainPlacement& how : chain_second_order::placements(c, dir.path)) {
    INFO(how.name);
    const auto [g, second] = penalty(how);
    test::require_bitwise(g, plain.first, "first derivative");
    // Every schedule replays the steps connected, the same ops: the same bits.
    if (!first_schedule) first_schedule = second;
    test::require_bitwise(second, *first_schedule, "penalty gradient");
    // Against the plain loop: the part entering the chain through its output takes the chain's
    // own node, the rest the recorded replay (two sums where the plain loop has one).
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < second.size(); ++i) {
      worst = std::max(worst, double((detail::flat(second[i]) - detail::flat(plain.second[i])).abs().maxCoeff()));
      scale = std::max(scale, double(detail::flat(plain.second[i]).abs().maxCoeff()));
    }
    INFO("largest gap to the plain loop " << worst << " of a largest entry " << scale);
    CHECK(worst <= 1e-5 * scale);
    CHECK(dir.files().empty());
  }
}

TEST_CASE("create_graph through a chain whose input nothing holds any more is an error naming the chain",
          "[chain][higher_order]") {
  test::FreshTape fresh;
  Generator g(3);
  const Tensor w = randn<float>({4, 4}, g).requires_grad_();
  // Step 0's backward reads only w and its own output (tanh), never its input; under `none` no
  // snapshot of x_0 is taken, and x is a temporary.
  const ChainStep step = [&w](const Tensor& h) { return tanh(h + w); };
  Tensor y = checkpoint_sequential(step, 3, randn<float>({4, 4}, g) * 2.0f, policy::none());
  GradOptions recorded;
  recorded.create_graph = true;
  REQUIRE_ERROR(grad(std::vector<Tensor>{sum(y)}, {w}, {}, recorded), "checkpoint_sequential[none]",
                "create_graph replays the chain from its input x_0", "keep the chain's input alive");
}

TEST_CASE("a long chain holds the bookkeeping of the living tensors only: a dual level's tangents, grad()'s notes "
          "of the leaves it touched",
          "[chain][forward_ad][memory]") {
  // 5,000 steps of 3 ops each: one note per op output ever given a tangent, or per step input
  // whose gradient grad() set aside, would be 15,000 and 5,000; the living ones are a few dozen.
  Generator g(8);
  const Tensor x = randn<float>({2, 3}, g).requires_grad_(), v = randn<float>({2, 3}, g);
  std::size_t most_notes = 0;
  const ChainStep step = [&most_notes](const Tensor& h) {
    if (const detail::GradCapture* capture = detail::session().grad_capture)
      most_notes = std::max(most_notes, capture->size());
    return h + tanh(h) * 0.01f;
  };
  test::FreshTape fresh;
  dual_level level;
  const Tensor y = checkpoint_sequential(step, 5000, make_dual(x, v), policy::binomial(4));
  CHECK(tangent(y).defined());
  CHECK(detail::session().dual_level->size() < 2100);
  const std::vector<Tensor> gx = grad(sum(y), {x});
  CHECK(tangent(gx[0]).defined());
  CHECK(most_notes > 0);
  CHECK(most_notes < 2100);
  CHECK(detail::session().dual_level->size() < 2100);
}
