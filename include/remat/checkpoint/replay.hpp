#pragma once
// The replay protocol, written once for checkpoint() and for the chain executor:
//
//   1. as_replay(rng, others, autocast, fn): the thread's default generator is set to the state the
//      forward started at, and every other generator the forward drew from to its state at its
//      first draw (detail::RecordDraws noted them), all put back afterwards (so the backward does
//      not disturb the caller's random streams); autocast is as it was in the forward (a backward
//      usually runs outside the forward's autocast scope); while fn runs, is_replaying() is true,
//      so user code can skip side effects.
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

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "remat/checkpoint/early_stop.hpp"
#include "remat/core/autocast.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/random.hpp"
#include "remat/core/scoped.hpp"

namespace remat::detail {

/// The modes a replayed computation (a checkpoint's segment, a chain's steps) runs under, composed
/// by one rule from the thread's scopes (CheckpointChecking, CheckpointEarlyStop, CheckpointDebug)
/// and its own options: checking values needs every output computed, so it turns early stop off.
struct ReplayModes {
  bool check_values = false;
  bool early_stop = true;
  bool debug = false;

  static ReplayModes compose(bool check_values = false, bool early_stop = true, bool debug = false) {
    ReplayModes m;
    const Session& s = session();
    m.check_values = check_values || s.check_replay_values;
    m.early_stop = early_stop && s.early_stop && !m.check_values;
    m.debug = debug || s.debug_replay;
    return m;
  }
};

/// checksum64 over the bytes: kernels are deterministic on the CPU, so a faithful replay
/// reproduces every bit and any drift changes the hash. (Byte-wise FNV-1a ran 0.6 GB/s here, and
/// a chain's on-disk snapshots hash every state on write and on every read.)
template <class T>
std::uint64_t fingerprint(const BasicTensor<T>& t) {
  return checksum64(t.data(), t.nbytes());
}

/// One tensor the first run of a replayed computation produced, as its replays must produce it.
struct FirstRunOutput {
  bool defined = false;
  Shape shape;
  const char* dtype = nullptr;
  std::optional<std::uint64_t> hash;  ///< under check_values

  template <class T>
  static FirstRunOutput of(const BasicTensor<T>& t, bool check_values) {
    FirstRunOutput o;
    o.defined = t.defined();
    if (!o.defined) return o;
    o.shape = t.shape();
    o.dtype = t.dtype();
    if (check_values) o.hash = fingerprint(t);
    return o;
  }
};

/// The one rule a replay is checked by, for checkpoint()'s outputs and a chain's steps alike: the
/// same definedness, shape and element type as the first run, and the same bytes under
/// check_values. Returns, after `what` ("replay produced output 1"), how `t` differs and why it
/// matters; empty when it does not differ.
template <class T>
std::string replay_difference(const std::string& what, const BasicTensor<T>& t, const FirstRunOutput& first) {
  auto describe = [](bool defined, const Shape& shape, const char* dtype) {
    return defined ? fmt::format("shape {} ({})", shape, dtype) : std::string("undefined");
  };
  const bool same = t.defined() == first.defined &&
                    (!first.defined || (t.shape() == first.shape && std::strcmp(t.dtype(), first.dtype) == 0));
  if (!same)
    return fmt::format("{} as {} when replayed, but as {} in forward; what is replayed must compute the same thing "
                       "every time it runs (no dependence on state it changes)", what,
                       describe(t.defined(), t.defined() ? t.shape() : Shape{}, t.defined() ? t.dtype() : ""),
                       describe(first.defined, first.shape, first.dtype));
  if (first.hash && first.defined && fingerprint(t) != *first.hash)
    return fmt::format("{} with different values (shape {}) when replayed than in forward; it depends on state that "
                       "changed between forward and backward", what, first.shape);
  return {};
}


/// Runs fn() as the replay of a computation that first ran with the default generator at `rng`,
/// drew from the generators `others` (null: none) at the states noted there, and ran under
/// under `autocast` (remat::autocast on or off, and the parameter casts the forward made).
template <class F>
decltype(auto) as_replay(Generator::State rng, const DrawnGenerators* others, const AutocastState& autocast, F&& fn) {
  ScopedValue<Generator::State> generator(default_generator().state_slot(), rng);
  InstallAutocast precision(autocast);
  std::optional<RestoreDraws> restored;
  if (others && !others->empty()) restored.emplace(*others);
  auto replaying = scoped_replay();
  return std::forward<F>(fn)();
}

/// A computation recorded on a tape of its own, to be walked backward once; or, for a backward
/// that records its ops (create_graph), recorded onto the tape that backward walks, where it stays
/// (after the nodes that walk visits, before the ones its own walk records) for a second
/// differentiation to walk it too.
class RecordedRun {
 public:
  /// A run on a tape of its own.
  RecordedRun() = default;
  /// A run recorded onto `onto` from its current position on.
  explicit RecordedRun(Tape& onto) : onto_(&onto), first_(onto.position()) {}
  RecordedRun(const RecordedRun&) = delete;
  RecordedRun& operator=(const RecordedRun&) = delete;

