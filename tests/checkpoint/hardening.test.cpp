#include <set>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// CHECKs that `loss_of(x, checkpointed)`, from a fresh leaf x holding `data`, gives x bitwise the
/// same gradient plain and checkpointed (`what`: the pattern, in the failure's message).
template <class LossOf>
void check_input_grad(const char* what, const Tensor& data, LossOf loss_of) {
  auto run = [&](bool checkpointed) {
    return [&, checkpointed] {
      Tensor x = data.detach().requires_grad_();
      loss_of(x, checkpointed).backward();
      return testing::RunRecord().grad("x", x);
    };
  };
  INFO(what);
  CHECK_SAME_RUNS(run(false), run(true));
}

}  // namespace

TEST_CASE("checkpoint: an input shared with the rest of the graph gets bitwise the same gradient",
          "[checkpoint][bitwise][shared]") {
  auto f = [](const Tensor& a) { return a * a * 3.0f + exp(a); };        // reads its input more than once
  auto g = [](const Tensor& a, const Tensor& b) { return a * b + exp(a) * 0.5f; };
  for (std::uint64_t seed = 0; seed < 40; ++seed) {
    Generator gen(seed);
    const Tensor data = randn({7, 9}, gen);
    auto seg = [&](const Tensor& x, bool ck) { return ck ? checkpoint(f, x) : f(x); };
    INFO("seed " << seed);
    check_input_grad("used after the segment", data,
                     [&](const Tensor& x, bool ck) { return sum(seg(x, ck)) + sum(x * 5.0f); });
    check_input_grad("used before it", data, [&](const Tensor& x, bool ck) {
      const Tensor before = x * 5.0f;
      return sum(before) + sum(seg(x, ck));
    });
    check_input_grad("passed twice", data,
                     [&](const Tensor& x, bool ck) { return sum(ck ? checkpoint(g, x, x) : g(x, x)); });
    check_input_grad("a non-leaf input, the residual pattern y = h + block(h)", data, [&](const Tensor& x, bool ck) {
      const Tensor h = x * 1.5f;
      return sum(h + seg(h, ck)) + sum(h * h);
    });
    check_input_grad("nested segments sharing the input", data, [&](const Tensor& x, bool ck) {
      auto outer = [&seg, ck](const Tensor& a) { return seg(a, ck) + a; };
      // a temporary, so checkpoint holds it by value: the segment replays after we have returned
      return sum(ck ? checkpoint(decltype(outer)(outer), x) : outer(x)) + sum(exp(x));
    });
  }
}

TEST_CASE("checkpoint_sequential: a chain input shared with the rest of the graph gets bitwise the same gradient",
          "[checkpoint][bitwise][shared][chain]") {
  const ChainStep step = [](const Tensor& a) { return tanh(a) * a + a * 0.5f; };
  const std::vector<ChainStep> steps(9, step);
  for (const Policy& p : {policy::none(), policy::uniform(2), policy::sqrt_segments(), policy::binomial(2),
                          policy::binomial(3)}) {
    for (std::uint64_t seed = 0; seed < 10; ++seed) {
      Generator gen(seed);
      const Tensor data = randn({4, 6}, gen);
      auto loss_of = [&](const Tensor& x, bool ck) {
        const Tensor h = x * 1.25f;
        Tensor y = h;
        if (ck) y = checkpoint_sequential(steps, h, p);
        else for (const ChainStep& s : steps) y = s(y);
        return sum(y) + sum(h * 3.0f) + sum(exp(x));
      };
      INFO(p.name << " seed " << seed);
      check_input_grad("a chain input shared with the rest of the graph", data, loss_of);
    }
  }
}

TEST_CASE("checkpoint: an output that reaches no loss gives no gradient, not a zero one", "[checkpoint][grad]") {
  Generator init(3);
  nn::Linear used(4, 4, true, init), unused(4, 4, true, init);
  const Tensor x = randn({2, 4}, init);
  auto fn = [&](const Tensor& h) { return std::make_tuple(used(h), unused(h)); };
  for (const bool ck : {false, true}) {
    used.zero_grad();
    unused.zero_grad();
    auto [a, b] = ck ? checkpoint(fn, x) : fn(x);
    sum(a).backward();
    INFO("checkpointed: " << ck);
    CHECK(used.weight.grad().defined());
    CHECK_FALSE(unused.weight.grad().defined());
    CHECK_FALSE(unused.bias.grad().defined());
  }
}

