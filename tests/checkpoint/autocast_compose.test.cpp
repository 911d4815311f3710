// remat::autocast composed with the rest of checkpointing (issue 27, item 5): a MemoryBudget that
// discards and recomputes op outputs, early stop, and the chain schedules tests/checkpoint/
// autocast.test.cpp leaves out (budget, two_tier, online). Forward under the guard, backward
// outside it (PyTorch's pattern), dropout on; each run is compared bitwise with the plain autocast
// run, and the autocast runs are shown to differ from the float32 ones (so bfloat16 was in force).

#include <optional>

#include <remat/checkpoint/runtime_budget.hpp>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// One GPT step under `budget` (none when absent, or replaying `plan`), the forward under
/// autocast(mixed), the backward outside the autocast scope but inside the budget's.
struct BudgetStep {
  std::vector<std::vector<float>> grads;
  BudgetLog log;
  std::size_t peak_saved = 0;
};

BudgetStep budget_step(nn::GPT& gpt, const LongTensor& idx, const LongTensor& targets, bool mixed,
                       std::optional<std::size_t> budget, const std::optional<DiscardPlan>& plan = std::nullopt) {
  test::FreshTape fresh;
  gpt.zero_grad();
  manual_seed(77);
  BudgetStep r;
  MemoryScope scope;
  {
    std::optional<MemoryBudget> guard;
    if (plan) guard.emplace(*plan);
    else if (budget) guard.emplace(*budget);
    Tensor loss;
    {
      autocast on(mixed);
      loss = gpt.loss(idx, targets);
    }
    loss.backward();
    if (guard) r.log = guard->last_log();
  }
  r.peak_saved = scope.peak_saved_activation_bytes();
  r.grads = test::gradients(gpt);
  return r;
}

/// The least budget an autocast step needs, as the error of an infeasible one (1 byte) names it,
/// and that budget's plan; the step completes all the same.
struct LeastBudget {
  std::size_t bytes = 0;
  DiscardPlan plan;
  bool refused = false;  // the step said which budget would have worked
};

LeastBudget least_budget(nn::GPT& gpt, const LongTensor& idx, const LongTensor& targets) {
  test::FreshTape fresh;
  gpt.zero_grad();
  manual_seed(77);
  MemoryBudget guard(1);
  Tensor loss;
  {
    autocast on;
    loss = gpt.loss(idx, targets);
  }
  LeastBudget r;
  try {
    loss.backward();
  } catch (const Error& e) {
    r.refused = std::string(e.what()).find("smallest budget that works") != std::string::npos;
  }
  r.bytes = guard.least_feasible_bytes();
  r.plan = guard.plan();
  return r;
}

/// Recomputes of a matrix product (the ops autocast changes) in a budgeted step's log.
std::size_t product_recomputes(const BudgetLog& log) {
  std::size_t n = 0;
  for (const BudgetEvent& e : log.events)
    n += e.kind == BudgetEvent::Kind::recompute && (e.op == "linear" || e.op == "matmul");
  return n;
}


}  // namespace

TEST_CASE("autocast: a MemoryBudget's gradients equal the unbudgeted autocast run's bitwise, products recomputed",
          "[budget][autocast]") {
  Generator init(3);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  const BudgetStep free_run = budget_step(gpt, idx, targets, true, std::nullopt);
  // bfloat16 was in force: the float32 step's gradients differ.
  CHECK(budget_step(gpt, idx, targets, false, std::nullopt).grads != free_run.grads);

  // The least budget, as the error of an infeasible one names it (the step is complete all the same).
  const LeastBudget smallest = least_budget(gpt, idx, targets);
  CHECK(smallest.refused);
  CHECK(test::gradients(gpt) == free_run.grads);
  const std::size_t least = smallest.bytes;
  const DiscardPlan& least_plan = smallest.plan;
  // A budget that discards nothing holds no more than no budget: the inputs its recipes read are
  // not counted while anything else holds them, and let go once only the recipes do.
  const BudgetStep roomy = budget_step(gpt, idx, targets, true, std::size_t{1} << 30);
  CHECK(roomy.log.discards == 0);
  CHECK(roomy.peak_saved <= free_run.peak_saved);
  CHECK(roomy.grads == free_run.grads);
  INFO("no-budget peak " << free_run.peak_saved << " B, budgeted without discards " << roomy.peak_saved
                         << " B, least feasible " << least << " B");
  REQUIRE(least < roomy.peak_saved);

  // A budget between the two (searched), and the least budget's plan replayed.
  const BudgetStep searched = budget_step(gpt, idx, targets, true, (least + roomy.peak_saved) / 2);
  const BudgetStep at_least = budget_step(gpt, idx, targets, true, std::nullopt, least_plan);
  for (const BudgetStep* r : {&searched, &at_least}) {
    INFO(r->log.str());
    CHECK(r->log.discards > 0);
    CHECK(product_recomputes(r->log) > 0);  // a linear or matmul output rebuilt in backward, outside the scope
    CHECK(r->peak_saved <= r->log.budget);
    CHECK(r->grads == free_run.grads);
  }
  // The searched step's decisions as a static plan: the same again.
  const BudgetStep replayed = budget_step(gpt, idx, targets, true, std::nullopt, DiscardPlan::from(searched.log));
  CHECK(replayed.log.decisions == 0);
  CHECK(replayed.log.plan_misses == 0);
  CHECK(replayed.grads == free_run.grads);
}