  /// Runs fn() recording onto this run's tape, whatever the enclosing grad and recording modes.
  template <class F>
  decltype(auto) record(F&& fn) {
    TapeGuard use(onto_ ? *onto_ : tape_);
    auto recording = scoped_recording(true);
    enable_grad grad_on;
    return std::forward<F>(fn)();
  }

  /// Seeds grads[i] into outputs[i] (for outputs that require grad) and backpropagates the whole
  /// run, freeing its activations unless `retain_graph` (then it can be walked again). A run on
  /// another tape walks its own stretch of it, recording its ops (create_graph), and keeps it.
  void backward(const std::vector<Tensor*>& outputs, const std::vector<Tensor>& grads, bool retain_graph = false) {
    walk([&](bool keep) { seed(outputs, grads, keep); }, retain_graph);
  }
  /// backward() for outputs of several floating types, each type's gradients in its place.
  void backward(const PerFloatingType<TensorPointers>& outputs, const PerFloatingType<TensorList>& grads,
                bool retain_graph = false) {
    walk(
        [&](bool keep) {
          seed(outputs.get<float>(), grads.get<float>(), keep);
          seed(outputs.get<double>(), grads.get<double>(), keep);
          seed(outputs.get<bfloat16>(), grads.get<bfloat16>(), keep);
        },
        retain_graph);
  }

  const Tape& tape() const { return onto_ ? *onto_ : tape_; }

 private:
  template <class T>
  static void seed(const std::vector<BasicTensor<T>*>& outputs, const std::vector<BasicTensor<T>>& grads, bool keep) {
    REMAT_ASSERT(outputs.size() == grads.size());
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i]->requires_grad() && grads[i].defined())
        accumulate_grad(*outputs[i]->meta(), keep ? grads[i] : copy_of(grads[i]), keep);
  }

  /// Seeds the outputs (seed_all(keep): the gradients as they are when `keep`, a graph or
  /// tangents, else copies) and walks the run backward.
  template <class SeedAll>
  void walk(SeedAll&& seed_all, bool retain_graph) {
    const bool graph = onto_ != nullptr;
    const bool keep = graph || session().tangent_walk;
    const TapePosition end = onto_ ? onto_->position() : 0;  // the run's last node, before any seeding sum
    seed_all(keep);
    if (!graph) return tape_.backward(tape_.position(), 0, retain_graph);
    Install<&Session::create_graph> recorded(true);
    onto_->backward(end, first_, true);
  }

  Tape tape_;
  Tape* onto_ = nullptr;
  TapePosition first_ = 0;
};

}  // namespace remat::detail

namespace remat {

/// RAII: every checkpoint and chain created while it lives also checks its replays' values (a hash
/// of the bytes), not just their shapes.
class CheckpointChecking {
 public:
  /// on: check values (the default when constructed); off: shapes only.
  explicit CheckpointChecking(bool on = true) : guard_(on) {}

 private:
  detail::Install<&detail::Session::check_replay_values> guard_;
};

/// RAII: every checkpoint created while it lives records the op sequence of its forward and of its
/// replay, and a replay that differs says at which op (CheckpointOptions::debug, for all of them).
class CheckpointDebug {
 public:
  /// on: trace and compare the op sequences (the default when constructed); off: do not.
  explicit CheckpointDebug(bool on = true) : guard_(on) {}

 private:
  detail::Install<&detail::Session::debug_replay> guard_;
};

}  // namespace remat
