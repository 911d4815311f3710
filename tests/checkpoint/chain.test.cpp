#include "checkpoint/support_checkpoint.hpp"
#include <cstdlib>
#include <unistd.h>

using namespace remat;

namespace {

std::vector<Policy> every_policy() {
  return {policy::none(), policy::uniform(1), policy::uniform(3), policy::sqrt_segments(), policy::binomial(2),
          policy::binomial(3), policy::budget(std::size_t{1} << 20)};
}

}  // namespace

TEST_CASE("chain: a GPT's gradients are bitwise identical under every policy, dropout on", "[chain][gpt]") {
  Generator init(31);
  nn::GPT gpt(test::small_gpt(6, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  auto run = [&](std::optional<Policy> p) {
    gpt.zero_grad();
    apply_checkpointing(gpt, p ? Checkpointing::chain(*p) : Checkpointing::none());
    Tensor loss = gpt.loss(idx, targets);
    loss.backward();
    // The stream after backward is the one without replays.
    return testing::RunRecord().grads(gpt).tensor("loss", loss).tensor("draw after backward", randn({2}));
  };
  for (const Policy& p : every_policy()) {
    INFO(p.name);
    CHECK_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(p); }, 8);
  }
}

TEST_CASE("chain: the executor does what the plan says, replaying with is_replaying set", "[chain]") {
  const std::int64_t L = 13;
  Generator g(32);
  std::vector<Tensor> weights;
  for (std::int64_t i = 0; i < L; ++i) weights.push_back((randn({4, 4}, g) * 0.3f).detach().requires_grad_());
  int real = 0, replays = 0;
  std::vector<ChainStep> steps;
  for (std::int64_t i = 0; i < L; ++i)
    steps.push_back([&, i](const Tensor& h) {
      (is_replaying() ? replays : real) += 1;
      return tanh(matmul(h, weights[static_cast<std::size_t>(i)]));
    });
  const Tensor x = randn({2, 4}, g);
  for (const bool compact : {true, false}) {
    for (const Policy& p : every_policy()) {
      INFO(p.name << (compact ? ", compact records" : ", full records"));
      real = replays = 0;
      auto counts = std::make_shared<ChainCounts>();
      const std::vector<StepCost> costs = measure_steps(steps, x);
      real = replays = 0;
      const Plan expected = plan(p, L, costs);
      {
        CheckpointEarlyStop records(compact);
        Tensor y = checkpoint_sequential(steps, x, p, &costs, counts);
        sum(y).backward();
      }
      CHECK(counts->advances == expected.advances);
      CHECK(counts->records == expected.records);
      CHECK(counts->peak_snapshots == expected.peak_snapshots);
      CHECK(real == L);  // each step runs once for real, in the forward pass
      // Steps recorded in forward are held compactly and rebuilt when reversed (a run of the
      // step with is_replaying set that computes nothing), unless early stop is off.
      std::int64_t forward_records = 0;
      const auto stream = expected.stream();
      Action a{Action::Kind::free, 0};
      for (std::size_t k = 0; k < expected.forward_actions && stream->next(a);) {
        forward_records += a.kind == Action::Kind::record;
        ++k;
      }
      CHECK(counts->rebuilt == (compact ? forward_records : 0));
      CHECK(replays == expected.advances + expected.records - L + counts->rebuilt);
    }
  }
}

TEST_CASE("chain: measured peak saved bytes equal the plan's prediction for equal steps", "[chain][memory]") {
  test::FreshTape fresh;
  const std::int64_t L = 24;
  // y = exp(x)·½: exp saves its output (one state's bytes), the scale saves nothing, and neither
  // input nor output of a step is saved, so snapshots and recorded steps never share storage.
  std::vector<ChainStep> steps(static_cast<std::size_t>(L), [](const Tensor& h) { return exp(h) * 0.5f; });
  Tensor x = randn({8, 16}).requires_grad_();
  const std::size_t state = x.nbytes();
  const std::vector<StepCost> costs(static_cast<std::size_t>(L), StepCost{1.0, state, state});
  for (const Policy& p : {policy::none(), policy::uniform(4), policy::sqrt_segments(), policy::binomial(3),
                          policy::binomial(5), policy::budget(6 * state)}) {
    INFO(p.name);
    const Plan expected = plan(p, L, costs);
    const std::size_t base = memory_stats().saved_bytes;
    MemoryScope scope;
    Tensor y = checkpoint_sequential(steps, x, p, &costs);
    CHECK(memory_stats().saved_bytes - base == expected.forward_end_bytes);
    sum(y).backward();
    CHECK(scope.peak_saved_bytes() - base == expected.peak_bytes);
    CHECK(memory_stats().saved_bytes == base);
  }
}

