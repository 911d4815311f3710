// create_graph through checkpoint(): a segment's replay is recorded onto the tape being walked, so
// gradients, gradient penalties and Hessian-vector products through checkpointed segments (nested,
// selective, dropout on) equal the unchecked run's. Forward mode (jvp) through them too, and
// Hessian-vector products by forward-over-reverse (hvp). Chain schedules: chain_higher_order.test.cpp.
#include <functional>
#include <vector>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

struct Layer {
  Tensor w1, b1, w2, b2;
};

/// A residual stack of small MLP blocks with dropout: h + W2 tanh(W1 dropout(h) + b1) + b2.
struct Stack {
  std::vector<Layer> layers;
  explicit Stack(std::int64_t n) {
    Generator g(41);
    for (std::int64_t i = 0; i < n; ++i)
      layers.push_back({(randn<float>({16, 8}, g) * 0.3f).detach().requires_grad_(),
                        (randn<float>({16}, g) * 0.1f).detach().requires_grad_(),
                        (randn<float>({8, 16}, g) * 0.3f).detach().requires_grad_(),
                        (randn<float>({8}, g) * 0.1f).detach().requires_grad_()});
  }
  std::vector<Tensor> parameters() const {
    std::vector<Tensor> p;
    for (const Layer& l : layers) p.insert(p.end(), {l.w1, l.b1, l.w2, l.b2});
    return p;
  }
  static Tensor block(const Layer& l, const Tensor& h) {
    return h + linear(tanh(linear(dropout(h, 0.2), l.w1, l.b1)), l.w2, l.b2);
  }
};

enum class Placement { none, each_block, nested, selective };

Tensor forward(const Stack& s, const Tensor& x, Placement policy) {
  manual_seed(5);  // the same dropout masks in every run
  Tensor h = x;
  const auto& ls = s.layers;
  for (std::size_t i = 0; i < ls.size(); ++i) {
    // A fresh callable each time (checkpoint() holds a copy of it for the replay).
    const auto one = [&ls, i] { return [&ls, i](const Tensor& t) { return Stack::block(ls[i], t); }; };
    switch (policy) {
      case Placement::none: h = one()(h); break;
      case Placement::each_block: h = checkpoint(one(), h); break;
      case Placement::selective:
        h = checkpoint(CheckpointOptions{"block", false, save_policy::matmuls()}, one(), h);
        break;
      case Placement::nested:  // two blocks per outer segment, each block a segment inside it
        if (i % 2 == 0 && i + 1 < ls.size())
          h = checkpoint([&ls, i](const Tensor& t) {
                return checkpoint([&ls, i](const Tensor& u) { return Stack::block(ls[i + 1], u); },
                                  checkpoint([&ls, i](const Tensor& u) { return Stack::block(ls[i], u); }, t));
              },
                         h);
        else if (i % 2 == 1)
          continue;  // done by the outer segment
        else
          h = checkpoint(one(), h);
        break;
    }
  }
  return mean(pow(h, 2));
}

/// What a user of second order computes: first derivatives with a graph, a Hessian-vector product
/// of the parameters, and a gradient penalty's gradient (‖∂L/∂x‖² differentiated by the parameters).
struct SecondOrder {
  std::vector<Tensor> first, hvp, penalty;
};

SecondOrder second_order(const Stack& s, Placement policy) {
  test::FreshTape fresh;
  Generator g(9);
  Tensor x = randn<float>({4, 8}, g).requires_grad_();
  std::vector<Tensor> params = s.parameters();
  std::vector<Tensor> direction;
  for (const Tensor& p : params) direction.push_back(randn<float>(p.shape(), g));
  GradOptions recorded;
  recorded.create_graph = true;

  SecondOrder r;
  r.first = grad(std::vector<Tensor>{forward(s, x, policy)}, params, {}, recorded);
  Tensor dot;
  for (std::size_t i = 0; i < params.size(); ++i) {
    Tensor term = sum(r.first[i] * direction[i]);
    dot = dot.defined() ? dot + term : term;
  }
  r.hvp = grad(std::vector<Tensor>{dot}, params);

  const Tensor gx = grad(std::vector<Tensor>{forward(s, x, policy)}, {x}, {}, recorded)[0];
  r.penalty = grad(std::vector<Tensor>{sum(pow(gx, 2))}, params);
  return r;
}