TEST_CASE("checkpoint_sequential: a step that ignores its input passes no gradient back", "[checkpoint][grad][chain]") {
  Generator init(4);
  nn::Linear first(3, 3, true, init), second(3, 3, true, init);
  const Tensor c = randn({2, 3}, init);
  const std::vector<ChainStep> steps{[&](const Tensor& h) { return first(h); }, [&](const Tensor&) { return second(c); }};
  for (const Policy& p : {policy::none(), policy::binomial(1)}) {
    first.zero_grad();
    second.zero_grad();
    sum(checkpoint_sequential(steps, randn({2, 3}, init).requires_grad_(), p)).backward();
    INFO(p.name);
    CHECK(second.weight.grad().defined());
    CHECK_FALSE(first.weight.grad().defined());
  }
}

TEST_CASE("checkpoint and chains: a tensor computed before them and held only by their function gets its gradient "
          "through to what it was computed from, and none from a budget's measuring",
          "[checkpoint][grad][chain]") {
  // The function is the only holder of w·2 once the forward returns: its node must not die with
  // the segment's (or chain's) node, before the walk reaches the op that made it.
  Generator init(6);
  const Tensor w0 = randn({3, 3}, init), x0 = randn({2, 3}, init);
  enum class How { plain, checkpoint, none, binomial, budget, online };
  const auto gradient = [&](How how) {
    test::FreshTape fresh;
    Tensor w = w0.detach().requires_grad_(), x = x0.detach().requires_grad_();
    Tensor y;
    {
      const Tensor scaled = w * 2.0f;  // computed, not a leaf; goes out of scope here
      const ChainStep step = [scaled](const Tensor& h) { return tanh(matmul(h, scaled)); };
      const std::vector<ChainStep> steps(3, step);
      switch (how) {
        case How::plain: y = step(step(step(x))); break;
        case How::checkpoint: y = checkpoint(step, checkpoint(step, checkpoint(step, x))); break;
        case How::none: y = checkpoint_sequential(steps, x, policy::none()); break;
        case How::binomial: y = checkpoint_sequential(steps, x, policy::binomial(1)); break;
        // Measuring the steps runs a dry backward: what it sends to w·2 must stay there.
        case How::budget: y = checkpoint_sequential(steps, x, policy::budget(std::size_t{1} << 20)); break;
        case How::online: {
          OnlineChain chain(x, 2);
          for (int i = 0; i < 3; ++i) chain.advance(step);
          y = chain.finish();
          break;
        }
      }
    }
    sum(y).backward();
    REQUIRE(w.grad().defined());
    return std::vector<std::vector<float>>{w.grad().to_vector(), x.grad().to_vector()};
  };
  const auto reference = gradient(How::plain);
  for (How how : {How::checkpoint, How::none, How::binomial, How::budget, How::online}) {
    INFO("placement " << static_cast<int>(how));
    CHECK(gradient(how) == reference);
  }
}

TEST_CASE("checkpoint_sequential: replays are checked like checkpoint()'s", "[checkpoint][chain][misuse]") {
  int calls = 0;
  // The first execution of step 1 returns (2, 4); any later one (a replay) returns (2, 3).
  const ChainStep shifting = [&](const Tensor& h) {
    return ++calls == 1 ? cat(std::vector<Tensor>{h, narrow(h, 1, 0, 1)}, 1) : h * 1.0f;
  };
  const ChainStep plain = [](const Tensor& h) { return h * 2.0f; };
  for (const Policy& p : {policy::uniform(3), policy::binomial(2), policy::sqrt_segments()}) {
    calls = 0;
    const std::vector<ChainStep> steps{plain, shifting, [](const Tensor& h) { return narrow(h, 1, 0, 3); }, plain, plain};
    Tensor y = checkpoint_sequential(steps, randn({2, 3}).requires_grad_(), p);
    INFO(p.name);
    REQUIRE_ERROR(sum(y).backward(), "checkpoint_sequential", "step 1 of 5", "(2, 3)", "(2, 4)");
  }
  // Values drift: caught in checking mode.
  float scale = 1.0f;
  const ChainStep drifting = [&](const Tensor& h) { return h * (scale += 1.0f); };
  {
    CheckpointChecking checking;
    Tensor y = checkpoint_sequential({plain, drifting, plain}, randn({2, 3}).requires_grad_(), policy::binomial(1));
    REQUIRE_ERROR(sum(y).backward(), "step 1 of 3", "different values");
  }
  REQUIRE_ERROR(checkpoint_sequential({plain, ChainStep(), plain}, randn({2, 3}), policy::none()), "step 1 of 3",
                "empty function");
}