// A product's recipe for the budget reads its operands as the GEMM takes them: under autocast the
// bfloat16 copies its node saves, never the float32 x and W beside them. Reading the float32
// operands instead (as before) made the least feasible budget 90272 B on this GPT, above the
// unbudgeted peak of 84896 B.
TEST_CASE("autocast: a MemoryBudget can hold a step below its unbudgeted autocast peak", "[budget][autocast]") {
  Generator init(3);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  const BudgetStep free_run = budget_step(gpt, idx, targets, true, std::nullopt);
  const LeastBudget least = least_budget(gpt, idx, targets);
  INFO("no-budget peak " << free_run.peak_saved << " B, least feasible " << least.bytes << " B");
  CHECK(least.bytes < free_run.peak_saved);
}

TEST_CASE("autocast: early stop on a GPT block's replay, bitwise the plain autocast run, on and off",
          "[checkpoint][early_stop][autocast]") {
  Generator init(5);
  nn::TransformerBlock block(16, 2, 0.1, true, init);
  const Tensor data = randn({2, 6, 16}, init);
  std::size_t skipped[3] = {};  // ops early stop skipped, by mode
  auto run = [&](int mode, bool mixed = true) {  // 0 plain, 1 checkpoint with early stop, 2 without
    return [&, mode, mixed] {
      CheckpointEarlyStop es(mode == 1);
      block.zero_grad();
      Tensor x = data.detach().requires_grad_();
      Tensor y;
      {
        autocast on(mixed);
        y = mode == 0 ? block(x) : checkpoint(block, x);
      }
      const detail::EarlyStopStats before = early_stop_stats();
      sum(y * y).backward();
      skipped[mode] = early_stop_stats().ops - before.ops;
      return testing::RunRecord().grads(block).tensor("gradient of x", x.grad());
    };
  };
  CHECK_SAME_RUNS(run(0), run(1), 9);
  CHECK_SAME_RUNS(run(0), run(2), 9);
  CHECK(skipped[2] == 0);
  // As in float32: the MLP's output projection, then its dropout + residual. The projection saves
  // the bfloat16 copy of its input, which is not an op output; it was made before the projection
  // began, so the replay computes up to the op before it and the copy is made again from there.
  CHECK(skipped[1] == 2);
  const testing::GradientComparison fp32 = testing::compare_runs(run(1, false), run(1), 9);
  CHECK_FALSE(fp32.equal);
}

TEST_CASE("autocast: early stop in a chain's replays and in a GPT's checkpointed blocks, bitwise",
          "[chain][early_stop][autocast]") {
  Generator init(43);
  nn::Linear lin(8, 8, true, init);
  const Tensor data = randn({3, 8}, init);
  const std::vector<ChainStep> steps(9, [&](const Tensor& h) { return h + dropout(tanh(lin(h)), 0.2) * 0.5f; });
  auto run = [&](int mode) {  // 0 plain, 1 binomial:2 with early stop, 2 without
    return [&, mode] {
      CheckpointEarlyStop es(mode == 1);
      lin.zero_grad();
      Tensor x = data.detach().requires_grad_();
      Tensor y = x;
      {
        autocast on;
        if (mode == 0) for (const ChainStep& s : steps) y = s(y);
        else y = checkpoint_sequential(steps, x, policy::binomial(2));
      }
      sum(y * y).backward();
      return testing::RunRecord().grads(lin).grad("x", x);
    };
  };
  CHECK_SAME_RUNS(run(0), run(1), 5);
  CHECK_SAME_RUNS(run(0), run(2), 5);

  test::GptStep step(nullptr);
  auto loss = [&] {
    autocast on;
    return step.loss();
  };
  for (const bool early : {true, false}) {
    CheckpointEarlyStop es(early);
    INFO("early stop " << (early ? "on" : "off"));
    for (const char* how : {"blocks", "sqrt"}) {
      INFO(how);
      const testing::GradientComparison r = testing::compare_checkpointing(step.gpt, policy::parse(how), loss, 7);
      INFO(r.message);
      CHECK(r.equal);
    }
  }
}

