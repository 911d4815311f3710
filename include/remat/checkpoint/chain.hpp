#pragma once
// checkpoint_sequential(steps, x, policy): runs a chain x_{i+1} = f_i(x_i) under a schedule and
// puts one node on the tape. The forward pass runs the schedule up to recording the last step;
// the node's backward runs the rest. Every execution of step i sees the generator state step i saw
// in the forward pass, and replays run with is_replaying() set, as checkpoint() does.

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "remat/checkpoint/budget.hpp"
#include "remat/checkpoint/replay.hpp"
#include "remat/checkpoint/schedule.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/random.hpp"

namespace remat {

using ChainStep = std::function<Tensor(const Tensor&)>;

/// What an executor did, to compare with its plan.
struct ChainCounts {
  std::int64_t advances = 0;
  std::int64_t records = 0;
  std::int64_t peak_snapshots = 0;
};

/// Measures each step once, recorded on a scratch tape: compute in seconds, the bytes of its
/// input, and the bytes its tape saves. Used by policies that need costs (budget).
inline std::vector<StepCost> measure_steps(const std::vector<ChainStep>& steps, const Tensor& x) {
  std::vector<StepCost> costs;
  const Generator::State rng = default_generator().state();
  Tensor h = x.detach();
  for (const ChainStep& f : steps) {
    Tape scratch;
    TapeGuard use(scratch);
    const std::size_t before = memory_stats().saved_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    Tensor leaf = h.detach();
    leaf.requires_grad_();
    const Tensor y = f(leaf);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    costs.push_back({secs, h.nbytes(), memory_stats().saved_bytes - before});
    h = y.detach();
  }
  default_generator().set_state(rng);
  return costs;
}

namespace detail {

/// A kept state counted as saved for backward while held.
class Snapshot {
 public:
  explicit Snapshot(const Tensor& t) : tensor_(t.detach()) { tensor_.storage()->retain_saved(); }
  ~Snapshot() {
    if (tensor_.defined()) tensor_.storage()->release_saved();
  }
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;
  const Tensor& tensor() const { return tensor_; }

 private:
  Tensor tensor_;
};

struct ChainRun {
  std::vector<ChainStep> steps;
  Plan plan;
  std::vector<Generator::State> rng;  // each step's generator state at its first execution
  std::int64_t position = 0;
  Tensor current;
  std::map<std::int64_t, std::unique_ptr<Snapshot>> kept;
  struct Recorded {
    std::unique_ptr<RecordedRun> run;
    Tensor input, output;
  };
  std::map<std::int64_t, Recorded> recorded;
  Tensor grad;  // gradient of x_{next reversed + 1}
  bool input_requires_grad = false;
  ChainCounts counts;
  std::shared_ptr<ChainCounts> report;  // where the caller reads the counts

  /// Step i on x: in forward its first execution notes the generator state; every later one is
  /// a replay from that state.
  Tensor run_step(std::int64_t i, const Tensor& x, bool in_forward) {
    const auto k = static_cast<std::size_t>(i);
    if (!in_forward) return as_replay(rng[k], [&] { return steps[k](x); });
    if (rng.size() == k) rng.push_back(default_generator().state());
    return steps[k](x);
  }

  void execute(const Action& act, bool in_forward) {
    using K = Action::Kind;
    const std::int64_t i = act.step;
    switch (act.kind) {
      case K::advance: {
        auto not_recording = scoped_recording(false);
        current = run_step(i, current, in_forward).detach();
        ++position;
        ++counts.advances;
        break;
      }
      case K::snapshot:
        kept[i] = std::make_unique<Snapshot>(current);
        counts.peak_snapshots = std::max<std::int64_t>(counts.peak_snapshots, static_cast<std::int64_t>(kept.size()));
        break;
      case K::restore:
        current = kept.at(i)->tensor();
        position = i;
        break;
      case K::free:
        kept.erase(i);
        break;
      case K::record: {
        Recorded r{std::make_unique<RecordedRun>(), current.detach(), Tensor()};
        if (i > 0 || input_requires_grad) r.input.requires_grad_();
        r.output = r.run->record([&] { return run_step(i, r.input, in_forward); });
        current = r.output.detach();
        recorded[i] = std::move(r);
        ++position;
        ++counts.records;
        break;
      }
      case K::reverse: {
        Recorded& r = recorded.at(i);
        r.run->backward({&r.output}, {grad});  // a step that returned its input passes grad straight through
        grad = r.input.grad().defined() ? r.input.grad() : zeros(r.input.shape());
        recorded.erase(i);
        break;
      }
    }
  }
};

}  // namespace detail

/// Runs x through `steps` under `policy` and returns x_L; one node on the tape. Costs, when the
/// policy needs them and none are given, are measured by running each step once. `counts`, when
/// given, receives what the executor did (filled in as the backward completes).
inline Tensor checkpoint_sequential(const std::vector<ChainStep>& steps, const Tensor& x, const Policy& policy,
                                    const std::vector<StepCost>* costs = nullptr,
                                    std::shared_ptr<ChainCounts> counts = nullptr) {
  const auto L = static_cast<std::int64_t>(steps.size());
  REMAT_CHECK(L >= 1, "checkpoint_sequential: needs at least one step");
  if (!is_grad_enabled()) {
    Tensor h = x;
    for (const ChainStep& f : steps) h = f(h);
    return h;
  }
  std::vector<StepCost> measured;
  if (policy.needs_costs && !costs) {
    measured = measure_steps(steps, x);
    costs = &measured;
  }
  auto run = std::make_shared<detail::ChainRun>();
  run->steps = steps;
  run->plan = plan(policy, L, costs);
  run->current = x.detach();
  run->input_requires_grad = x.requires_grad();
  run->report = counts;
  for (std::size_t a = 0; a < run->plan.forward_actions; ++a) run->execute(run->plan.actions[a], true);

  Tensor out = run->current;
  bool any_grad = false;
  for (auto& [i, r] : run->recorded) any_grad = any_grad || r.output.requires_grad();
  if (!any_grad) return out;
  // The snapshots kept in forward are held by the run; the node saves nothing of its own.
  detail::record<float>(fmt::format("chain[{}]", policy.name), {x}, {&out}, {}, [run](detail::BackwardContext<float>& ctx) {
    run->grad = detail::copy_of(ctx.grad_output());
    for (std::size_t a = run->plan.forward_actions; a < run->plan.actions.size(); ++a)
      run->execute(run->plan.actions[a], false);
    if (ctx.needs_grad(0)) ctx.accumulate(0, run->grad);
    if (run->report) *run->report = run->counts;
    run->kept.clear();
    run->recorded.clear();
  });
  return out;
}

/// Modules (e.g. a GPT's blocks) as chain steps, held by reference.
template <class Module>
std::vector<ChainStep> module_steps(const std::vector<std::unique_ptr<Module>>& modules) {
  std::vector<ChainStep> steps;
  for (const auto& m : modules) steps.push_back([mod = m.get()](const Tensor& h) { return (*mod)(h); });
  return steps;
}

template <class Module>
Tensor checkpoint_sequential(const std::vector<std::unique_ptr<Module>>& modules, const Tensor& x, const Policy& policy,
                             const std::vector<StepCost>* costs = nullptr, std::shared_ptr<ChainCounts> counts = nullptr) {
  return checkpoint_sequential(module_steps(modules), x, policy, costs, std::move(counts));
}

}  // namespace remat