/// Equal within `relative` of the largest reference entry (0: bit for bit).
void require_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const char* what, double relative = 0) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(what << " " << i);
    if (relative == 0) {
      CHECK(a[i].to_vector() == b[i].to_vector());
      continue;
    }
    const double scale = detail::flat(b[i]).abs().maxCoeff();
    INFO("largest difference " << (detail::flat(a[i]) - detail::flat(b[i])).abs().maxCoeff() << " of a largest entry "
                               << scale);
    CHECK(test::all_close(a[i], b[i], relative * scale));
  }
}

}  // namespace

// First derivatives are bitwise the unchecked run's. Second-order ones agree to float rounding,
// not bit for bit: the second walk follows the tape's order, in which a segment's recorded replay
// sits after the nodes that consume its output, so the part of the second-order gradient that
// enters the segment through its output goes through the original segment node (replayed again,
// at first order) and the part that enters through its activations through the recorded replay:
// two sums where the unchecked run has one.
TEST_CASE("create_graph through checkpoint(): first derivatives bitwise, HVPs and a gradient penalty to rounding, "
          "of the unchecked run's (per block, nested, selective, dropout on)",
          "[checkpoint][higher_order]") {
  const Stack s(4);
  const SecondOrder reference = second_order(s, Placement::none);
  for (Placement p : {Placement::each_block, Placement::nested, Placement::selective}) {
    INFO("placement " << static_cast<int>(p));
    const SecondOrder r = second_order(s, p);
    require_equal(r.first, reference.first, "first derivative");
    require_equal(r.hvp, reference.hvp, "Hessian-vector product", 1e-5);
    require_equal(r.penalty, reference.penalty, "gradient penalty's gradient", 1e-5);
  }
}

TEST_CASE("create_graph through checkpoint(): the HVP matches differences of gradients", "[checkpoint][higher_order]") {
  // In float: the check is that the recorded replay is the right graph (a missing path would be
  // off by a whole term), not the last digits.
  const Stack s(2);
  const SecondOrder r = second_order(s, Placement::each_block);
  Generator g(9);
  const Tensor x = randn<float>({4, 8}, g);
  std::vector<Tensor> params = s.parameters(), direction;
  for (const Tensor& p : params) direction.push_back(randn<float>(p.shape(), g));
  const float eps = 1e-2f;
  const auto shifted = [&](float sign) {
    Stack moved(0);
    for (const Layer& l : s.layers) {
      const std::size_t k = moved.layers.size() * 4;
      auto at = [&](const Tensor& t, std::size_t j) { return (t.detach() + direction[k + j] * (sign * eps)).detach().requires_grad_(); };
      moved.layers.push_back({at(l.w1, 0), at(l.b1, 1), at(l.w2, 2), at(l.b2, 3)});
    }
    test::FreshTape fresh;
    return grad(std::vector<Tensor>{forward(moved, x, Placement::none)}, moved.parameters());
  };
  const test::Agreement a = test::against_differences(r.hvp, shifted(1), shifted(-1), eps);
  INFO("largest |HVP - differences| " << a.worst << " of a largest entry " << a.scale);
  CHECK(a.worst <= 1e-2 * a.scale);  // central differences in float, step 1e-2: about 0.4% here
}

