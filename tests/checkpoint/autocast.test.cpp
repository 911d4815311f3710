// remat::autocast through checkpointing: a segment and a chain step replay under the autocast
// state their forward ran under, so with backward outside the autocast scope (PyTorch's pattern)
// the gradients are bitwise those of the run without checkpointing, dropout on.

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("autocast: a checkpointed GPT's gradients equal the plain run's bitwise, for every policy",
          "[checkpoint][autocast]") {
  test::GptStep step(nullptr);
  // The forward under autocast, the backward (run by the comparison) outside it.
  auto loss = [&] {
    autocast on;
    return step.loss();
  };
  for (const char* how : {"blocks", "selective", "sqrt", "binomial:2", "uniform:2"}) {
    INFO(how);
    const testing::GradientComparison r = testing::compare_checkpointing(step.gpt, policy::parse(how), loss, 7);
    INFO(r.message);
    CHECK(r.equal);
  }
  // And the runs were in bfloat16: the float32 run's loss differs.
  manual_seed(7);
  const float mixed = loss().item();
  manual_seed(7);
  const float fp32 = step.loss().item();
  CHECK(mixed != fp32);
}

TEST_CASE("autocast: a chain step under binomial replays in bfloat16 when backward runs in float32",
          "[chain][autocast]") {
  Generator init(41);
  nn::Linear lin(8, 8, true, init);
  const Tensor data = randn({3, 8}, init);
  std::vector<ChainStep> steps;
  for (int i = 0; i < 9; ++i) steps.push_back([&](const Tensor& x) { return tanh(dropout(lin(x), 0.2, true)); });
  auto run = [&](const std::optional<Policy>& p) {
    lin.zero_grad();
    Tensor x = data.detach().requires_grad_();
    Tensor y = x;
    {
      autocast on;
      if (p) y = checkpoint_sequential(steps, x, *p);
      else for (const ChainStep& s : steps) y = s(y);
    }
    sum(y * y).backward();
    return testing::RunRecord().grads(lin).grad("x", x);
  };
  for (const char* how : {"binomial:2", "sqrt", "uniform:3"}) {
    const Policy p = *policy::parse(how).schedule;
    INFO(how);
    CHECK_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(p); }, 5);
  }
}
