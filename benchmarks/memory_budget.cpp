// Step time against a hard memory budget (MemoryBudget), next to hand-placed checkpointing at the
// same memory. One JSON line per setting, for benchmarks/memory_budget.py.
//   memory_budget --model gpt|unet --layers 8 --width 256 --heads 4 --context 128 --batch 8 --vocab 256
//                 --fractions 1,0.9,...,0.1 --hand blocks,sqrt,budget:64 --rounds 3 --steps 2 --pairs 0 --own 0
// (the U-Net's --hand: levels, levels:K — checkpoint() around every K levels of each path)
// Every setting runs its steps in each round, settings alternating within a round; medians are
// taken over all rounds. Budgets are fractions of the no-checkpoint step's peak of activation bytes
// saved for backward (parameters apart, as the budget counts), and also each hand-placed policy's
// own measured peak (the equal-memory comparison). A budget below
// the least feasible one prints that least instead of a time. "budget" is a fresh budget every
// step (its search by staleness, every step); "budget+plan" replays the plan a budget living across
// steps settles on: the cheaper of its first step's search and its second's, which looks ahead
// with the first step's reads.
// With --own 1, "budget+own" also replays each searched step's own decisions (DiscardPlan::from its
// log): the searched step against it is what searching costs, apart from what it decides.
// With --pairs N, each hand-placed policy and the plan at its peak then run N more steps each, one
// of each in turn (which goes first alternates), and a "pair" line gives every pair's plan / hand
// ratio: on a shared machine the drift between two settings a round apart is as large as the
// difference asked about, and within a pair it mostly cancels.
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <remat/remat.hpp>

#include "flags.hpp"

namespace {

using namespace remat;

/// The U-Net-like stack of the tests, larger: each down block's output feeds its up block.
struct UNetLike : nn::Module {
  std::vector<std::unique_ptr<nn::Linear>> down, up;
  std::vector<std::unique_ptr<nn::LayerNorm>> norms;
  std::unique_ptr<nn::Linear> bottom, head;
  double p;

  UNetLike(int levels, std::int64_t width, double dropout, Generator& g) : p(dropout) {
    for (int i = 0; i < levels; ++i) {
      down.push_back(std::make_unique<nn::Linear>(width, width, true, g));
      up.push_back(std::make_unique<nn::Linear>(width, width, true, g));
      norms.push_back(std::make_unique<nn::LayerNorm>(width));
      register_module("down" + std::to_string(i), *down.back());
      register_module("up" + std::to_string(i), *up.back());
      register_module("norm" + std::to_string(i), *norms.back());
    }
    bottom = std::make_unique<nn::Linear>(width, width, true, g);
    head = std::make_unique<nn::Linear>(width, width, true, g);
    register_module("bottom", *bottom);
    register_module("head", *head);
  }