TEST_CASE("checkpoint_sequential inside checkpoint(): the segment's forward records nothing", "[checkpoint][chain][memory]") {
  test::FreshTape fresh;
  Generator init(5);
  Tensor w = (randn({128, 128}, init) * 0.05f).detach().requires_grad_();
  const ChainStep cell = [&](const Tensor& h) { return tanh(matmul(h, w)); };
  const std::vector<ChainStep> steps(24, cell);
  Tensor x = randn({8, 128}, init).requires_grad_();
  auto inner = [&](const Tensor& h) { return checkpoint_sequential(steps, h, policy::none()); };

  auto run = [&](bool checkpointed) {
    x.zero_grad();
    w.zero_grad();
    Tensor y;
    if (checkpointed) {
      const std::size_t before = memory_stats().saved_bytes;
      MemoryScope scope;
      y = checkpoint(inner, x);
      CHECK(scope.peak_saved_bytes() - before == x.nbytes());  // the boundary, nothing else, at any moment
    } else {
      y = inner(x);
    }
    sum(y).backward();
    return testing::RunRecord().grad("x", x).grad("w", w);
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
}

TEST_CASE("measure_steps: costs are deterministic, so plans are the same on every run", "[checkpoint][chain][budget]") {
  Generator init(6);
  Tensor w = (randn({32, 32}, init) * 0.1f).detach().requires_grad_();
  std::vector<ChainStep> steps;
  for (int i = 0; i < 12; ++i) {
    const int repeats = 1 + i % 3;  // unequal steps: 1, 2 or 3 products
    steps.push_back([&w, repeats](const Tensor& h) {
      Tensor y = h;
      for (int r = 0; r < repeats; ++r) y = tanh(matmul(y, w));
      return y;
    });
  }
  const Tensor x = randn({8, 32}, init);
  const std::vector<StepCost> a = measure_steps(steps, x), b = measure_steps(steps, x);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].compute == b[i].compute);
    CHECK(a[i].activation_bytes == b[i].activation_bytes);
  }
  CHECK(a[2].compute == 3 * a[0].compute);  // flops, not seconds: three products cost three times one
  CHECK_FALSE(w.grad().defined());          // the dry-run backward gave the parameter no gradient
  const Plan p1 = plan(policy::budget(60'000), 12, a), p2 = plan(policy::budget(60'000), 12, b);
  CHECK(p1.materialise() == p2.materialise());
}

TEST_CASE("budget: a chain whose steps contain checkpoint() stays within its budget, replays included",
          "[checkpoint][chain][budget]") {
  Generator init(7);
  Tensor w1 = (randn({64, 64}, init) * 0.1f).detach().requires_grad_();
  Tensor w2 = (randn({64, 64}, init) * 0.1f).detach().requires_grad_();
  auto block = [&](const Tensor& h) { return tanh(matmul(tanh(matmul(h, w1)), w2)) + h; };
  const ChainStep step = [&](const Tensor& h) { return checkpoint(block, h); };
  const std::vector<ChainStep> steps(8, step);
  const Tensor x = randn({16, 64}, init).requires_grad_();
  const std::vector<StepCost> costs = measure_steps(steps, x);
  // Inside the step only the boundary is saved in forward; its replay holds the block's activations.
  CHECK(costs[0].activation_bytes > x.nbytes());
  int feasible = 0;
  for (const std::size_t budget : {std::size_t{40'000}, std::size_t{60'000}, std::size_t{100'000}, std::size_t{200'000}}) {
    Plan p;
    try {
      p = plan(policy::budget(budget), 8, costs);
    } catch (const Error&) {
      continue;  // below what this chain needs
    }
    ++feasible;
    const std::size_t before = memory_stats().saved_bytes;
    MemoryScope scope;
    sum(checkpoint_sequential(steps, x, policy::budget(budget), &costs)).backward();
    INFO("budget " << budget << ", plan peak " << p.peak_bytes);
    CHECK(scope.peak_saved_bytes() - before <= budget);
  }
  CHECK(feasible >= 2);
}

