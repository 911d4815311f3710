#pragma once
// Op identities, what an op reports about its outputs (OpOutput), and the deciders: every op makes
// its outputs through core/produce.hpp, which asks the run scope it runs in whether to reuse
// stored tensors as its outputs or to skip computing them, and tells the scope and the observers
// what it made. Ops know only these neutral interfaces, never who decides or listens.
//
// A run scope (RunScope) is a stretch of ops counted together: a checkpoint's forward or replay,
// a chain step's run, a decider a user installs. Scopes nest, with one rule each way:
//   - An op's position (OpOutput::position) counts the ops of its own scope only: a nested scope
//     is one place among them, whatever it runs, so a scope's positions are the same in every run
//     of it. (It is a place, not nothing: what a nested scope makes — a nested segment's boundary
//     — may be all a later save reads, and the enclosing replay must then compute that stretch.)
//   - An op is handed stored outputs only by its own scope's decider (reuse), and skipped when its
//     own scope's decider skips it or an enclosing scope's decider skips what comes at its place
//     (a replay past what its backward reads skips everything inside), up to a scope that is a
//     barrier (the chain executor's: what it keeps for later is computed whatever).
//   - A scope's listeners hear its own ops and the saves reported while it is innermost; when it
//     ends, the saves it heard of tensors made before it began are reported to the enclosing scope
//     (a nested segment's reads from outside are its enclosing segment's reads too).
// Observers (core/observer.hpp) hear every op of every scope, unconditionally.
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
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
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

/// The tag of an op registered with a tangent rule (forward mode, core/forward_ad.hpp): the op
/// computes its output's tangent when it reads one.
struct TangentRule {};
/// Passed to register_op: `register_op("exp", tangent_rule)`.
inline constexpr TangentRule tangent_rule{};

namespace detail {
inline std::vector<const char*>& tangent_rule_registry() {
  static std::vector<const char*> names;
  return names;
}
}  // namespace detail

/// Registers an op that has a tangent rule: `register_op("exp", tangent_rule)`.
inline OpId register_op(const char* name, TangentRule) {
  const OpId id = register_op(name);
  auto& names = detail::tangent_rule_registry();
  if (std::find(names.begin(), names.end(), id.name()) == names.end()) names.push_back(id.name());
  return id;
}

/// Whether `op` was registered with a tangent rule.
inline bool has_tangent_rule(OpId op) {
  const auto& names = detail::tangent_rule_registry();
  return std::find(names.begin(), names.end(), op.name()) != names.end();
}

