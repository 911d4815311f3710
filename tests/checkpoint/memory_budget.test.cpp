#include "checkpoint/support_checkpoint.hpp"

#include <optional>

#include <remat/checkpoint/runtime_budget.hpp>

using namespace remat;

namespace {

/// A U-Net-like stack: each down block's output is read again by its up block (a skip connection),
/// so the graph is not a chain and the activations of the way down live until the way up.
struct UNetLike : nn::Module {
  static constexpr int kLevels = 4;
  std::vector<std::unique_ptr<nn::Linear>> down, up;
  std::unique_ptr<nn::Linear> bottom;
  std::vector<std::unique_ptr<nn::LayerNorm>> norms;
  double p;

  UNetLike(std::int64_t width, double dropout, Generator& g) : p(dropout) {
    for (int i = 0; i < kLevels; ++i) {
      down.push_back(std::make_unique<nn::Linear>(width, width, true, g));
      up.push_back(std::make_unique<nn::Linear>(width, width, true, g));
      norms.push_back(std::make_unique<nn::LayerNorm>(width));
      register_module("down" + std::to_string(i), *down.back());
      register_module("up" + std::to_string(i), *up.back());
      register_module("norm" + std::to_string(i), *norms.back());
    }
    bottom = std::make_unique<nn::Linear>(width, width, true, g);
    register_module("bottom", *bottom);
  }