TEST_CASE("checkpoint_sequential: retain_graph and repeated backward under every policy", "[checkpoint][chain][retain]") {
  Generator init(8);
  Tensor w = (randn({6, 6}, init) * 0.3f).detach().requires_grad_();
  const ChainStep step = [&](const Tensor& h) { return tanh(matmul(dropout(h, 0.2), w)) + h; };
  const std::vector<ChainStep> steps(7, step);
  const Tensor data = randn({3, 6}, init);
  auto grads = [&](const Tensor& x) { return std::make_pair(x.grad().to_vector(), w.grad().to_vector()); };
  // The reference: the plain steps, one backward.
  manual_seed(4);
  Tensor x0 = data.detach().requires_grad_();
  Tensor h = x0;
  for (const ChainStep& s : steps) h = s(h);
  Tensor plain_loss = sum(h);
  plain_loss.backward(true);
  const auto plain = grads(x0);
  plain_loss.backward();  // a second backward accumulates onto the first
  const auto plain_twice = grads(x0);
  for (const Policy& p : {policy::none(), policy::uniform(2), policy::sqrt_segments(), policy::binomial(1),
                          policy::binomial(2), policy::binomial(3)}) {
    INFO(p.name);
    w.zero_grad();
    manual_seed(4);
    Tensor x = data.detach().requires_grad_();
    Tensor loss = sum(checkpoint_sequential(steps, x, p));
    loss.backward(true);
    CHECK(grads(x) == plain);
    x.zero_grad();
    w.zero_grad();
    loss.backward(true);  // the same graph again
    CHECK(grads(x) == plain);
    loss.backward();  // accumulates on top, then frees
    CHECK(grads(x) == plain_twice);
    REQUIRE_ERROR(loss.backward(), "already been freed");
  }
}

TEST_CASE("online chains advanced alternately: where the bitwise promise stops, exactly", "[chain][online][bitwise]") {
  // Two OnlineChains advanced in turn. Each reads its own Linear and both read `shared`. The
  // plain program adds a parameter's contributions in reverse tape order; a chain goes on the
  // tape as one node at finish() and adds its steps' contributions there as one run, newest step
  // first. So: a parameter one chain reads is bitwise the interleaved plain program's; `shared`
  // is bitwise the plain program that runs the chains one after the other in the order they were
  // finished, and the interleaved program's to rounding (the same terms, summed in another order).
  Generator init(23);
  nn::Linear own_a(5, 5, true, init), own_b(5, 5, true, init);
  Tensor shared = (randn({5, 5}, init) * 0.3f).requires_grad_();
  const Tensor xa0 = randn({2, 5}, init), xb0 = randn({2, 5}, init);
  auto step_of = [&](nn::Linear& own) {
    return [&own, &shared](const Tensor& h) { return h + tanh(own(h) + matmul(h, shared)) * 0.1f; };
  };
  const int L = 30;
  enum class Run { interleaved, one_after_other, chains };
  auto grads = [&](Run run) {
    own_a.zero_grad();
    own_b.zero_grad();
    shared.zero_grad();
    Tensor ya = xa0, yb = xb0;
    if (run == Run::chains) {
      OnlineChain a(xa0, 3, "a"), b(xb0, 4, "b");
      for (int i = 0; i < L; ++i) {
        a.advance(step_of(own_a));
        b.advance(step_of(own_b));
      }
      ya = a.finish();
      yb = b.finish();
    } else if (run == Run::interleaved) {
      for (int i = 0; i < L; ++i) {
        ya = step_of(own_a)(ya);
        yb = step_of(own_b)(yb);
      }
    } else {
      for (int i = 0; i < L; ++i) ya = step_of(own_a)(ya);
      for (int i = 0; i < L; ++i) yb = step_of(own_b)(yb);
    }
    (sum(ya * ya) + sum(yb) * 0.5f).backward();
    std::vector<std::vector<float>> g = test::gradients(own_a);
    for (auto& v : test::gradients(own_b)) g.push_back(v);
    g.push_back(shared.grad().to_vector());
    return g;
  };
  const auto chains = grads(Run::chains), interleaved = grads(Run::interleaved), sequential = grads(Run::one_after_other);
  const std::size_t last = chains.size() - 1;  // shared's gradient
  for (std::size_t i = 0; i < last; ++i) {
    INFO("own parameter " << i);
    CHECK(chains[i] == interleaved[i]);
  }
  CHECK(chains[last] == sequential[last]);
  // Interleaved vs one after the other: a reassociated sum, a few ulp apart at most.
  for (std::size_t k = 0; k < chains[last].size(); ++k)
    CHECK(chains[last][k] == Approx(interleaved[last][k]).epsilon(1e-5).margin(1e-6));
}