/// The names of the ops with tangent rules among those registered so far, sorted.
inline std::vector<std::string> ops_with_tangent_rules() {
  std::vector<std::string> out(detail::tangent_rule_registry().begin(), detail::tangent_rule_registry().end());
  std::sort(out.begin(), out.end());
  return out;
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

/// An op's estimate of its work, for cost models: its flops (copies count one per element), and
/// the elements it computes and drops inside without writing them out (an attention's scores:
/// their softmax, mask and dropout draw), which its flops and output bytes leave out. A double
/// converts to flops alone, as most ops report.
struct OpWork {
  /// Flops alone (implicit: most ops report only these).
  OpWork(double op_flops) : flops(op_flops) {}  // NOLINT(google-explicit-constructor)
  /// Flops, and elements computed inside and dropped.
  OpWork(double op_flops, double dropped_elements) : flops(op_flops), inner_elements(dropped_elements) {}
  double flops;               ///< copies count one per element
  double inner_elements = 0;  ///< computed inside, never written out
};

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
  /// Its place among the ops of its run scope, from 0 (the same in every run of that scope).
  std::size_t position = 0;
  /// How to compute the outputs again, when the op computed them (null when a decider handed them
  /// over or they were skipped): an observer that keeps recipes (a memory budget) takes it.
  const class RecomputeOffer* recompute = nullptr;
  /// OpWork::inner_elements: what the op computes inside and drops (0 for most ops).
  double inner_elements = 0;
  /// The storage serial when the op began (core/memory.hpp): a storage with a lower serial was made
  /// before the op ran, so it cannot hold anything the op computes.
  std::uint64_t began_serial = 0;
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

class OpOutputHook;

namespace detail {

/// Hears the ops of one run scope and the saves reported while it is the innermost scope.
class ScopeListener {
 public:
  /// An op of the scope made `values` (computed, handed over or skipped).
  virtual void produced(const OpOutput& out, const std::vector<TensorRef>& values) = 0;
  /// A node was recorded (or would be) that keeps `saved` for its backward.
  virtual void saved(const std::vector<SavedTensor>& saved) = 0;
  /// A nested scope ended; it took `position` among this scope's positions.
  virtual void nested(std::size_t position) { (void)position; }

 protected:
  ~ScopeListener() = default;
};

/// A run scope, installed for its lifetime on this thread (the header's comment has the rules):
/// its decider (if any), its listeners, the count of its ops.
class RunScope {
 public:
  /// A scope whose ops `decider` decides for (none: ops compute); a barrier's enclosing scopes
  /// skip nothing inside it.
  explicit RunScope(OpOutputHook* decider = nullptr, bool barrier = false)
      : decider_(decider), barrier_(barrier), first_serial_(next_storage_serial(false)), installed_(this) {}
  /// Reports the saves it heard of tensors made before it to the enclosing scope, and takes its
  /// place there.
  ~RunScope() {
    if (RunScope* parent = installed_.kept()) {
      if (!outside_.empty()) parent->saved(outside_);
      parent->nested_ended();
    }
  }
  RunScope(const RunScope&) = delete;
  RunScope& operator=(const RunScope&) = delete;

  /// `l` hears this scope's ops and saves from now on, for the scope's lifetime.
  void listen(ScopeListener& l) { listeners_.push_back(&l); }
  /// Places taken in this scope so far, ops and nested scopes (the position of the next).
  std::size_t ops() const { return ops_; }
  OpOutputHook* decider() const { return decider_; }
  bool barrier() const { return barrier_; }
  /// The scope that was innermost when this one began.
  RunScope* parent() const { return installed_.kept(); }

  /// An op of this scope made its outputs.
  void produced(const OpOutput& out, const std::vector<TensorRef>& values) {
    for (ScopeListener* l : listeners_) l->produced(out, values);
    ++ops_;
  }
  /// A scope nested in this one ended: it was one place here.
  void nested_ended() {
    for (ScopeListener* l : listeners_) l->nested(ops_);
    ++ops_;
  }
  /// A save reported while this scope is the innermost.
  void saved(const std::vector<SavedTensor>& saved) {
    for (ScopeListener* l : listeners_) l->saved(saved);
    for (const SavedTensor& s : saved)
      if (const Storage* st = s.storage(); st && st->serial() < first_serial_ && outside_seen_.insert(st->serial()).second)
        outside_.push_back(s);
  }

  /// The innermost scope on this thread, or null.
  static RunScope* current() { return session().run_scope; }

 private:
  OpOutputHook* decider_;
  bool barrier_;
  std::uint64_t first_serial_;
  std::size_t ops_ = 0;
  std::vector<ScopeListener*> listeners_;
  std::vector<SavedTensor> outside_;
  std::unordered_set<std::uint64_t> outside_seen_;
  Install<&Session::run_scope> installed_;  // kept(): the enclosing scope
};

}  // namespace detail

/// A decider: it answers, for the ops of its run scope, whether to use stored tensors as an op's
/// outputs (reuse) or to make them without computing (skip). Constructing one installs a run scope
/// of its own with it as the decider, for its lifetime: the ops made meanwhile are its scope's,
/// numbered from 0 (OpOutput::position). Selective checkpointing's replay, early stop and a chain's
/// compact rebuild are deciders (composed in one place: checkpoint/run_parts.hpp). To hear ops
/// without deciding, write an Observer.
class OpOutputHook {
 public:
  OpOutputHook() { scope_.emplace(this); }
  virtual ~OpOutputHook() = default;
  OpOutputHook(const OpOutputHook&) = delete;
  OpOutputHook& operator=(const OpOutputHook&) = delete;

  /// Before an op of its scope computes: stored tensors to use as its outputs instead (all
  /// `out.count` of them, in order), or none to let it compute.
  virtual std::vector<detail::TensorRef> reuse(const OpOutput& out) {
    (void)out;
    return {};
  }
  /// Asked when reuse() supplied nothing, with `out.position` at this decider's scope's place: true
  /// when nobody will read the op's values (a replay past the last tensor its backward reads), so
  /// the op makes its outputs' storage without computing them. The outputs still carry their
  /// shapes, and the op still records its node. Asked for the ops of nested scopes too (at the
  /// place they take in this one).
  virtual bool skip(const OpOutput& out) {
    (void)out;
    return false;
  }

  /// The decider of the innermost run scope on this thread, or null.
  static OpOutputHook* current() {
    const detail::RunScope* s = detail::RunScope::current();
    return s ? s->decider() : nullptr;
  }

  /// RAII: no scope decides or hears anything while it lives. An op computing its outputs holds
  /// one, so an op built from other ops is one op to every scope (positions stay those of the
  /// forward).
  class Suspended {
   public:
    Suspended() : none_(nullptr) {}

   private:
    detail::Install<&detail::Session::run_scope> none_;
  };

 protected:
  /// Tag of the constructor below.
  struct Unscoped {};
  /// A decider whose run scope someone else installs (the one composed in checkpoint/run_parts.hpp).
  explicit OpOutputHook(Unscoped) {}

 private:
  std::optional<detail::RunScope> scope_;
};

namespace detail {

/// Reports `saved` as read by a backward to whoever listens. record() calls it for every node (and
/// for the node a checkpointed forward would record); so does whatever holds tensors for a backward
/// outside a node's saved list.
inline void report_saved_for_backward(const std::vector<SavedTensor>& saved) {
  if (saved.empty()) return;
  if (RunScope* scope = RunScope::current()) scope->saved(saved);
  notify([&](Observer& o) { o.saved(saved); });
}

/// Whether the op `out` is to be skipped: asked of its own scope's decider, then of each enclosing
/// scope's at its own place, up to a barrier.
inline bool scopes_skip(const OpOutput& out, RunScope* scope) {
  for (RunScope* s = scope; s != nullptr; s = s->parent()) {
    if (OpOutputHook* d = s->decider()) {
      OpOutput at = out;
      at.position = s->ops();
      if (d->skip(at)) return true;
    }
    if (s->barrier()) break;
  }
  return false;
}

}  // namespace detail
}  // namespace remat