  Tensor forward(const Tensor& x) {
    std::vector<Tensor> skips;
    Tensor h = x;
    for (int i = 0; i < kLevels; ++i) {
      h = dropout(gelu((*down[static_cast<std::size_t>(i)])(h)), p);
      skips.push_back(h);
    }
    h = tanh((*bottom)(h));
    for (int i = kLevels; i-- > 0;) {
      const auto k = static_cast<std::size_t>(i);
      h = (*norms[k])(gelu((*up[k])(h)) + skips[k]);
    }
    return h;
  }
};

struct StepResult {
  std::size_t peak_saved = 0;
  std::vector<std::vector<float>> grads;
  BudgetLog log;
};

/// One training step (fixed dropout seed) under `budget` (none when absent, or replaying `plan`).
template <class Model>
StepResult step(Model& model, const std::function<Tensor()>& loss_fn, std::optional<std::size_t> budget,
                const std::optional<DiscardPlan>& plan = std::nullopt) {
  test::FreshTape fresh;
  model.zero_grad();
  manual_seed(77);
  StepResult r;
  MemoryScope scope;
  {
    std::optional<MemoryBudget> guard;
    if (plan) guard.emplace(*plan);
    else if (budget) guard.emplace(*budget);
    Tensor loss = loss_fn();
    loss.backward();
    if (guard) r.log = guard->last_log();
  }
  r.peak_saved = scope.peak_saved_bytes();
  r.grads = test::gradients(model);
  return r;
}

/// What an infeasible budget's error names: the least budget (and the failed step's decisions, a
/// plan that fits it).
struct Least {
  std::size_t bytes;
  DiscardPlan plan;
};

template <class Model>
Least least_feasible(Model& model, const std::function<Tensor()>& loss_fn) {
  test::FreshTape fresh;
  model.zero_grad();
  manual_seed(77);
  MemoryBudget guard(1);
  std::string message;
  try {
    loss_fn().backward();
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  REQUIRE(message.find("smallest budget that works for this step is") != std::string::npos);
  REQUIRE(message.find(std::to_string(guard.least_feasible_bytes()) + " B (measured") != std::string::npos);
  REQUIRE(guard.plan().budget == guard.least_feasible_bytes());
  return {guard.least_feasible_bytes(), guard.plan()};
}

/// From the no-budget peak down to the least feasible budget in `steps` even steps: every step
/// within its budget, gradients bitwise those without a budget, peaks never rising as budgets fall.
template <class Model>
void sweep(Model& model, const std::function<Tensor()>& loss_fn, int steps) {
  const StepResult free_run = step(model, loss_fn, std::nullopt);
  const Least found = least_feasible(model, loss_fn);
  const std::size_t least = found.bytes;
  INFO("no-budget peak " << free_run.peak_saved << " B, least feasible " << least << " B");
  REQUIRE(least < free_run.peak_saved);
  std::size_t previous_peak = std::numeric_limits<std::size_t>::max();
  for (int i = 0; i < steps; ++i) {
    const std::size_t budget =
        free_run.peak_saved - (free_run.peak_saved - least) * static_cast<std::size_t>(i) / static_cast<std::size_t>(steps - 1);
    // At the least budget itself, the decisions that measured it (a search from scratch may need a
    // little more: what a moment must hold depends on what earlier moments kept).
    const StepResult r = i + 1 == steps ? step(model, loss_fn, std::nullopt, found.plan) : step(model, loss_fn, budget);
    INFO("budget " << budget << " B: peak " << r.peak_saved << " B, " << r.log.discards << " discards, "
                   << r.log.recomputes << " recomputes");
    CHECK(r.peak_saved <= budget);
    CHECK(r.peak_saved <= previous_peak);
    CHECK(r.grads == free_run.grads);
    previous_peak = r.peak_saved;
  }
}

}  // namespace

TEST_CASE("memory budget: a U-Net-like model with skips, from the free peak to the least feasible budget",
          "[budget][memory]") {
  Generator g(5);
  UNetLike net(24, 0.1, g);
  const Tensor x = randn({16, 24}, g);
  sweep(net, [&] { return mean(net.forward(x) * net.forward(x)); }, 9);
}

TEST_CASE("memory budget: a GPT with dropout, from the free peak to the least feasible budget", "[budget][memory][gpt]") {
  Generator init(3);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  sweep(gpt, [&] { return gpt.loss(idx, targets); }, 8);
}

TEST_CASE("memory budget: an infeasible budget names the least one; retrying with it succeeds", "[budget]") {
  Generator init(4);
  nn::GPT gpt(test::small_gpt(2, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  auto loss_fn = [&] { return gpt.loss(idx, targets); };
  const std::size_t baseline = memory_stats().saved_bytes;
  const StepResult free_run = step(gpt, loss_fn, std::nullopt);
  const Least found = least_feasible(gpt, loss_fn);
  const std::size_t least = found.bytes;
  CHECK(memory_stats().saved_bytes == baseline);  // nothing left held after the failed step
  // The failed step's gradients were complete and exact.
  CHECK(test::gradients(gpt) == free_run.grads);
  const StepResult retry = step(gpt, loss_fn, std::nullopt, found.plan);
  CHECK(retry.log.decisions == 0);
  CHECK(retry.peak_saved <= least);
  CHECK(retry.grads == free_run.grads);
  CHECK(retry.log.discards > 0);
  // Well below it is still refused (the least is measured with everything discardable discarded,
  // so a budget a little below it may work; one a tenth below does not).
  REQUIRE_ERROR(step(gpt, loss_fn, least - least / 10), "smallest budget that works");
  CHECK(memory_stats().saved_bytes == baseline);
}

TEST_CASE("memory budget: a step's log is a static plan the next steps replay without searching", "[budget][plan]") {
  Generator g(6);
  UNetLike net(24, 0.1, g);
  const Tensor x = randn({16, 24}, g);
  auto loss_fn = [&] { return mean(net.forward(x) * net.forward(x)); };
  const StepResult free_run = step(net, loss_fn, std::nullopt);
  const std::size_t least = least_feasible(net, loss_fn).bytes;
  const std::size_t budget = (least + free_run.peak_saved) / 2;
  const StepResult searched = step(net, loss_fn, budget);
  REQUIRE(searched.log.discards > 0);
  CHECK(searched.log.decisions > 0);
  INFO(searched.log.str());
  CHECK(searched.log.str().find("discard") != std::string::npos);
  const DiscardPlan plan = DiscardPlan::from(searched.log);
  for (int i = 0; i < 2; ++i) {
    const StepResult replayed = step(net, loss_fn, std::nullopt, plan);
    CHECK(replayed.peak_saved == searched.peak_saved);
    CHECK(replayed.grads == free_run.grads);
    CHECK(replayed.log.discards == searched.log.discards);
    CHECK(replayed.log.recomputes == searched.log.recomputes);
    CHECK(replayed.log.decisions == 0);
    CHECK(replayed.log.plan_misses == 0);
  }
}

TEST_CASE("memory budget: inside and around checkpoint(), with a selective policy, and with chain schedules",
          "[budget][checkpoint]") {
  Generator init(7);
  nn::GPT gpt(test::small_gpt(4, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  auto loss_fn = [&] { return gpt.loss(idx, targets); };
  apply_checkpointing(gpt, Checkpointing::none());
  const StepResult plain = step(gpt, loss_fn, std::nullopt);
  for (const Checkpointing& how : {Checkpointing::each_block(), Checkpointing::each_block(save_policy::matmuls()),
                                   Checkpointing::chain(policy::sqrt_segments()), Checkpointing::chain(policy::binomial(2))}) {
    INFO(how.name);
    apply_checkpointing(gpt, how);
    const StepResult alone = step(gpt, loss_fn, std::nullopt);
    REQUIRE(alone.grads == plain.grads);
    const Least found = least_feasible(gpt, loss_fn);
    const StepResult at_least = step(gpt, loss_fn, std::nullopt, found.plan);
    CHECK(at_least.peak_saved <= found.bytes);
    CHECK(at_least.grads == plain.grads);
    // With a selective policy most saved bytes are kept outputs, which only the checkpoint holds:
    // the least budget may then sit a little above the policy's own peak.
    const std::size_t budget = std::max(found.bytes + found.bytes / 10, alone.peak_saved);
    const StepResult r = step(gpt, loss_fn, budget);
    CHECK(r.peak_saved <= budget);
    CHECK(r.grads == plain.grads);
  }
  apply_checkpointing(gpt, Checkpointing::none());
}

TEST_CASE("memory budget: what it discards shows in print_saved_tensors; held tensors and no_grad are untouched",
          "[budget]") {
  test::FreshTape fresh;
  Generator g(8);
  nn::Linear a(32, 32, true, g), b(32, 32, true, g);
  const Tensor x = randn({64, 32}, g).requires_grad_();
  Tensor held;
  {
    // A dozen of the 24 (64, 32) activations the loop makes, and the parameters.
    MemoryBudget guard(12 * 64 * 32 * sizeof(float) + 2 * 32 * 33 * sizeof(float));
    Tensor h = x;
    for (int i = 0; i < 6; ++i) h = tanh(b(gelu(a(h))));
    held = sigmoid(h);  // the user holds it: never discarded
    const std::vector<float> held_values = held.to_vector();
    const SavedTensorReport report = saved_tensors(fresh.tape);
    std::size_t discarded = 0;
    for (const SavedTensorInfo& e : report.entries)
      if (e.discarded) {
        ++discarded;
        CHECK(e.rebuild_flops > 0);
      }
    CHECK(discarded > 0);
    CHECK(report.discarded_bytes > 0);
    CHECK(report.str().find("discarded; rebuild") != std::string::npos);
    CHECK(held.storage()->resident());
    CHECK(x.storage()->resident());
    {
      no_grad off;
      const std::size_t saved = memory_stats().saved_bytes;
      Tensor y = tanh(a(held));
      CHECK(memory_stats().saved_bytes == saved);
      CHECK(y.storage()->residency() == nullptr);
    }
    sum(held).backward();
    CHECK(held.to_vector() == held_values);
    CHECK(guard.last_log().recomputes > 0);
  }
  CHECK(held.storage()->residency() == nullptr);
}

namespace {
int g_drift = 0;
inline const OpId drifting = register_op("test_drifting");
/// An op whose compute reads state outside its inputs: recomputing it after that state changed
/// gives different values, which checking mode reports.
Tensor drifting_op(const Tensor& x) {
  Tensor y = detail::produce<float>(drifting, x.shape(), 1.0, {x}, [=] {
    Tensor out(x.shape());
    detail::flat(out) = detail::flat(x) + static_cast<float>(g_drift);
    return out;
  });
  if (detail::grad_needed(x))
    detail::record<float>(drifting, {x}, {&y}, {y}, [](detail::BackwardContext<float>& ctx) {
      ctx.accumulate(0, detail::copy_of(ctx.grad_output()));
      (void)ctx.saved(0);
    });
  return y;
}
}  // namespace

TEST_CASE("memory budget: a recomputation that differs from the first computation is reported in checking mode",
          "[budget][misuse]") {
  test::FreshTape fresh;
  CheckpointChecking checking;
  Generator g(9);
  const Tensor x = randn({64, 64}, g).requires_grad_();
  MemoryBudget guard(2 * 64 * 64 * sizeof(float));
  g_drift = 0;
  Tensor h = x;
  for (int i = 0; i < 4; ++i) h = tanh(drifting_op(h));
  g_drift = 1;
  REQUIRE_ERROR(sum(h).backward(), "MemoryBudget: recomputing output 0 of 'test_drifting' gave different values");
}
