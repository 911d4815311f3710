#pragma once
// The autograd entry points over the thread's session (core/session.hpp): grad mode (no_grad,
// enable_grad), the stack of current tapes (TapeGuard), the replay flag, record() that ops call to
// put a node on the current tape, and Tensor::backward(). Tapes, generators and hooks are per
// thread: two threads training independent models never see each other's state.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "remat/core/bfloat16.hpp"
#include "remat/core/error.hpp"
#include "remat/core/mixed_node.hpp"
#include "remat/core/node.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/saved_tensor_hooks.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tangent.hpp"
#include "remat/core/tape.hpp"
#include "remat/core/tensor.hpp"

namespace remat {
namespace detail {

/// This thread's current tapes, innermost last; the first is its root tape, made at first use.
inline std::vector<Tape*>& tape_stack() {
  Session& s = session();
  if (s.tapes.empty()) {
    s.root_tape = std::make_shared<Tape>();
    s.tapes.push_back(s.root_tape.get());
  }
  return s.tapes;
}

/// Whether an op with these inputs must produce a tensor that requires grad.
template <class T, class... Rest>
bool grad_needed(const BasicTensor<T>& x, const Rest&... rest) {
  if (!session().grad_enabled) return false;
  return x.requires_grad() || (rest.requires_grad() || ...);
}

/// Runs f() outside any graph: no grad, no run scope, no observer, no saved-tensor hooks.
/// Saved-tensor hooks run so: the ops they call are not the model's.
template <class F>
decltype(auto) outside_graph(F&& f) {
  Install<&Session::grad_enabled> no_grad(false);
  OpOutputHook::Suspended no_scope;
  QuietObservers no_observers;
  Install<&Session::saved_tensor_hooks_off> no_hooks(session().saved_tensor_hooks_off + 1);
  return std::forward<F>(f)();
}

/// Keeps each float32 tensor in `saved` that holds bfloat16 values (a product's output under
/// autocast) as its 16-bit copy, one copy per storage: half the bytes, read back exactly.
inline void narrow_exact_saved(std::vector<SavedTensor>& saved) {
  std::vector<std::pair<const Storage*, std::shared_ptr<Storage>>> copies;  // a node saves a few
  for (SavedTensor& s : saved) {
    if (!s.narrows_exactly()) continue;
    const Storage* original = s.storage();
    auto it = std::find_if(copies.begin(), copies.end(), [&](const auto& c) { return c.first == original; });
    if (it == copies.end()) {
      const auto n = static_cast<std::int64_t>(original->bytes() / sizeof(float));
      auto copy = std::make_shared<Storage>(static_cast<std::size_t>(n) * sizeof(Eigen::bfloat16));
      convert_elements(static_cast<const float*>(original->data()), static_cast<Eigen::bfloat16*>(copy->data()), n,
                       narrow_to_bfloat16);
      it = copies.insert(copies.end(), {original, std::move(copy)});
    }
    s.narrow_exact(it->second);
  }
}

/// Hands each tensor in `saved` to the thread's saved-tensor hooks in force, innermost first: the
/// first that does not decline keeps it. Float32 tensors holding bfloat16 values are narrowed
/// first (narrow_exact_saved), so the hooks see their 16-bit copies.
inline void pack_saved(std::vector<SavedTensor>& saved, const SaveContext& context) {
  narrow_exact_saved(saved);
  const auto* active = active_saved_tensor_hooks();
  if (!active) return;
  // A copy: a pack may install hooks of its own for a while (the list may change under us).
  const std::vector<std::shared_ptr<const SavedTensorHooks::Pair>> stores = *active;
  for (SavedTensor& s : saved) {
    if (!s.storage()) continue;
    const AnyTensor t(TensorRef{s.shared_storage(), s.shape(), s.dtype()});
    for (auto it = stores.rbegin(); it != stores.rend(); ++it) {
      const std::shared_ptr<const SavedTensorHooks::Pair>& pair = *it;
      std::any packed = outside_graph([&] { return pair->pack(t, context); });
      if (!packed.has_value()) continue;  // declined: the next store outward is asked
      PackedTensor p;
      p.value = std::move(packed);
      p.unpack = [pair](const std::any& v) { return outside_graph([&] { return pair->unpack(v); }); };
      if (pair->describe) p.describe = [pair](const std::any& v) { return pair->describe(v); };
      if (pair->pin) p.pin = [pair](const std::any& v) { return outside_graph([&] { return pair->pin(v); }); };
      if (pair->state) p.state = [pair](const std::any& v) { return pair->state(v); };
      s.pack(std::move(p));
      break;
    }
  }
}

/// Gives each of `outputs` fresh autograd metadata that requires grad; a tangent set before (a
/// checkpointed segment's output, made by the op inside) stays.
template <class T>
void make_outputs_require_grad(const std::vector<BasicTensor<T>*>& outputs) {
  for (BasicTensor<T>* y : outputs) {
    auto meta = std::make_shared<AutogradMeta<T>>();
    meta->requires_grad = true;
    if (has_tangent(*y)) set_tangent(meta, y->meta()->tangent);
    y->set_meta(std::move(meta));
  }
}

/// What every record does before its node exists: outputs made to require grad, their saved
/// tensors reported, and (recording) packed by the saved-tensor hooks in force. Returns the new
/// node's id, each output stamped with it; 0 when recording is suspended (no node).
template <class StampOutputs>
std::uint64_t begin_record(const std::string& op, std::vector<SavedTensor>& saved, SavedBy saved_by,
                           StampOutputs&& stamp) {
  Session& state = session();
  report_saved_for_backward(saved);
  if (!state.recording) return 0;
  pack_saved(saved, SaveContext{op, saved_by});
  const std::uint64_t id = state.next_node_id++;
  stamp(id);
  return id;
}

/// Makes `outputs` require grad and, unless recording is suspended, puts one node on the current
/// tape (its saved tensors packed by the saved-tensor hooks in force). Call it only when
/// grad_needed(inputs...) holds. Inputs and outputs share one element type, except for the cast
/// (to<U>), which records record<In, Out>.
template <class In, class Out = In>
void record(std::string op, const std::vector<BasicTensor<In>>& inputs,
            const std::vector<BasicTensor<Out>*>& outputs, std::vector<SavedTensor> saved,
            non_deduced<BackwardFn<In, Out>> fn, SavedBy saved_by = SavedBy::op) {
  make_outputs_require_grad(outputs);
  const std::uint64_t id = begin_record(op, saved, saved_by, [&](std::uint64_t node) {
    for (BasicTensor<Out>* y : outputs) y->meta()->node_id = node;
  });
  if (id == 0) return;
  tape_stack().back()->push(
      std::make_unique<TypedNode<In, Out>>(std::move(op), id, inputs, outputs, std::move(saved), std::move(fn)));
}

/// record() for a node whose inputs and outputs hold several floating types (a checkpointed
/// segment's: core/mixed_node.hpp); each type's lists in that type's place.
inline void record_mixed(std::string op, const PerFloatingType<TensorList>& inputs,
                         const PerFloatingType<TensorPointers>& outputs, std::vector<SavedTensor> saved,
                         MixedBackwardFn fn, SavedBy saved_by) {
  outputs.each([](const auto& list) { make_outputs_require_grad(list); });
  const std::uint64_t id = begin_record(op, saved, saved_by, [&](std::uint64_t node) {
    outputs.each([&](const auto& list) {
      for (auto* y : list) y->meta()->node_id = node;
    });
  });
  if (id == 0) return;
  tape_stack().back()->push(
      std::make_unique<MixedNode>(std::move(op), id, inputs, outputs, std::move(saved), std::move(fn)));
}

template <class In, class Out = In>
void record(OpId op, const std::vector<BasicTensor<In>>& inputs, const std::vector<BasicTensor<Out>*>& outputs,
            std::vector<SavedTensor> saved, non_deduced<BackwardFn<In, Out>> fn) {
  record<In, Out>(std::string(op.name()), inputs, outputs, std::move(saved), std::move(fn));
}

template <class T>
BasicTensor<T> recorded_sum(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  REMAT_ASSERT(a.shape() == b.shape());
  BasicTensor<T> sum(a.shape());
  flat(sum) = flat(a) + flat(b);  // the bits of the in-place sum a first-order backward does
  // In a backward carrying tangents, gradients sum with their tangents.
  if (has_tangent(a) || has_tangent(b)) set_tangent(sum, tangent_sum(tangent_of(a), tangent_of(b)));
  if (grad_needed(a, b))
    record<T>("accumulate_grad", {a, b}, {&sum}, {}, [](BackwardContext<T>& ctx) {
      ctx.create_graph();  // dz passes to both as it is, with or without a graph
      const BasicTensor<T>& dz = ctx.grad_output();
      ctx.accumulate(0, dz);
      ctx.accumulate(1, dz);
    });
  return sum;
}

/// The tape holding node `id` among the thread's live tapes, innermost first.
inline std::pair<Tape*, std::ptrdiff_t> locate_node(std::uint64_t id) {
  auto& tapes = tape_stack();
  for (auto it = tapes.rbegin(); it != tapes.rend(); ++it)
    if (std::ptrdiff_t i = (*it)->find(id); i >= 0) return {*it, i};
  return {nullptr, -1};
}

}  // namespace detail

/// The tape ops record into now.
inline Tape& current_tape() { return *detail::tape_stack().back(); }

/// Makes `tape` the current tape for the guard's lifetime (nested tapes are how replay works).
class TapeGuard {
 public:
  /// Pushes `tape` as the current tape (popped by the destructor).
  explicit TapeGuard(Tape& tape) : installed_(above_root(tape)) {}

