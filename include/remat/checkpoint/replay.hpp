#pragma once
// The replay protocol, written once for checkpoint() and for the chain executor:
//
//   1. as_replay(rng, others, fn): the thread's default generator is set to the state the forward
//      started at, and every other generator the forward drew from to its state at its first draw
//      (detail::RecordDraws noted them), all put back afterwards (so the backward does not disturb
//      the caller's random streams); while fn runs, is_replaying() is true, so user code can skip
//      side effects.
//   2. RecordedRun::record(fn): fn runs with recording and grad mode on, its ops going onto a tape
//      of the run's own, nested inside whatever is current (a checkpointed forward records
//      nothing, but its replay must).
//   3. RecordedRun::backward(outputs, grads): each output's gradient is seeded, the run's tape is
//      walked backward, delivering gradients to the run's inputs (which carry the original
//      inputs' autograd identities, BackwardContext::as_input, so shared inputs accumulate in
//      plain order) and to every parameter the segment read; its activations are freed as it goes.
//
// Because random ops draw from the restored generator state and every CPU kernel is
// deterministic, a replay recomputes the forward's values bit for bit.

#include <optional>
#include <utility>
#include <vector>

#include "remat/checkpoint/early_stop.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/random.hpp"
#include "remat/core/scoped.hpp"

namespace remat::detail {

/// Whether replays are also checked value by value (CheckpointChecking), not only by shape.
inline bool& checkpoint_checking_flag() {
  thread_local bool on = false;
  return on;
}

/// Whether checkpoints record the op traces of forward and replay (CheckpointDebug).
inline bool& checkpoint_debug_flag() {
  thread_local bool on = false;
  return on;
}

/// The modes a replayed computation (a checkpoint's segment, a chain's steps) runs under, composed
/// by one rule from the thread's scopes (CheckpointChecking, CheckpointEarlyStop, CheckpointDebug)
/// and its own options: checking values needs every output computed, so it turns early stop off.
struct ReplayModes {
  bool check_values = false;
  bool early_stop = true;
  bool debug = false;

  static ReplayModes compose(bool check_values = false, bool early_stop = true, bool debug = false) {
    ReplayModes m;
    m.check_values = check_values || checkpoint_checking_flag();
    m.early_stop = early_stop && checkpoint_early_stop_flag() && !m.check_values;
    m.debug = debug || checkpoint_debug_flag();
    return m;
  }
};

/// FNV-1a over the bytes: kernels are deterministic on the CPU, so a faithful replay reproduces
/// every bit and any drift changes the hash.
template <class T>
std::uint64_t fingerprint(const BasicTensor<T>& t) {
  return fnv1a(t.data(), t.nbytes());
}


/// Runs fn() as the replay of a computation that first ran with the default generator at `rng`
/// and drew from the generators `others` (null: none) at the states noted there.
template <class F>
decltype(auto) as_replay(Generator::State rng, const DrawnGenerators* others, F&& fn) {
  ScopedValue<Generator::State> generator(default_generator().state_slot(), rng);
  std::optional<RestoreDraws> restored;
  if (others && !others->empty()) restored.emplace(*others);
  auto replaying = scoped_replay();
  return std::forward<F>(fn)();
}

/// A computation recorded on a tape of its own, to be walked backward once.
class RecordedRun {
 public:
  /// Runs fn() recording onto this run's tape, whatever the enclosing grad and recording modes.
  template <class F>
  decltype(auto) record(F&& fn) {
    TapeGuard use(tape_);
    auto recording = scoped_recording(true);
    enable_grad grad_on;
    return std::forward<F>(fn)();
  }

  /// Seeds grads[i] into outputs[i] (for outputs that require grad) and backpropagates the whole
  /// tape, freeing its activations unless `retain_graph` (then it can be walked again).
  void backward(const std::vector<Tensor*>& outputs, const std::vector<Tensor>& grads, bool retain_graph = false) {
    REMAT_ASSERT(outputs.size() == grads.size());
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i]->requires_grad() && grads[i].defined()) accumulate_grad(*outputs[i]->meta(), copy_of(grads[i]));
    tape_.backward(tape_.position(), 0, retain_graph);
  }

  const Tape& tape() const { return tape_; }

 private:
  Tape tape_;
};

}  // namespace remat::detail

namespace remat {

/// RAII: every checkpoint and chain created while it lives also checks its replays' values (a hash
/// of the bytes), not just their shapes.
class CheckpointChecking {
 public:
  /// on: check values (the default when constructed); off: shapes only.
  explicit CheckpointChecking(bool on = true) : guard_(detail::checkpoint_checking_flag(), on) {}

 private:
  ScopedValue<bool> guard_;
};

/// RAII: every checkpoint created while it lives records the op sequence of its forward and of its
/// replay, and a replay that differs says at which op (CheckpointOptions::debug, for all of them).
class CheckpointDebug {
 public:
  /// on: trace and compare the op sequences (the default when constructed); off: do not.
  explicit CheckpointDebug(bool on = true) : guard_(detail::checkpoint_debug_flag(), on) {}

 private:
  ScopedValue<bool> guard_;
};

}  // namespace remat
