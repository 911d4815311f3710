#include "checkpoint/support_checkpoint.hpp"

#include <type_traits>

#include <cstdio>
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

/// Eight blocks of width 64 with dropout: deep enough that where the budget discards matters.
nn::GPTConfig eight_block_gpt() {
  nn::GPTConfig cfg;
  cfg.n_layer = 8;
  cfg.n_embd = 64;
  cfg.n_head = 2;
  cfg.block_size = 32;
  cfg.vocab_size = 64;
  cfg.dropout = 0.1;
  return cfg;
}

struct StepResult {
  std::size_t peak_saved = 0;  // activation bytes saved for backward (parameters apart)
  std::size_t peak_live = 0;   // every tensor byte
  std::vector<std::vector<float>> grads;
  BudgetLog log;
};

/// One training step (fixed dropout seed) under `budget` (none when absent, or replaying `plan`;
/// writing to disk where quicker with `offload`); `between` runs between forward and backward.
template <class Model>
StepResult step(Model& model, const std::function<Tensor()>& loss_fn, std::optional<std::size_t> budget,
                const std::optional<DiscardPlan>& plan = std::nullopt,
                const std::optional<BudgetOffload>& offload = std::nullopt, const std::function<void()>& between = {}) {
  test::FreshTape fresh;
  model.zero_grad();
  manual_seed(77);
  StepResult r;
  MemoryScope scope;
  {
    std::optional<MemoryBudget> guard;
    if (plan) guard.emplace(*plan);
    else if (budget && offload) guard.emplace(*budget, *offload);
    else if (budget) guard.emplace(*budget);
    Tensor loss = loss_fn();
    if (between) between();
    loss.backward();
    if (guard) r.log = guard->last_log();
  }
  r.peak_saved = scope.peak_saved_activation_bytes();
  r.peak_live = scope.peak_bytes();
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

// DiscardPlan's earlier name stays a name of the namespace (it was once only a member alias).
static_assert(std::is_same_v<remat::RematPlan, remat::DiscardPlan>);

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

TEST_CASE("memory budget: at per-block checkpointing's peak it rebuilds each block's attention at most once",
          "[budget][memory][gpt]") {
  // An attention's scores (softmax, mask, dropout draw, all dropped) cost it more than its products
  // at a GPT's head sizes. Priced at its flops alone, the budget took its output for a fifth of its
  // cost and rebuilt it 12 times here for 8 blocks (where a per-block replay runs each once).
  const nn::GPTConfig cfg = eight_block_gpt();
  Generator init(1);
  nn::GPT gpt(cfg, init);
  const LongTensor idx = randint(0, 64, {2, 32}, init), targets = randint(0, 64, {2, 32}, init);
  const auto loss = [&] { return gpt.loss(idx, targets); };
  apply_checkpointing(gpt, Checkpointing::each_block());
  const StepResult blocks = step(gpt, loss, std::nullopt);
  apply_checkpointing(gpt, Checkpointing::none());
  const StepResult budgeted = step(gpt, loss, blocks.peak_saved);
  int attention_rebuilds = 0;
  for (const BudgetEvent& e : budgeted.log.events)
    attention_rebuilds += e.kind == BudgetEvent::Kind::recompute && e.op == "causal_self_attention";
  INFO(budgeted.log.str());
  CHECK(budgeted.log.recomputes > 0);
  CHECK(attention_rebuilds <= cfg.n_layer);
  CHECK(budgeted.peak_saved <= blocks.peak_saved);
  CHECK(budgeted.grads == blocks.grads);
}

TEST_CASE("memory budget: an infeasible budget names the least one, retrying with it succeeds", "[budget]") {
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

TEST_CASE("memory budget: what it discards shows in print_saved_tensors, held tensors and no_grad are untouched",
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
      const std::size_t saved = memory_stats().saved_bytes, registered = guard.log().registered;
      Tensor y = tanh(a(held));
      CHECK(memory_stats().saved_bytes == saved);
      CHECK(guard.log().registered == registered);  // nothing to recompute for no graph
    }
    sum(held).backward();
    CHECK(held.to_vector() == held_values);
    CHECK(guard.last_log().recomputes > 0);
  }
  CHECK(held.storage()->resident());
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

namespace {

/// sum(tanh(x W)): tanh keeps its output, so without a budget the product's output is freed as
/// soon as tanh has read it; a budget that kept it for tanh's recomputation used to count it.
struct TanhOfProduct : nn::Module {
  Tensor w;
  explicit TanhOfProduct(Generator& g) : w(randn({64, 64}, g)) { register_parameter("w", w); }
  Tensor forward(const Tensor& x) { return tanh(matmul(x, w)); }
};

/// Two levels with one weight used at both (a tied weight) and a skip from the first to the last.
struct TiedSkip : nn::Module {
  nn::Linear shared, inner, head;
  explicit TiedSkip(Generator& g) : shared(32, 32, true, g), inner(32, 32, true, g), head(32, 32, true, g) {
    register_module("shared", shared);
    register_module("inner", inner);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) {
    const Tensor a = gelu(shared(x));
    const Tensor b = tanh(inner(a));
    return head((gelu(shared(b)) + a) * b);
  }
};

/// Residual blocks, each one checkpoint(): only the residual stream is saved in forward.
struct CheckpointedResidual : nn::Module {
  std::vector<std::unique_ptr<nn::Linear>> fc;
  explicit CheckpointedResidual(Generator& g) {
    for (int i = 0; i < 4; ++i) {
      fc.push_back(std::make_unique<nn::Linear>(32, 32, true, g));
      register_module("fc" + std::to_string(i), *fc.back());
    }
  }
  Tensor forward(const Tensor& x) {
    Tensor h = x;
    for (auto& f : fc) h = h + checkpoint([&](const Tensor& a) { return dropout(tanh((*f)(a)), 0.1); }, h);
    return h;
  }
};

/// The invariants of a budget that never costs memory: at the step's own activation peak, and far
/// above it, nothing is discarded or recomputed and the activation peak does not rise; and the
/// least feasible budget is at most that peak. (The live peak is reported beside it: a tensor only
/// recipes hold is let go at the budget's next event, which can come one op after the moment the
/// step without a budget frees it.)
template <class Model>
void never_costs_memory(Model& model, const std::function<Tensor()>& loss_fn) {
  const StepResult free_run = step(model, loss_fn, std::nullopt);
  REQUIRE(free_run.peak_saved > 0);
  for (const std::size_t budget : {free_run.peak_saved, std::size_t{1} << 30}) {
    const StepResult r = step(model, loss_fn, budget);
    INFO("budget " << budget << " B: activation peak " << r.peak_saved << " B (" << free_run.peak_saved
                   << " B without a budget), live peak " << r.peak_live << " B (" << free_run.peak_live << " B)\n"
                   << r.log.str());
    CHECK(r.log.discards == 0);
    CHECK(r.log.recomputes == 0);
    CHECK(r.peak_saved == free_run.peak_saved);
    CHECK(r.grads == free_run.grads);
  }
  const Least found = least_feasible(model, loss_fn);
  INFO("least feasible " << found.bytes << " B, activation peak without a budget " << free_run.peak_saved << " B");
  CHECK(found.bytes <= free_run.peak_saved);
  const StepResult at_least = step(model, loss_fn, std::nullopt, found.plan);
  CHECK(at_least.peak_saved <= found.bytes);
  CHECK(at_least.grads == free_run.grads);
}

}  // namespace

TEST_CASE("memory budget: parameters count apart from activations in the books", "[budget][memory]") {
  test::FreshTape fresh;
  Generator g(10);
  nn::Linear layer(32, 16, false, g);
  const Tensor x = randn({8, 32}, g).requires_grad_();
  const MemoryStats before = memory_stats();
  const Tensor y = layer(x);  // saves x (an activation to the books) and the weight (a parameter)
  const MemoryStats after = memory_stats();
  CHECK(after.saved_parameter_bytes - before.saved_parameter_bytes == layer.weight.nbytes());
  CHECK(after.saved_activation_bytes - before.saved_activation_bytes == x.nbytes());
  CHECK(after.saved_bytes - before.saved_bytes == x.nbytes() + layer.weight.nbytes());
  CHECK(after.peak_saved_activation_bytes >= after.saved_activation_bytes);
  {
    // Under autocast the weight's copy lives with the scope, as its parameter does: the same side.
    // (An activation's copy, here tanh's output, is an activation; a leaf that requires grad, as x,
    // is cached like a parameter, as PyTorch's autocast does.)
    const Tensor a = tanh(x);
    autocast on;
    const MemoryStats start = memory_stats();
    const Tensor z = layer(a);
    const MemoryStats end = memory_stats();
    (void)z;
    CHECK(end.saved_parameter_bytes - start.saved_parameter_bytes == layer.weight.nbytes() / 2);
    CHECK(end.saved_activation_bytes - start.saved_activation_bytes == a.nbytes() / 2);
  }
  (void)y;
}

TEST_CASE("memory budget: the cap is on activations, a weight saved beside them does not count", "[budget][memory]") {
  test::FreshTape fresh;
  Generator g(12);
  nn::Linear layer(32, 16, false, g);
  const Tensor x = randn({8, 32}, g).requires_grad_();
  MemoryBudget budget(x.nbytes());  // x is all the activation this step saves
  sum(layer(x)).backward();
  CHECK(budget.last_log().least_feasible == 0);
  CHECK(budget.last_log().discards == 0);
  CHECK(budget.last_log().peak_saved_bytes == x.nbytes());
}

TEST_CASE("memory budget: a budget at or above the unbudgeted activation peak never discards nor raises a peak",
          "[budget][memory]") {
  Generator g(11);
  SECTION("sum(tanh(x W))") {
    TanhOfProduct model(g);
    const Tensor x = randn({64, 64}, g);
    never_costs_memory(model, [&] { return sum(model.forward(x)); });
  }
  SECTION("a U-Net-like model with skips") {
    UNetLike net(24, 0.1, g);
    const Tensor x = randn({16, 24}, g);
    never_costs_memory(net, [&] { return mean(net.forward(x) * net.forward(x)); });
  }
  SECTION("two levels with a tied weight and a skip") {
    TiedSkip model(g);
    const Tensor x = randn({16, 32}, g);
    never_costs_memory(model, [&] { return mean(model.forward(x)); });
  }
  SECTION("checkpoint() per residual block") {
    CheckpointedResidual model(g);
    const Tensor x = randn({16, 32}, g);
    never_costs_memory(model, [&] { return mean(model.forward(x) * model.forward(x)); });
  }
  SECTION("a GPT, without and with checkpointing per block") {
    Generator init(3);
    nn::GPT gpt(test::small_gpt(3, 0.1), init);
    const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
    never_costs_memory(gpt, [&] { return gpt.loss(idx, targets); });
    apply_checkpointing(gpt, Checkpointing::each_block());
    never_costs_memory(gpt, [&] { return gpt.loss(idx, targets); });
    apply_checkpointing(gpt, Checkpointing::none());
  }
}

TEST_CASE("memory budget: a budget living across steps replays the last step's plan while the ops repeat",
          "[budget][plan]") {
  Generator g(13);
  UNetLike net(24, 0.1, g);
  const Tensor x = randn({16, 24}, g);
  auto twice = [&] { return mean(net.forward(x) * net.forward(x)); };
  // Other steps, whose ops differ from the second forward's end on: one that fits without
  // discarding, and one that still needs to discard.
  auto once = [&] { return mean(tanh(net.forward(x))); };
  auto other = [&] { return mean(net.forward(x) * tanh(net.forward(x))); };
  const StepResult free_run = step(net, twice, std::nullopt);
  // A budget the search fits from scratch (one step under it, alone).
  const std::size_t budget = free_run.peak_saved * 3 / 4;
  const StepResult searched = step(net, twice, budget);
  REQUIRE(searched.log.discards > 0);
  const StepResult replayed = step(net, twice, std::nullopt, DiscardPlan::from(searched.log));
  CHECK(replayed.log.plan_misses == 0);
  test::FreshTape fresh;
  MemoryBudget guard(budget);
  std::vector<BudgetLog> logs;
  std::vector<std::vector<std::vector<float>>> grads;
  auto train_step = [&](const std::function<Tensor()>& loss_fn) {
    net.zero_grad();
    manual_seed(77);
    loss_fn().backward();
    logs.push_back(guard.last_log());
    grads.push_back(test::gradients(net));
  };
  // Searched, searched again looking ahead, then replayed twice; then other ops: the replay is
  // abandoned, the new step searched again looking ahead, then replayed; then a step that needs no
  // discards, replayed at once.
  for (int i = 0; i < 4; ++i) train_step(twice);
  for (int i = 0; i < 3; ++i) train_step(other);
  for (int i = 0; i < 2; ++i) train_step(once);
  for (const BudgetLog& log : logs) {
    INFO(log.str());
    CHECK(log.peak_saved_bytes <= budget);
    CHECK(log.plan_misses == 0);
  }
  CHECK_FALSE(logs[0].reused_plan);
  CHECK_FALSE(logs[0].looked_ahead);
  CHECK(logs[0].decisions > 0);
  CHECK_FALSE(logs[1].reused_plan);
  CHECK(logs[1].looked_ahead);
  CHECK(logs[1].decisions > 0);
  const std::size_t kept = logs[1].recomputed_flops < logs[0].recomputed_flops ? 1 : 0;
  for (std::size_t i = 2; i < 4; ++i) {
    CHECK(logs[i].reused_plan);
    CHECK_FALSE(logs[i].looked_ahead);
    CHECK_FALSE(logs[i].plan_abandoned);
    CHECK(logs[i].decisions == 0);
    CHECK(logs[i].discards == logs[kept].discards);
    CHECK(logs[i].peak_saved_bytes == logs[kept].peak_saved_bytes);
  }
  for (std::size_t i = 0; i < 4; ++i) CHECK(grads[i] == free_run.grads);
  CHECK(logs[4].reused_plan);
  CHECK(logs[4].plan_abandoned);
  CHECK(logs[4].discards > 0);
  CHECK_FALSE(logs[5].reused_plan);
  CHECK(logs[5].looked_ahead);
  CHECK(logs[6].reused_plan);
  CHECK_FALSE(logs[6].plan_abandoned);
  CHECK(logs[6].decisions == 0);
  CHECK(grads[5] == grads[4]);
  CHECK(grads[6] == grads[4]);
  CHECK(logs[7].reused_plan);
  CHECK(logs[7].plan_abandoned);
  CHECK(logs[7].discards == 0);
  CHECK(logs[8].reused_plan);
  CHECK_FALSE(logs[8].looked_ahead);
  CHECK_FALSE(logs[8].plan_abandoned);
  CHECK(grads[8] == grads[7]);
}

TEST_CASE("memory budget: its second step, searched knowing the first step's reads, recomputes less and is "
          "replayed", "[budget][plan][gpt]") {
  // Staleness takes the block boundaries of the way down for the next to go, since the forward
  // used them longest ago; rebuilding one later costs the blocks below it. Knowing when each
  // output is read next, the search keeps what the backward needs soon: at per-block
  // checkpointing's peak on this GPT, 47.7 Mflop of recomputation a step by staleness, 36.4
  // looking ahead.
  Generator init(1);
  nn::GPT gpt(eight_block_gpt(), init);
  const LongTensor idx = randint(0, 64, {2, 32}, init), targets = randint(0, 64, {2, 32}, init);
  apply_checkpointing(gpt, Checkpointing::each_block());
  const StepResult blocks = step(gpt, [&] { return gpt.loss(idx, targets); }, std::nullopt);
  apply_checkpointing(gpt, Checkpointing::none());
  std::vector<BudgetLog> logs;
  std::optional<DiscardPlan> settled;
  {
    test::FreshTape fresh;
    MemoryBudget budget(blocks.peak_saved);
    for (int i = 0; i < 3; ++i) {
      gpt.zero_grad();
      manual_seed(77);
      gpt.loss(idx, targets).backward();
      logs.push_back(budget.last_log());
      INFO("step " << i << ": " << logs.back().str());
      CHECK(logs.back().peak_saved_bytes <= blocks.peak_saved);
      CHECK(test::gradients(gpt) == blocks.grads);
    }
    settled = budget.plan();
  }
  CHECK(logs[1].looked_ahead);
  CHECK(logs[1].decisions > 0);
  CHECK(logs[1].recomputed_flops < 0.9 * logs[0].recomputed_flops);
  CHECK(logs[2].reused_plan);
  CHECK(logs[2].decisions == 0);
  CHECK(logs[2].recomputed_flops == logs[1].recomputed_flops);
  // The plan a fresh budget replays is the one the living budget settled on.
  const StepResult replayed = step(gpt, [&] { return gpt.loss(idx, targets); }, std::nullopt, settled);
  CHECK(replayed.log.recomputed_flops == logs[1].recomputed_flops);
  CHECK(replayed.grads == blocks.grads);
}


TEST_CASE("memory budget with BudgetOffload: disk or recompute by their costs, bitwise gradients, files gone",
          "[budget][offload]") {
  Generator init(4);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  auto loss_fn = [&] { return gpt.loss(idx, targets); };
  const StepResult free_run = step(gpt, loss_fn, std::nullopt);
  const StepResult recomputing = step(gpt, loss_fn, free_run.peak_saved / 2);
  REQUIRE(recomputing.log.discards > 0);
  test::TempDir dir;

  // Recomputing taken to be far slower than the disk (a second a flop: no recomputation is ever
  // timed to correct it): every discard goes through the disk, each read back once backward needs it.
  BudgetOffload quick{dir.path, 1e9, 1.0};
  const StepResult disk = step(gpt, loss_fn, free_run.peak_saved / 2, std::nullopt, quick);
  CHECK(disk.grads == free_run.grads);
  CHECK(disk.log.discards > 0);
  CHECK(disk.log.to_disk == disk.log.discards);
  CHECK(disk.log.read_back == disk.log.to_disk);
  CHECK(disk.log.disk_bytes > 0);
  CHECK(disk.peak_saved <= free_run.peak_saved / 2);
  CHECK(disk.log.str().find("to disk") != std::string::npos);
  CHECK(disk.log.str().find("read back") != std::string::npos);
  CHECK(dir.files().empty());  // the budget's directory went with it

  // A disk taken to be far slower (a byte a second: no write is ever timed to correct it): every
  // discard is recomputed, as without BudgetOffload.
  const StepResult slow = step(gpt, loss_fn, free_run.peak_saved / 2, std::nullopt, BudgetOffload{dir.path, 1.0});
  CHECK(slow.grads == free_run.grads);
  CHECK(slow.log.to_disk == 0);
  CHECK(slow.log.discards == recomputing.log.discards);
  CHECK(slow.log.recomputes == recomputing.log.recomputes);
  CHECK(dir.files().empty());

  // A file altered between the forward and the backward that reads it: an error naming it.
  std::string altered;
  auto alter_one = [&] {
    const std::vector<std::string> subdirs = dir.files();
    REQUIRE(subdirs.size() == 1);
    DIR* d = ::opendir(subdirs[0].c_str());
    REQUIRE(d != nullptr);
    while (const dirent* e = ::readdir(d))
      if (std::string(e->d_name).size() > 4 && altered.empty()) altered = subdirs[0] + "/" + e->d_name;
    ::closedir(d);
    REQUIRE_FALSE(altered.empty());
    std::FILE* f = std::fopen(altered.c_str(), "r+b");
    REQUIRE(f != nullptr);
    const int c = std::fgetc(f);
    std::fseek(f, 0, SEEK_SET);
    std::fputc(c ^ 0x40, f);
    std::fclose(f);
  };
  REQUIRE_ERROR(step(gpt, loss_fn, free_run.peak_saved / 2, std::nullopt, quick, alter_one), "MemoryBudget", "altered");
  CHECK(altered.find("remat-budget-") != std::string::npos);
  CHECK(dir.files().empty());
}
