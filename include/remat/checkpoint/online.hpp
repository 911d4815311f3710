#pragma once
// Chains of unknown length: an adaptive ODE integrator that stops at t_end, a stream that ends
// when it ends. OnlineChain runs steps as they arrive, keeps at most s snapshots chosen as it goes
// (OnlinePlacement, schedule/online_placement.hpp), and when finished reverses the chain with the
// offline binomial schedule on each interval between the snapshots it kept. It never needs the
// length in advance and never stops for lack of a rule: every placement decision is defined for
// every t.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "remat/checkpoint/chain.hpp"
#include "remat/schedule/online_placement.hpp"
#include "remat/schedule/schedule.hpp"

namespace remat {

/// A chain whose steps arrive one at a time. Call advance(step) until your stopping condition
/// holds, then finish() for the final state as a tensor whose backward reverses the whole chain:
/// gradients bitwise equal to running the steps without checkpointing, at most `snapshots` states
/// kept (x_0 counting as one) plus the tape of the step just run.
///
///   remat::OnlineChain chain(x0, 10);
///   while (t < t_end) { chain.advance([&, dt](const Tensor& x) { return rk4(x, dt); }); t += dt; }
///   Tensor xT = chain.finish();
class OnlineChain {
 public:
  /// A chain from x = x_0 with `snapshots` slots; `name` names it in errors and reports.
  OnlineChain(const Tensor& x, std::int64_t snapshots, std::string name = "online_chain")
      : run_(std::make_shared<detail::ChainRun>(std::move(name), x)), placement_(snapshots), input_(x) {
    run_->execute({Action::Kind::snapshot, 0}, nullptr, true);
  }

  /// Runs the next step on the current state and returns the new state (read it to decide
  /// whether to go on; the graph is the one finish() returns).
  const Tensor& advance(ChainStep step) {
    REMAT_CHECK(static_cast<bool>(step), "{}: step {} is an empty function", run_->name, steps());
    return next([&] { run_->steps.start(std::move(step)); });
  }
  /// Runs the same function as the step before once more (an integrator's next time step): the
  /// chain then holds that function once however many steps it runs.
  const Tensor& advance() {
    REMAT_CHECK(steps() >= 1, "{}: advance() repeats the step before, but there is none yet: pass the first step",
                run_->name);
    return next([&] { run_->steps.extend(); });
  }

  /// The number of steps advanced so far.
  std::int64_t steps() const { return static_cast<std::int64_t>(run_->steps.size()); }
  /// The positions of the snapshots kept now (x_0 first).
  const std::vector<std::int64_t>& snapshots() const { return placement_.positions(); }

  /// The final state, connected to the chain's input and to every parameter the steps read: one
  /// node on the tape, whose backward reverses the chain. `counts`, when given, receives what the
  /// executor did once the backward completes.
  Tensor finish(std::shared_ptr<ChainCounts> counts = nullptr) {
    REMAT_CHECK(!finished_, "{}: finish() called twice", run_->name);
    REMAT_CHECK(steps() >= 1, "{}: finish() before any step", run_->name);
    finished_ = true;
    const std::int64_t L = steps(), s = placement_.snapshots();
    auto positions = std::make_shared<std::vector<std::int64_t>>(placement_.positions());
    run_->plan.policy = fmt::format("online:{}", s);
    run_->plan.steps = L;
    run_->plan.forward_actions = 0;
    run_->plan.stream = [positions, L, s]() -> std::unique_ptr<ActionStream> {
      return std::make_unique<detail::OnlineReversal>(*positions, L, s);
    };
    run_->report = std::move(counts);
    return detail::ChainRun::finish(run_, input_, run_->name);
  }

 private:
  template <class AddStep>
  const Tensor& next(AddStep add_step) {
    REMAT_CHECK(!finished_, "{}: advance after finish()", run_->name);
    const std::int64_t i = steps();
    if (i > 0) {
      // The step before is done: drop its tape (it will be recorded again when reversed), then
      // decide whether to keep the state it produced.
      run_->drop_record(i - 1);
      const OnlinePlacement::Decision d = placement_.at(i);
      if (d.drop >= 0) run_->execute({Action::Kind::free, d.drop}, nullptr, true);
      if (d.keep) run_->execute({Action::Kind::snapshot, i}, nullptr, true);
    }
    add_step();
    run_->execute({Action::Kind::record, i}, nullptr, true);
    return run_->current;
  }

  std::shared_ptr<detail::ChainRun> run_;
  OnlinePlacement placement_;
  Tensor input_;
  bool finished_ = false;
};

}  // namespace remat