TEST_CASE("checkpoint: segments nested with no op between them give bitwise the same gradients",
          "[checkpoint][nested][bitwise][early_stop]") {
  // The enclosing segment makes no op of its own: everything it computes is made inside nested
  // scopes, whose places in its positions decide what its replay computes.
  Generator init(11);
  const Tensor w1_data = randn({8, 8}, init) * 0.3f, w2_data = randn({8, 8}, init) * 0.3f;
  const Tensor x_data = randn({4, 8}, init);
  for (const bool early_stop : {true, false}) {
    for (int pattern = 0; pattern < 4; ++pattern) {
      auto run = [&](bool ck) {
        return [&, ck] {
          CheckpointEarlyStop stop(early_stop);
          Tensor w1 = w1_data.detach().requires_grad_(), w2 = w2_data.detach().requires_grad_();
          Tensor x = x_data.detach().requires_grad_();
          auto block_a = [&w1](const Tensor& h) { return h + tanh(linear(h, w1)); };
          auto block_b = [&w2](const Tensor& h) { return h * sigmoid(linear(h, w2)); };
          // f dies when seg returns, long before backward replays it: checkpoint() holds a copy
          auto seg = [ck](auto f, const Tensor& h) { return ck ? checkpoint(f, h) : f(h); };
          const std::vector<ChainStep> steps{block_a, block_b, block_a};  // the chain holds them by reference
          Tensor y;
          if (pattern == 0) {  // two siblings, nothing else
            y = seg([&](const Tensor& t) { return seg(block_b, seg(block_a, t)); }, x);
          } else if (pattern == 1) {  // three levels deep
            y = seg([&](const Tensor& t) { return seg([&](const Tensor& u) { return seg(block_b, seg(block_a, u)); }, t); },
                    x);
          } else if (pattern == 2) {  // a chain inside, then a sibling segment
            y = seg([&](const Tensor& t) {
                      const Tensor c = ck ? checkpoint_sequential(steps, t, policy::binomial(1))
                                          : block_a(block_b(block_a(t)));
                      return seg(block_b, c);
                    },
                    x);
          } else {  // an op, then siblings, then an op
            y = seg([&](const Tensor& t) { return seg(block_b, seg(block_a, t * 0.5f)) * 2.0f; }, x);
          }
          sum(y * y).backward();
          return testing::RunRecord().grad("w1", w1).grad("w2", w2).grad("x", x);
        };
      };
      INFO("pattern " << pattern << ", early stop " << early_stop);
      CHECK_SAME_RUNS(run(false), run(true));
    }
  }
}

namespace {

/// x ↦ tanh(k·x), a callable that knows whether it is alive: called after its destruction it
/// throws instead of reading what is left of it.
struct LiveScale {
  static std::set<const LiveScale*>& live() {
    static std::set<const LiveScale*> objects;
    return objects;
  }
  explicit LiveScale(float k) : k(k) { live().insert(this); }
  LiveScale(const LiveScale& other) : k(other.k) { live().insert(this); }
  LiveScale& operator=(const LiveScale&) = delete;
  ~LiveScale() { live().erase(this); }
  Tensor operator()(const Tensor& x) const {
    REMAT_CHECK(live().count(this) == 1, "LiveScale: called after its destruction");
    return tanh(x * k);
  }
  float k;
};

}  // namespace

TEST_CASE("checkpoint: a callable named in a loop body is gone before backward, the replay runs a copy taken "
          "before the forward",
          "[checkpoint][hardening][callable]") {
  Generator init(12);
  const Tensor w_data = randn({6, 6}, init) * 0.4f, x_data = randn({3, 6}, init);
  int calls = 0;
  auto run = [&](bool ck) {
    return [&, ck] {
      Tensor w = w_data.detach().requires_grad_(), x = x_data.detach().requires_grad_();
      Tensor h = x;
      for (int i = 0; i < 3; ++i) {
        const LiveScale scale(0.5f + 0.25f * static_cast<float>(i));
        // A mutable lambda with state and a captured vector: the forward changes the caller's
        // object (counted), the replay starts its copy from the state the forward started from.
        auto block = [&w, &calls, offsets = std::vector<float>{0.1f, -0.2f, 0.3f}, i, n = 0](const Tensor& t) mutable {
          calls += n++ == 0 ? 1 : 100;  // a second call of the same object would show
          return t + matmul(t, w) * offsets[static_cast<std::size_t>(i)];
        };
        h = ck ? checkpoint(scale, h) : scale(h);
        h = ck ? checkpoint(block, h) : block(h);
      }
      sum(h * h).backward();
      return testing::RunRecord().grad("w", w).grad("x", x);
    };
  };
  CHECK_SAME_RUNS(run(false), run(true));
  calls = 0;
  run(true)();
  CHECK(calls == 6);  // three forwards on the caller's objects, three replays each on a fresh copy
  CHECK(LiveScale::live().empty());
}
