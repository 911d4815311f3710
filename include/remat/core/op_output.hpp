#pragma once
// The op-output hook: every op that can hand its output to someone else reports it here, and
// whoever needs to see op outputs installs a handler — selective checkpointing (keep an output in
// forward, hand it back in replay), and later a memory budget, a profiler or a trace. Ops know
// only this neutral hook, never who listens.
//
// Op identities are registered constants (`op::matmul`, `op::softmax`, ...), defined next to each
// op: policies name ops by these, so a typo is a compile error, and names given as strings are
// checked against the registry (find_op lists the known ones when a name is unknown).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

/// An op's identity: a name registered once by the op's own header.
class OpId {
 public:
  constexpr OpId() = default;
  /// The registered name, or "(unnamed op)" for a default-constructed id.
  const char* name() const { return name_ ? name_ : "(unnamed op)"; }
  friend bool operator==(OpId a, OpId b) { return a.name_ == b.name_ || (a.name_ && b.name_ && std::strcmp(a.name_, b.name_) == 0); }
  friend bool operator!=(OpId a, OpId b) { return !(a == b); }

 private:
  friend OpId register_op(const char* name);
  explicit constexpr OpId(const char* name) : name_(name) {}
  const char* name_ = nullptr;
};

namespace detail {
inline std::vector<const char*>& op_registry() {
  static std::vector<const char*> names;
  return names;
}
}  // namespace detail

/// Registers an op name (idempotent) and returns its identity. Op headers call it once each:
/// `namespace op { inline const OpId matmul = register_op("matmul"); }`.
inline OpId register_op(const char* name) {
  auto& names = detail::op_registry();
  for (const char* n : names)
    if (std::strcmp(n, name) == 0) return OpId(n);
  names.push_back(name);
  return OpId(name);
}

/// The names of every op registered so far (the ops whose headers this program includes), sorted.
inline std::vector<std::string> known_ops() {
  std::vector<std::string> out(detail::op_registry().begin(), detail::op_registry().end());
  std::sort(out.begin(), out.end());
  return out;
}

/// The op registered under `name`; a remat::Error listing the known names if there is none.
inline OpId find_op(std::string_view name, const char* who = "find_op") {
  for (const char* n : detail::op_registry())
    if (name == n) return register_op(n);
  throw Error(fmt::format("{}: no op is named '{}'; the known ops are: {}", who, name, fmt::join(known_ops(), ", ")));
}

/// What an op reports about its outputs, before computing them and after. Most ops have one
/// output; some also produce what their backward needs (layer_norm's per-row statistics, the
/// attention's log-sum-exp, max's indices, cross_entropy's probabilities): `count` says how many,
/// and they travel together, so whoever keeps an op's output keeps all of it.
struct OpOutput {
  /// Which op.
  OpId op;
  const Shape& shape;  ///< the op's (first) output; `shapes` has all `count` of them
  const char* dtype;   ///< its element type
  std::size_t count;   ///< tensors the op outputs
  std::size_t bytes;   ///< of all of them together
  double flops;        ///< the op's estimate of its work (copies count one per element): for cost models
  bool replaying;      ///< whether a checkpoint is replaying the op's forward now
  const Shape* shapes = nullptr;  ///< every output's shape (count of them)
  const char* const* dtypes = nullptr;  ///< every output's element type (count of them)
  /// How to compute the outputs again, when the op computed them (null when a handler handed them
  /// over or they were skipped): an observer that keeps recipes (a memory budget) takes it.
  const class RecomputeOffer* recompute = nullptr;
};

/// How to compute an op's outputs again, taken by whoever keeps it (a memory budget): the
/// storages the op's compute reads, and the compute itself, which returns fresh tensors bitwise
/// equal to the first ones (a random op's compute holds the generator state it drew at).
struct Recompute {
  /// The storages the compute reads (its inputs), which must stay available to recompute.
  std::vector<std::shared_ptr<detail::Storage>> reads;
  /// References to each of `reads` that `compute` itself holds (its captured tensors).
  std::vector<int> held_by_compute;
  /// Computes the outputs again: fresh tensors bitwise equal to the first ones.
  std::function<std::vector<detail::TensorRef>()> compute;
  /// Outputs whose storage has a serial below this existed before the op ran (a view of an
  /// input, as reshape makes): they are not the op's to recompute.
  std::uint64_t first_new_serial = 0;
};

/// An op's offer of its Recompute, made with the op's event: nothing is copied unless an observer
/// takes it (the op's compute and its inputs then live as long as the Recompute does).
class RecomputeOffer {
 public:
  /// The Recompute of the op that made this offer (valid only during that op's event).
  virtual Recompute take() const = 0;

 protected:
  ~RecomputeOffer() = default;
};

/// A handler of op outputs, installed for its lifetime on the current thread (handlers nest; the
/// innermost sees each output first). By default a handler passes everything to the one outside
/// it; a handler that owns the outputs of its scope (a checkpoint's selective saving) does not.
class OpOutputHook {
 public:
  OpOutputHook() : installed_(this) {}
  virtual ~OpOutputHook() = default;
  OpOutputHook(const OpOutputHook&) = delete;
  OpOutputHook& operator=(const OpOutputHook&) = delete;

  /// Before the op computes: stored tensors to use as its outputs instead (all `count` of them, in
  /// order), or none to let it compute.
  virtual std::vector<detail::TensorRef> reuse(const OpOutput& out) {
    return outer() ? outer()->reuse(out) : std::vector<detail::TensorRef>{};
  }
  /// Asked when reuse() supplied nothing: true when nobody will read the op's values (a replay past
  /// the last tensor its backward needs), so the op makes its outputs' storage without computing
  /// them. The outputs still carry their shapes, and the op still records its node.
  virtual bool skip(const OpOutput& out) { return outer() ? outer()->skip(out) : false; }
  /// After the op computed `values`, or was handed them by reuse(), or skipped them.
  virtual void produced(const OpOutput& out, const std::vector<detail::TensorRef>& values) {
    if (OpOutputHook* o = outer()) o->produced(out, values);
  }
  /// When a node is recorded (or would be, in a checkpointed forward that records none): the
  /// tensors its backward will read. Whatever holds tensors for a backward outside a node's saved
  /// list (a chain's snapshots) reports them here too, or a replay may skip computing them.
  virtual void saved_for_backward(const std::vector<detail::SavedTensor>& saved) {
    if (OpOutputHook* o = outer()) o->saved_for_backward(saved);
  }

  /// The innermost handler on this thread, or null.
  static OpOutputHook* current() { return detail::session().op_output_handler; }

  /// RAII: no handler sees anything while it lives. An op computing its outputs holds one, so an
  /// op built from other ops is one op to every handler (positions stay those of the forward).
  class Suspended {
   public:
    Suspended() : none_(nullptr) {}

   private:
    detail::Install<&detail::Session::op_output_handler> none_;
  };

 protected:
  /// The handler that was current when this one was installed (null for the outermost).
  OpOutputHook* outer() const { return installed_.kept(); }

 private:
  detail::Install<&detail::Session::op_output_handler> installed_;  // kept(): the outer handler
};

namespace detail {

/// Reports `saved` as read by a backward to whoever listens. record() calls it for every node (and
/// for the node a checkpointed forward would record); so does whatever holds tensors for a backward
/// outside a node's saved list.
inline void report_saved_for_backward(const std::vector<SavedTensor>& saved) {
  if (saved.empty()) return;
  if (OpOutputHook* hook = OpOutputHook::current()) hook->saved_for_backward(saved);
  notify([&](Observer& o) { o.saved(saved); });
}

}  // namespace detail
}  // namespace remat