  /// Hand placement for a stack that is not a chain: with `group` > 0, every `group` consecutive
  /// levels of the down path are one checkpoint() segment (its outputs: their skips), and so are
  /// every `group` levels of the up path (its boundary: the stream and their skips).
  Tensor forward(const Tensor& x, std::size_t group = 0) {
    const std::size_t levels = down.size();
    std::vector<Tensor> skips;
    Tensor h = x;
    for (std::size_t i = 0; i < levels; i += std::max<std::size_t>(group, 1)) {
      const std::size_t end = group ? std::min(levels, i + group) : i + 1;
      auto downs = [this, i, end](const Tensor& in) {
        std::vector<Tensor> out;
        Tensor t = in;
        for (std::size_t k = i; k < end; ++k) out.push_back(t = dropout(gelu((*down[k])(t)), p));
        return out;
      };
      const std::vector<Tensor> made = group ? checkpoint(std::move(downs), h) : downs(h);  // the node keeps downs
      skips.insert(skips.end(), made.begin(), made.end());
      h = made.back();
    }
    h = tanh((*bottom)(h));
    for (std::size_t stop = levels; stop > 0;) {
      const std::size_t first = group && stop > group ? stop - group : group ? 0 : stop - 1;
      auto ups = [this, first, stop](const Tensor& in, const std::vector<Tensor>& skip) {
        Tensor t = in;
        for (std::size_t k = stop; k-- > first;) t = (*norms[k])(gelu((*up[k])(t)) + skip[k - first]);
        return t;
      };
      const std::vector<Tensor> skip(skips.begin() + static_cast<std::ptrdiff_t>(first),
                                     skips.begin() + static_cast<std::ptrdiff_t>(stop));
      h = group ? checkpoint(std::move(ups), h, skip) : ups(h, skip);
      stop = first;
    }
    return (*head)(h);
  }
};

/// The U-Net's hand placements: "levels" (each level a segment) or "levels:K" (K levels a segment).
std::size_t unet_group(const std::string& policy) {
  if (policy == "none" || policy.rfind("budget", 0) == 0) return 0;
  if (policy == "levels") return 1;
  REMAT_CHECK(policy.rfind("levels:", 0) == 0 && policy.size() > 7 && std::stoll(policy.substr(7)) > 0,
              "memory_budget: the U-Net's hand placements are levels and levels:K (K > 0), got {}", policy);
  return static_cast<std::size_t>(std::stoll(policy.substr(7)));
}

struct Setting {
  explicit Setting(std::string p, std::size_t bytes = 0, std::string from = {})
      : policy(std::move(p)), budget(bytes), at(std::move(from)) {}
  std::string policy;          // none, a hand-placed policy, budget, budget+plan or budget+own
  std::size_t budget;          // for budget settings
  std::string at;              // what the budget was derived from: a fraction or a hand policy
  std::vector<double> ms;
  std::size_t peak = 0;
  BudgetLog log;
  std::optional<DiscardPlan> plan;
  std::size_t infeasible_least = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(
      argc, argv,
      {{"model", "gpt"}, {"layers", "8"}, {"width", "256"}, {"heads", "4"}, {"context", "128"}, {"batch", "8"},
       {"vocab", "256"}, {"dropout", "0.1"}, {"fractions", "1,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2,0.1"},
       {"hand", "blocks,sqrt"}, {"rounds", "3"}, {"steps", "2"}, {"pairs", "0"}, {"own", "0"}},
      "memory_budget");
  Generator gen(0);
  const bool gpt_model = a["model"] == "gpt";
  REMAT_CHECK(gpt_model || a["model"] == "unet", "memory_budget: --model is gpt or unet, got {}", a["model"]);
  std::unique_ptr<nn::GPT> gpt;
  std::unique_ptr<UNetLike> unet;
  LongTensor idx, targets;
  Tensor x;
  if (gpt_model) {
    gpt = std::make_unique<nn::GPT>(bench::gpt_config(a, std::stod(a["dropout"])), gen);
    idx = randint(0, gpt->config.vocab_size, {std::stoll(a["batch"]), gpt->config.block_size}, gen);
    targets = randint(0, gpt->config.vocab_size, {std::stoll(a["batch"]), gpt->config.block_size}, gen);
  } else {
    unet = std::make_unique<UNetLike>(static_cast<int>(std::stoll(a["layers"])), std::stoll(a["width"]),
                                      std::stod(a["dropout"]), gen);
    x = randn({std::stoll(a["batch"]) * std::stoll(a["context"]), std::stoll(a["width"])}, gen);
  }
  nn::Module& model = gpt_model ? static_cast<nn::Module&>(*gpt) : static_cast<nn::Module&>(*unet);
  optim::SGD sgd(model.parameters(), {1e-4});
  std::size_t unet_levels = 0;  // the U-Net's hand placement of the setting running
  auto loss = [&] {
    if (gpt_model) return gpt->loss(idx, targets);
    const Tensor y = unet->forward(x, unet_levels);
    return mean(y * y);
  };

  // Each policy parsed once, as a training loop applies it once: a chain policy's measured costs
  // and schedule stay with it from step to step.
  std::map<std::string, Checkpointing> parsed;
  // One step of a setting; returns its time in ms.
  auto run = [&](Setting& s, bool record) {
    const bool budgeted = s.policy.rfind("budget", 0) == 0 && s.policy.find(':') == std::string::npos;
    if (gpt_model) {
      if (budgeted || s.policy == "none") apply_checkpointing(*gpt, Checkpointing::none());
      else {
        auto it = parsed.find(s.policy);
        if (it == parsed.end()) it = parsed.emplace(s.policy, policy::parse(s.policy)).first;
        apply_checkpointing(*gpt, it->second);
      }
    } else {
      unet_levels = unet_group(s.policy);
    }
    const std::size_t base = memory_stats().saved_activation_bytes;
    MemoryScope scope;
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::optional<MemoryBudget> guard;
      if (s.policy == "budget+plan" || s.policy == "budget+own") guard.emplace(*s.plan);
      else if (s.policy == "budget") guard.emplace(s.budget);
      try {
        loss().backward();
      } catch (const Error&) {
        if (!guard || guard->least_feasible_bytes() == 0) throw;
        s.infeasible_least = guard->least_feasible_bytes();
        s.plan = guard->plan();
        return;
      }
      if (guard) s.log = guard->last_log();
    }
    sgd.step();
    sgd.zero_grad();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (record) {
      s.ms.push_back(t);
      s.peak = std::max(s.peak, scope.peak_saved_activation_bytes() - base);
    }
  };