TEST_CASE("autocast: a GPT's chain under budget and two_tier schedules equals the plain autocast run bitwise",
          "[chain][two_tier][autocast]") {
  test::TempDir dir;
  test::GptStep step(nullptr);
  auto loss = [&] {
    autocast on;
    return step.loss();
  };
  // 64 KiB: below what the 3 blocks hold when recorded, so the budget schedule recomputes.
  for (const Policy& p : {policy::budget(std::size_t{64} << 10), policy::two_tier(0, 2, dir.path, {0, 0}),
                          policy::two_tier(1, 1, dir.path, {0, 0})}) {
    INFO(p.name);
    const testing::GradientComparison r = testing::compare_checkpointing(step.gpt, Checkpointing::chain(p), loss, 7);
    INFO(r.message);
    CHECK(r.equal);
    CHECK(dir.files().empty());
  }
}

TEST_CASE("autocast: chains under budget, two_tier (disk) and online schedules replay in bfloat16, bitwise",
          "[chain][two_tier][online][autocast]") {
  test::TempDir dir;
  Generator init(47);
  nn::Linear lin(8, 8, true, init);
  const Tensor data = randn({3, 8}, init);
  const ChainStep step = [&](const Tensor& h) { return h + dropout(tanh(lin(h)), 0.2) * 0.5f; };
  const std::int64_t L = 12;
  const std::vector<ChainStep> steps(static_cast<std::size_t>(L), step);
  // kind: 0 plain loop, 1 checkpoint_sequential under `p`, 2 OnlineChain with `slots` snapshots.
  auto run = [&](int kind, const Policy* p, std::int64_t slots, bool mixed, std::shared_ptr<ChainCounts> counts) {
    lin.zero_grad();
    Tensor x = data.detach().requires_grad_();
    Tensor y = x;
    std::optional<OnlineChain> chain;
    {
      autocast on(mixed);
      if (kind == 0) for (const ChainStep& s : steps) y = s(y);
      else if (kind == 1) y = checkpoint_sequential(steps, x, *p, nullptr, counts);
      else {
        chain.emplace(x, slots);
        for (std::int64_t i = 0; i < L; ++i) chain->advance(step);
      }
    }
    if (kind == 2) y = chain->finish(counts);  // outside the scope
    sum(y * y).backward();
    return testing::RunRecord().grads(lin).grad("x", x).tensor("output", y);
  };
  auto plain = [&] { return run(0, nullptr, 0, true, nullptr); };
  const std::vector<Policy> policies{policy::budget(1200), policy::two_tier(0, 3, dir.path, {0, 0}),
                                     policy::two_tier(1, 2, dir.path, {0, 0})};
  for (const Policy& p : policies) {
    INFO(p.name);
    auto counts = std::make_shared<ChainCounts>();
    CHECK_SAME_RUNS(plain, [&] { return run(1, &p, 0, true, counts); }, 5);
    CHECK(counts->advances > 0);  // steps were run again in backward
    if (p.name.rfind("two_tier", 0) == 0) CHECK(counts->disk_writes > 0);
    CHECK(dir.files().empty());
  }
  for (const std::int64_t s : {2, 3}) {
    INFO("online:" << s);
    auto counts = std::make_shared<ChainCounts>();
    CHECK_SAME_RUNS(plain, [&] { return run(2, nullptr, s, true, counts); }, 5);
    CHECK(counts->advances > 0);
  }
  // The plain autocast run is not the float32 one.
  CHECK_FALSE(testing::compare_runs(plain, [&] { return run(0, nullptr, 0, false, nullptr); }, 5).equal);
}
