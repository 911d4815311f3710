#pragma once
// Checkpointing chosen by the caller and applied to a model from outside: the model exposes its
// blocks (nn::BlockStack) and knows nothing of memory policy; apply_checkpointing installs a
// runner that checkpoints each block, or runs the stack as a chain under a schedule.
//
//   remat::apply_checkpointing(gpt, remat::policy::parse("sqrt"));
//   remat::apply_checkpointing(gpt, remat::Checkpointing::each_block(remat::save_policy::matmuls()));

#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "remat/checkpoint/chain.hpp"
#include "remat/checkpoint/checkpoint.hpp"
#include "remat/schedule/budget.hpp"
#include "remat/schedule/schedule.hpp"

namespace remat {

/// How a stack of blocks is checkpointed: not at all, each block a checkpoint() segment (with an
/// optional selective save policy), or the whole stack a chain under a schedule.
struct Checkpointing {
  /// Which of the three ways.
  enum class Kind { none, each_block, chain };
  /// The way this one checkpoints.
  Kind kind = Kind::none;
  /// Names it in errors, reports and benchmark output.
  std::string name = "none";
  SavePolicy save;                 ///< each_block: op outputs kept inside each block
  std::optional<Policy> schedule;  ///< chain: the schedule
  /// chain: per-block costs for schedules that need them; measured on the first run when empty.
  std::shared_ptr<std::vector<StepCost>> costs = std::make_shared<std::vector<StepCost>>();

  /// No checkpointing: every block's activations saved as usual.
  static Checkpointing none() { return {}; }
  /// Each block a checkpoint() segment named `name`, keeping the op outputs `save` selects.
  static Checkpointing each_block(SavePolicy save = {}, std::string name = "blocks") {
    Checkpointing c;
    c.kind = Kind::each_block;
    c.name = std::move(name);
    c.save = std::move(save);
    return c;
  }
  /// The whole stack a chain run under `schedule` (a policy such as policy::parse("binomial:4")).
  static Checkpointing chain(Policy schedule) {
    Checkpointing c;
    c.kind = Kind::chain;
    c.name = schedule.name;
    c.schedule = std::move(schedule);
    return c;
  }

  /// The runner to install on a BlockStack (empty for none: blocks run plainly).
  std::function<Tensor(const std::vector<ChainStep>&, const Tensor&)> runner() const {
    switch (kind) {
      case Kind::none: return {};
      case Kind::each_block:
        return [save = save](const std::vector<ChainStep>& steps, const Tensor& x) {
          Tensor y = x;
          for (std::size_t i = 0; i < steps.size(); ++i)  // a copy of the step: the segment outlives `steps`
            y = checkpoint(CheckpointOptions{"block " + std::to_string(i), false, save}, ChainStep(steps[i]), y);
          return y;
        };
      case Kind::chain:
        return [schedule = *schedule, costs = costs](const std::vector<ChainStep>& steps, const Tensor& x) {
          if (schedule.needs_costs && costs->empty()) *costs = measure_steps(steps, x);
          return checkpoint_sequential(steps, x, schedule, costs->empty() ? nullptr : costs.get());
        };
    }
    return {};
  }
};

/// Installs `how` on a model that runs a stack of blocks (nn::GPT, nn::Sequential, or any type
/// with set_block_runner).
template <class Stack>
void apply_checkpointing(Stack& model, const Checkpointing& how) {
  model.set_block_runner(how.runner());
}

namespace policy {

/// The words every command line of the project accepts (train_gpt --policy, the benchmarks).
inline constexpr const char* kParseWords =
    "none, blocks (checkpoint every block), selective (every block, keeping matmul outputs), uniform:K, sqrt, "
    "binomial:S, budget:MB";

/// A Checkpointing from its name: none | blocks | selective | uniform:K | sqrt | binomial:S |
/// budget:MB (K, S positive integers; MB a positive number of MiB).
inline Checkpointing parse(std::string_view text) {
  const std::size_t colon = text.find(':');
  const std::string_view kind = text.substr(0, colon);
  const std::string arg(colon == std::string_view::npos ? std::string_view{} : text.substr(colon + 1));
  auto fail = [&](std::string_view why) -> Error {
    return Error(fmt::format("policy::parse: '{}' {}; the accepted policies are {}", text, why, kParseWords));
  };
  const bool takes_number = kind == "uniform" || kind == "binomial" || kind == "budget";
  if (takes_number != (colon != std::string_view::npos))
    throw fail(takes_number ? "needs a number after a colon" : "takes no argument");
  auto positive = [&](bool integer) {
    char* end = nullptr;
    const double v = std::strtod(arg.c_str(), &end);
    if (arg.empty() || *end != '\0' || !(v > 0) || (integer && v != static_cast<double>(static_cast<std::int64_t>(v))) ||
        v > 1e15)
      throw fail(integer ? "needs a positive whole number after the colon" : "needs a positive number after the colon");
    return v;
  };
  if (kind == "none") return Checkpointing::none();
  if (kind == "blocks") return Checkpointing::each_block();
  if (kind == "selective") return Checkpointing::each_block(save_policy::matmuls(), "selective");
  if (kind == "uniform") return Checkpointing::chain(uniform(static_cast<std::int64_t>(positive(true))));
  if (kind == "sqrt") return Checkpointing::chain(sqrt_segments());
  if (kind == "binomial") return Checkpointing::chain(binomial(static_cast<std::int64_t>(positive(true))));
  if (kind == "budget") return Checkpointing::chain(budget(static_cast<std::size_t>(positive(false) * 1024 * 1024)));
  throw fail("is not a policy");
}

}  // namespace policy
}  // namespace remat