 private:
  static Tape* above_root(Tape& tape) {
    detail::tape_stack();  // the root tape exists below every pushed one
    return &tape;
  }
  detail::Install<&detail::Session::tapes> installed_;
};

/// Whether ops record nodes for backward now: false inside no_grad, unless an enable_grad is nested in it.
inline bool is_grad_enabled() { return detail::session().grad_enabled; }

/// True while a checkpoint replays a segment's forward during backward. Code with side effects
/// (counters, logging, running statistics, caches) checks it so that replay does not repeat them.
inline bool is_replaying() { return detail::session().replay_depth > 0; }

/// RAII: no op records a node or produces a tensor that requires grad while it lives.
class no_grad {
 public:
  no_grad() : guard_(false) {}

 private:
  detail::Install<&detail::Session::grad_enabled> guard_;
};

/// RAII: turns gradient recording back on inside a no_grad region.
class enable_grad {
 public:
  enable_grad() : guard_(true) {}

 private:
  detail::Install<&detail::Session::grad_enabled> guard_;
};

namespace detail {

/// RAII: ops record nodes (on) or only propagate requires_grad (off) while it lives.
inline Install<&Session::recording> scoped_recording(bool on) { return Install<&Session::recording>(on); }
/// RAII: is_replaying() is true while it lives.
inline Install<&Session::replay_depth> scoped_replay() {
  return Install<&Session::replay_depth>(session().replay_depth + 1);
}

}  // namespace detail

namespace detail {

/// One root of a backward walk: a tensor and the gradient it starts with.
template <class T>
struct BackwardRoot {
  const BasicTensor<T>* tensor;
  BasicTensor<T> gradient;  ///< of the tensor's shape (checked by the caller)
};

/// The walk behind backward() and grad(): each root's gradient accumulates into it, then the tape
/// holding the roots runs from the newest root's node down. `who` names the caller in errors.
/// With `create_graph` the walk records its own ops, after the nodes they differentiate on the
/// same tape, and keeps the graph it walks (the new one reaches back into it).
template <class T>
void run_backward(const char* who, std::vector<BackwardRoot<T>> roots, bool retain_graph, bool create_graph = false) {
  // Inside a dual level the walk carries tangents (forward-over-reverse: hvp): every backward
  // computes in ops on its saved tensors' identities, whose tangents the ops' rules carry into
  // the gradients, and records nothing.
  const bool tangents = !create_graph && tangents_active();
  if (create_graph || tangents) {
    const Session& s = session();
    const char* what = create_graph ? "create_graph" : "a backward carrying tangents (inside a dual level: hvp)";
    REMAT_CHECK(!s.autocast, "{}: {} under autocast is not available yet — differentiate twice in float32 or "
                "float64", who, what);
    // Saved-tensor stores need nothing more: a backward takes its saved tensors' identities from
    // its node, whatever a store gives back their values from (a budget's recomputation, a file).
    for (const Observer* o : s.observers)
      if (std::string why = o->refuses_higher_order(); !why.empty())
        throw Error(fmt::format("{}: {} is not available here: {}", who, what, why));
    REMAT_CHECK(s.replay_depth == 0, "{}: {} inside a checkpoint's replay is not available", who, what);
    if (create_graph) retain_graph = true;
  }
  Tape* tape = nullptr;
  std::ptrdiff_t newest = -1;
  for (const BackwardRoot<T>& r : roots) {
    const auto& meta = *r.tensor->meta();
    if (meta.is_leaf()) continue;
    const Shape& shape = r.tensor->shape();
    auto [holder, index] = locate_node(meta.node_id);
    REMAT_CHECK(!meta.history_freed,
                "{}: the graph that produced this tensor (shape {}) has already been freed — "
                "backward ran through it before; pass retain_graph=true to the first backward to run "
                "it twice", who, shape);
    // Not freed, yet on none of this thread's tapes: each thread records on its own.
    REMAT_CHECK(holder != nullptr,
                "{}: the graph that produced this tensor (shape {}) is not on this thread's tapes — "
                "it was recorded on another thread; run backward on the thread whose forward recorded it",
                who, shape);
    REMAT_CHECK(tape == nullptr || tape == holder,
                "{}: the outputs were recorded on different tapes (one inside a checkpoint's replay, one "
                "outside it); differentiate each where it was recorded", who);
    tape = holder;
    newest = std::max(newest, index);
  }
  // Observers hear whether a backward is the outermost (a dry run inside one is not an end).
  const bool outermost = session().backward_depth == 0;
  Install<&Session::backward_depth> depth(session().backward_depth + 1);
  notify([&](Observer& o) { o.backward_begin(outermost); });
  // Carrying tangents, what the forward left that no backward reads goes before the walk starts
  // (each node drops what came since, a replay's intermediates, as it runs: core/node.hpp).
  if (tangents && outermost) session().dual_level->drop_unread(true);
  const auto end_of_walk = [outermost] {
    std::vector<std::shared_ptr<const void>> held;
    if (outermost) held.swap(session().walk_keepalive);
  };
  try {
    // Recording on, onto the tape walked: the new nodes come after those they read.
    Install<&Session::grad_enabled> grad_mode(session().grad_enabled || create_graph);
    Install<&Session::recording> recording(session().recording || create_graph);
    Install<&Session::create_graph> graph(create_graph);
    Install<&Session::tangent_walk> carrying(session().tangent_walk || tangents);
    std::optional<Install<&Session::tapes>> onto;
    if (create_graph && tape) onto.emplace(tape);
    for (BackwardRoot<T>& r : roots)
      accumulate_grad(*r.tensor->meta(), std::move(r.gradient), create_graph || tangents);
    if (tape) tape->backward(static_cast<TapePosition>(newest) + 1, 0, retain_graph);
  } catch (...) {
    end_of_walk();
    notify([&](Observer& o) { o.backward_end(false, outermost); });
    throw;
  }
  end_of_walk();
  // An observer may throw here (a memory budget the step did not fit): after every one has heard.
  notify([&](Observer& o) { o.backward_end(true, outermost); });
}

}  // namespace detail

template <class T>
void BasicTensor<T>::backward(const BasicTensor& gradient, bool retain_graph, bool create_graph) const {
  REMAT_CHECK(defined(), "backward: the tensor is undefined");
  REMAT_CHECK(requires_grad(), "backward: tensor of shape {} does not require grad and has no grad_fn",
              shape_);
  BasicTensor seed;
  if (gradient.defined()) {
    REMAT_CHECK(gradient.shape() == shape_,
                "backward: gradient of shape {} does not match the tensor's shape {}", gradient.shape(),
                shape_);
    // Under create_graph a gradient with a graph of its own keeps it (the result depends on it).
    seed = create_graph && gradient.requires_grad() ? gradient : detail::copy_of(gradient);
  } else {
    REMAT_CHECK(numel() == 1,
                "backward: a gradient can be created implicitly only for a one-element output (a "
                "loss); this tensor has shape {} — pass a gradient of that shape", shape_);
    seed = BasicTensor(shape_);
    detail::flat(seed).setOnes();
  }
  detail::run_backward<T>("backward", {{this, std::move(seed)}}, retain_graph, create_graph);
}

}  // namespace remat