TEST_CASE("chain: a 10,000-step RNN reverses under binomial(10) with the minimal recomputation", "[chain][binomial]") {
  const std::int64_t L = 10000;
  Generator g(33);
  Tensor w = (randn({16, 16}, g) * 0.2f).detach().requires_grad_();
  Tensor b = zeros({16}).requires_grad_();
  const ChainStep cell = [&](const Tensor& h) { return tanh(matmul(h, w) + b); };
  const std::vector<ChainStep> steps(static_cast<std::size_t>(L), cell);
  const Tensor h0 = randn({1, 16}, g);
  const std::vector<StepCost> one = measure_steps({cell}, h0);
  auto counts = std::make_shared<ChainCounts>();
  const std::size_t base = memory_stats().saved_bytes;
  MemoryScope scope;
  Tensor hL = checkpoint_sequential(steps, h0, policy::binomial(10), nullptr, counts);
  sum(hL).backward();
  CHECK(counts->advances == 57624);
  CHECK(counts->records == L);
  CHECK(counts->peak_snapshots <= 10);
  // Never more than the snapshots and one recorded step (which also saves w) at once.
  CHECK(scope.peak_saved_bytes() - base <= 10 * h0.nbytes() + one[0].activation_bytes);
  CHECK(w.grad().defined());
  CHECK(std::isfinite(detail::flat(w.grad()).sum()));
}

TEST_CASE("chain: an impossible budget is a clear error", "[chain][budget]") {
  const std::vector<StepCost> costs(4, StepCost{1.0, 100, 1000});
  REQUIRE_ERROR(plan(policy::budget(500), 4, costs), "policy::budget", "500 bytes", "least budget that fits is about 1");
}

namespace {

/// A chain of unequal steps: states of 8, 16 and 32 columns; steps that read their input and a
/// parameter of their own (matmul), share one parameter, save their output (tanh) or only what
/// they make inside (exp, then a scale), or read their input twice (h·h).
struct UnequalChain {
  Generator g{41};
  Tensor w0 = (randn({8, 16}, g) * 0.3f).detach().requires_grad_();
  Tensor shared = (randn({16, 16}, g) * 0.3f).detach().requires_grad_();
  Tensor w5 = (randn({16, 32}, g) * 0.3f).detach().requires_grad_();
  Tensor w8 = (randn({32, 8}, g) * 0.3f).detach().requires_grad_();
  Tensor x = randn({4, 8}, g).requires_grad_();
  std::vector<ChainStep> steps{
      [this](const Tensor& h) { return tanh(matmul(h, w0)); },
      [](const Tensor& h) { return exp(h) * 0.5f; },
      [this](const Tensor& h) { return tanh(matmul(h, shared)); },
      [this](const Tensor& h) { return tanh(matmul(h, shared)); },
      [](const Tensor& h) { return h * h; },
      [this](const Tensor& h) { return tanh(matmul(h, w5)); },
      [](const Tensor& h) { return exp(h) * 0.5f; },
      [](const Tensor& h) { return tanh(h); },
      [this](const Tensor& h) { return tanh(matmul(h, w8)); },
      [this](const Tensor& h) { return matmul(tanh(h), w0); },
      [](const Tensor& h) { return exp(h) * 0.5f; },
  };
};

/// The measured peak and end-of-forward saved bytes of running `steps` under p.
std::pair<std::size_t, std::size_t> measured_bytes(const std::vector<ChainStep>& steps, const Tensor& x, const Policy& p,
                                                   const std::vector<StepCost>& costs) {
  const std::size_t base = memory_stats().saved_bytes;
  MemoryScope scope;
  Tensor y = checkpoint_sequential(steps, x, p, &costs);
  const std::size_t forward_end = memory_stats().saved_bytes - base;
  sum(y).backward();
  return {scope.peak_saved_bytes() - base, forward_end};
}

}  // namespace

TEST_CASE("chain: predicted peak saved bytes equal the measured ones for unequal steps, under every policy",
          "[chain][memory][budget]") {
  test::FreshTape fresh;
  UnequalChain c;
  const auto L = static_cast<std::int64_t>(c.steps.size());
  char dir_template[] = "/tmp/remat-bytes-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  for (const bool compact : {true, false}) {
    CheckpointEarlyStop records(compact);
    const std::vector<StepCost> costs = measure_steps(c.steps, c.x);
    const std::size_t none_peak = plan(policy::none(), L, costs).peak_bytes;
    std::vector<Policy> policies{policy::none(), policy::uniform(3), policy::uniform(5), policy::sqrt_segments(),
                                 policy::binomial(2), policy::binomial(3), policy::binomial(5),
                                 policy::two_tier(2, 2, dir)};
    for (const std::size_t budget : {none_peak, none_peak * 3 / 4, none_peak / 2, none_peak / 3})
      policies.push_back(policy::budget(budget));
    for (const Policy& p : policies) {
      INFO(p.name << (compact ? ", compact records" : ", full records"));
      Plan expected;
      try {
        expected = plan(p, L, costs);
      } catch (const Error& e) {
        INFO(e.what());
        CHECK(p.needs_costs);  // only a budget below what the chain needs
        continue;
      }
      const auto [peak, forward_end] = measured_bytes(c.steps, c.x, p, costs);
      INFO(expected.advances << " advances, predicted " << expected.peak_bytes << " B (" << expected.forward_end_bytes
           << " B at the end of forward), measured " << peak << " B (" << forward_end << " B)");
      CHECK(expected.peak_bytes == peak);
      CHECK(expected.forward_end_bytes == forward_end);
      if (p.needs_costs) CHECK(expected.peak_bytes <= std::stoull(p.name.substr(7)));
    }
    // A budget that holds everything records everything: no advance is worth it.
    CHECK(plan(policy::budget(none_peak), L, costs).advances == 0);
  }
  ::rmdir(dir.c_str());
}
