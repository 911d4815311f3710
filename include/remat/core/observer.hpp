#pragma once
// Observers: the listener kind that sees every event of this thread, unconditionally and in order —
// an op's begin and its outputs, what a node saves for backward, each op's backward, each leaf gradient, the
// start and end of backward and of every replay. Unlike the deciders (OpOutputHook, which decide
// for the ops of their run scope: reuse an output, skip a compute), observers decide nothing, and
// hear every scope, so no decider can hide
// an event from them: a profiler installed around a checkpointed model hears the ops inside each
// segment's forward, each replay and the backward. Observers nest; each hears every event, the
// outermost first.
//
// An op built from other ops is one op to observers, as to run scopes: while an op computes, the
// events of the ops inside it are not reported.

#include <cstddef>
#include <exception>
#include <string>
#include <vector>

#include "remat/core/saved_tensor.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

struct OpOutput;

/// An op's output tensors as observers see them: type-erased references (AnyTensor(values[i])
/// wraps one; AnyTensor::as<float>() gives the tensor).
using OpValues = std::vector<detail::TensorRef>;

/// What happened in a replay event: checkpoint() replaying a segment, or a chain replaying a step.
struct ReplayEvent {
  const char* kind;          ///< "checkpoint" or "chain"
  const char* name;          ///< the segment's name, or the chain's
  std::ptrdiff_t step = -1;  ///< the chain's step; -1 for a checkpoint
};

/// A listener that sees every event of this thread while it lives (install by constructing it;
/// observers on one thread are destroyed in the reverse order of their construction). Override
/// what you need; every method does nothing by default.
class Observer {
 public:
  Observer() : installed_(this) {}
  virtual ~Observer() = default;
  Observer(const Observer&) = delete;
  Observer& operator=(const Observer&) = delete;

  /// An op is about to make its outputs (`out` says which op and what it will make).
  virtual void op_begin(const OpOutput& out) { (void)out; }
  /// An op made its outputs: computed, handed over by a decider, or skipped by early stop (then
  /// `values` are storage nobody reads). When the op computed them, out.recompute offers how to
  /// compute them again (a memory budget takes it).
  virtual void op(const OpOutput& out, const OpValues& values) {
    (void)out, (void)values;
  }
  /// A node was recorded (or would be, in a checkpointed forward) that keeps `saved` for its backward.
  virtual void saved(const std::vector<detail::SavedTensor>& saved) { (void)saved; }
  /// The backward of the node named `name` (its op's name, or a checkpoint's) is about to run.
  virtual void backward_op(const char* name) { (void)name; }
  /// A leaf's .grad took a contribution; `leaf` is its autograd identity (its AutogradMeta).
  virtual void leaf_grad(const void* leaf) { (void)leaf; }
  /// Tensor::backward began; `outermost` is false for a backward inside another (a planner's dry run).
  virtual void backward_begin(bool outermost) { (void)outermost; }
  /// Tensor::backward ended, `completed` false when by an exception.
  virtual void backward_end(bool completed, bool outermost) { (void)completed, (void)outermost; }
  /// A replay began.
  virtual void replay_begin(const ReplayEvent& e) { (void)e; }
  /// The replay begun last ended (also when by an exception).
  virtual void replay_end(const ReplayEvent& e) { (void)e; }
  /// Why a backward that records its ops (create_graph) or carries tangents (hvp) must not run
  /// while this observer is installed; empty when it may. Asked before such a walk starts.
  virtual std::string refuses_higher_order() const { return {}; }

 private:
  detail::Install<&detail::Session::observers> installed_;
};

namespace detail {

/// Whether an event now would reach an observer: some are installed and no op is computing.
inline bool observers_listening() {
  const Session& s = session();
  return s.observers_quiet == 0 && !s.observers.empty();
}

/// Calls f(observer) for each observer of this thread, outermost first, unless an op is computing.
/// By index: an observer may install another while it hears an event (the list grows under us).
/// An observer that throws does not keep the event from the others: the first exception is
/// rethrown once every observer has heard it.
template <class F>
void notify(F&& f) {
  if (!observers_listening()) return;
  const std::vector<Observer*>& list = session().observers;
  std::exception_ptr first;
  for (std::size_t i = 0; i < list.size(); ++i) {
    try {
      f(*list[i]);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

/// RAII: observers hear nothing while it lives (an op computing its outputs from other ops).
class QuietObservers {
 public:
  QuietObservers() : quiet_(session().observers_quiet + 1) {}

 private:
  Install<&Session::observers_quiet> quiet_;
};

/// RAII: reports a replay's begin now and its end when it goes, also on an exception.
class ReplayNotice {
 public:
  explicit ReplayNotice(ReplayEvent e) : e_(e) {
    notify([&](Observer& o) { o.replay_begin(e_); });
  }
  ~ReplayNotice() {
    notify([&](Observer& o) { o.replay_end(e_); });
  }
  ReplayNotice(const ReplayNotice&) = delete;
  ReplayNotice& operator=(const ReplayNotice&) = delete;

 private:
  ReplayEvent e_;
};

}  // namespace detail

}  // namespace remat