namespace {

struct GptSecondOrder {
  std::vector<Tensor> first, hvp;
};

/// A GPT's gradients with a graph and the Hessian-vector product along `direction`, its blocks
/// checkpointed as `how` says, dropout drawn from the same seed each time.
GptSecondOrder gpt_second_order(nn::GPT& gpt, const Checkpointing& how, const LongTensor& idx, const LongTensor& targets,
                                const std::vector<Tensor>& direction) {
  apply_checkpointing(gpt, how);
  test::FreshTape fresh;
  manual_seed(5);
  std::vector<Tensor> params;
  for (Tensor* p : gpt.parameters()) params.push_back(*p);
  GradOptions recorded;
  recorded.create_graph = true;
  GptSecondOrder r;
  r.first = grad(std::vector<Tensor>{gpt.loss(idx, targets)}, params, {}, recorded);
  Tensor dot;
  for (std::size_t i = 0; i < params.size(); ++i) {
    Tensor term = sum(r.first[i] * direction[i]);
    dot = dot.defined() ? dot + term : term;
  }
  r.hvp = grad(std::vector<Tensor>{dot}, params);
  apply_checkpointing(gpt, Checkpointing::none());
  return r;
}

}  // namespace

TEST_CASE("create_graph through a whole GPT with dropout: per block and selective checkpointing give the unchecked "
          "run's first derivatives bitwise and its HVP to rounding, the HVP matches differences of gradients",
          "[checkpoint][higher_order][gpt]") {
  Generator init(4);
  nn::GPT gpt(test::small_gpt(2, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  std::vector<Tensor> direction;
  for (Tensor* p : gpt.parameters()) direction.push_back(randn<float>(p->shape(), init));

  const GptSecondOrder reference = gpt_second_order(gpt, Checkpointing::none(), idx, targets, direction);
  for (const Checkpointing& how : {Checkpointing::each_block(), Checkpointing::each_block(save_policy::matmuls())}) {
    INFO(how.name);
    const GptSecondOrder r = gpt_second_order(gpt, how, idx, targets, direction);
    require_equal(r.first, reference.first, "first derivative");
    require_equal(r.hvp, reference.hvp, "Hessian-vector product", 1e-5);
  }

  // Central differences of gradients along the direction, in float: the recorded backward is the
  // right graph (a missing path would be off by a whole term), not the last digits. The direction
  // moves every weight by its own N(0, 1) times eps, large beside GPT-2's 0.02-scale weights: at
  // 1e-3 the curvature's own change already costs 3% (v·Hv 348.6 against 360.1); 1e-4 is within 0.1%.
  const float eps = 1e-4f;
  const auto gradient_at = [&](float sign) {
    const std::vector<Tensor*> params = gpt.parameters();
    std::vector<Tensor> saved;
    for (std::size_t i = 0; i < params.size(); ++i) {
      saved.push_back(*params[i]);
      *params[i] = (params[i]->detach() + direction[i] * (sign * eps)).detach().requires_grad_();
    }
    test::FreshTape fresh;
    manual_seed(5);
    std::vector<Tensor> now;
    for (Tensor* p : params) now.push_back(*p);
    std::vector<Tensor> g = grad(std::vector<Tensor>{gpt.loss(idx, targets)}, now);
    for (std::size_t i = 0; i < params.size(); ++i) *params[i] = saved[i];
    return g;
  };
  const test::Agreement a = test::against_differences(reference.hvp, gradient_at(1), gradient_at(-1), eps);
  INFO("largest |HVP - differences| " << a.worst << " of a largest entry " << a.scale);
  CHECK(a.worst <= 1e-2 * a.scale);
}

TEST_CASE("jvp through checkpoint(): tangents bitwise the unchecked run's (per block, nested, selective, dropout "
          "on), and the backward after it as well",
          "[checkpoint][forward_ad]") {
  const Stack s(4);
  Generator g(9);
  const Tensor x = randn<float>({4, 8}, g).requires_grad_();
  std::vector<Tensor> primals = s.parameters(), tangents;
  primals.push_back(x);
  for (const Tensor& p : primals) tangents.push_back(randn<float>(p.shape(), g));
  struct Run {
    Tensor y, tangent;
    std::vector<Tensor> grads;
  };
  const auto run = [&](Placement policy) {
    test::FreshTape fresh;
    Stack duals(0);  // the segments read their layers in the replays of the backward below
    const auto f = [&](const std::vector<Tensor>& p) {
      for (std::size_t i = 0; i + 4 < p.size(); i += 4) duals.layers.push_back({p[i], p[i + 1], p[i + 2], p[i + 3]});
      return forward(duals, p.back(), policy);
    };
    auto [outputs, out_tangents] = jvp(f, primals, tangents);
    // Outside the dual level now: the segments replay without tangents, at the same positions.
    return Run{outputs[0], out_tangents[0], grad(std::vector<Tensor>{outputs[0]}, primals)};
  };
  const Run reference = run(Placement::none);
  for (Placement p : {Placement::each_block, Placement::nested, Placement::selective}) {
    INFO("placement " << static_cast<int>(p));
    const Run r = run(p);
    CHECK(r.y.to_vector() == reference.y.to_vector());
    CHECK(r.tangent.to_vector() == reference.tangent.to_vector());
    require_equal(r.grads, reference.grads, "gradient after jvp");
  }
}

TEST_CASE("hvp through checkpoint(): forward-over-reverse per block, nested and selective with dropout equals the "
          "unchecked run's bit for bit, and double backward to rounding",
          "[checkpoint][forward_ad][hvp]") {
  const Stack s(4);
  Generator g(9);
  const Tensor x = randn<float>({4, 8}, g);
  const std::vector<Tensor> params = s.parameters();
  std::vector<Tensor> direction;
  for (const Tensor& p : params) direction.push_back(randn<float>(p.shape(), g));
  const auto products = [&](Placement policy) {
    test::FreshTape fresh;
    Stack duals(0);  // read by the segments' replays during hvp's backward
    const auto loss = [&](const std::vector<Tensor>& p) {
      duals.layers.clear();
      for (std::size_t i = 0; i < p.size(); i += 4) duals.layers.push_back({p[i], p[i + 1], p[i + 2], p[i + 3]});
      return forward(duals, x, policy);
    };
    return hvp(loss, params, direction).second;
  };
  const std::vector<Tensor> reference = products(Placement::none);
  require_equal(reference, second_order(s, Placement::none).hvp, "forward-over-reverse against double backward", 1e-5);
  for (Placement p : {Placement::each_block, Placement::nested, Placement::selective}) {
    INFO("placement " << static_cast<int>(p));
    require_equal(products(p), reference, "hvp through checkpoint()");
  }
}

TEST_CASE("hvp through a whole GPT with dropout, per block and selective: forward-over-reverse equals the unchecked "
          "run's bitwise and double backward to rounding",
          "[checkpoint][forward_ad][hvp][gpt]") {
  Generator init(4);
  nn::GPT gpt(test::small_gpt(2, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  std::vector<Tensor> params, direction;
  for (Tensor* p : gpt.parameters()) {
    params.push_back(*p);
    direction.push_back(randn<float>(p->shape(), init));
  }
  const auto products = [&](const Checkpointing& how) {
    apply_checkpointing(gpt, how);
    test::FreshTape fresh;
    const std::vector<Tensor*> slots = gpt.parameters();
    const auto loss = [&](const std::vector<Tensor>& p) {
      for (std::size_t i = 0; i < p.size(); ++i) *slots[i] = p[i];  // the model computes with the duals
      manual_seed(5);
      return gpt.loss(idx, targets);
    };
    std::vector<Tensor> hv = hvp(loss, params, direction).second;
    for (std::size_t i = 0; i < params.size(); ++i) *slots[i] = params[i];
    apply_checkpointing(gpt, Checkpointing::none());
    return hv;
  };
  const std::vector<Tensor> reference = products(Checkpointing::none());
  require_equal(reference, gpt_second_order(gpt, Checkpointing::none(), idx, targets, direction).hvp,
                "forward-over-reverse against double backward", 1e-5);
  for (const Checkpointing& how : {Checkpointing::each_block(), Checkpointing::each_block(save_policy::matmuls())}) {
    INFO(how.name);
    require_equal(products(how), reference, "GPT hvp through checkpoint()");
  }
}