  // Two steps under one budget, without checkpointing: what it replays from its third step on.
  auto settled_plan = [&](std::size_t bytes) {
    if (gpt_model) apply_checkpointing(*gpt, Checkpointing::none());
    unet_levels = 0;
    MemoryBudget living(bytes);
    for (int i = 0; i < 2; ++i) {
      loss().backward();
      sgd.step();
      sgd.zero_grad();
    }
    return living.plan();
  };

  std::vector<Setting> settings;
  Setting none{"none"};
  run(none, true);
  const std::size_t free_peak = none.peak;
  settings.push_back(none);
  std::vector<Setting> hand;
  {
    std::stringstream list(a["hand"]);
    for (std::string p; std::getline(list, p, ',');) {
      Setting h{p};
      run(h, true);
      hand.push_back(h);
      settings.push_back(h);
    }
  }
  std::optional<Setting> at_least;  // the least feasible budget, replaying the plan that measured it
  auto add_budget = [&](std::size_t bytes, const std::string& at) {
    Setting s{"budget", bytes, at};
    run(s, false);
    if (s.infeasible_least) {
      fmt::print("{{\"model\": \"{}\", \"policy\": \"budget\", \"at\": \"{}\", \"budget\": {}, \"free_peak\": {}, "
                 "\"infeasible_least\": {}}}\n", a["model"], at, bytes, free_peak, s.infeasible_least);
      if (!at_least || s.infeasible_least < at_least->budget) {
        at_least.emplace("budget+plan", s.infeasible_least, "least");
        at_least->plan = s.plan;
      }
      return;
    }
    if (a["own"] == "1") {
      Setting own = s;
      own.policy = "budget+own";
      own.plan = DiscardPlan::from(s.log);
      settings.push_back(own);
    }
    s.plan = settled_plan(bytes);
    settings.push_back(s);
    Setting planned = s;
    planned.policy = "budget+plan";
    settings.push_back(planned);
  };
  std::stringstream fractions(a["fractions"]);
  for (std::string f; std::getline(fractions, f, ',');)
    add_budget(static_cast<std::size_t>(std::stod(f) * static_cast<double>(free_peak)), f);
  for (const Setting& h : hand) add_budget(h.peak, h.policy);
  if (at_least) settings.push_back(*at_least);

  for (Setting& s : settings) s.ms.clear();
  const int rounds = std::stoi(a["rounds"]), steps = std::stoi(a["steps"]);
  for (int r = 0; r < rounds; ++r)
    for (Setting& s : settings)
      for (int i = 0; i < steps; ++i) run(s, true);

  for (const Setting& s : settings)
    fmt::print("{{\"model\": \"{}\", \"policy\": \"{}\", \"at\": \"{}\", \"budget\": {}, \"free_peak\": {}, "
               "\"saved_peak\": {}, \"ms\": [{:.3f}], \"median_ms\": {:.3f}, \"discards\": {}, \"recomputes\": {}, "
               "\"recomputed_gflop\": {:.4f}, \"decisions\": {}, \"search_ms\": {:.3f}, \"recost_ms\": {:.3f}, "
               "\"threads\": {}}}\n",
               a["model"], s.policy, s.at, s.budget, free_peak, s.peak, fmt::join(s.ms, ", "), median(s.ms),
               s.log.discards, s.log.recomputes, s.log.recomputed_flops / 1e9, s.log.decisions, s.log.search_seconds * 1e3,
               s.log.recost_seconds * 1e3, get_num_threads());

  const int pairs = std::stoi(a["pairs"]);
  for (const Setting& h : hand) {
    const auto at = std::find_if(settings.begin(), settings.end(),
                                 [&](const Setting& s) { return s.policy == "budget+plan" && s.at == h.policy; });
    if (pairs <= 0 || at == settings.end()) continue;
    Setting by_hand = h, planned = *at;
    by_hand.ms.clear();
    planned.ms.clear();
    std::vector<double> ratios;
    for (int i = 0; i < pairs; ++i) {
      Setting* order[2] = {&by_hand, &planned};
      if (i % 2 == 1) std::swap(order[0], order[1]);
      for (Setting* s : order) run(*s, true);
      ratios.push_back(planned.ms.back() / by_hand.ms.back());
    }
    fmt::print("{{\"model\": \"{}\", \"policy\": \"pair\", \"at\": \"{}\", \"ratios\": [{:.4f}], "
               "\"median_ratio\": {:.4f}, \"hand_ms\": {:.3f}, \"plan_ms\": {:.3f}}}\n",
               a["model"], h.policy, fmt::join(ratios, ", "), median(ratios), median(by_hand.ms), median(planned.ms));
  }
  return 0;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
