#pragma once
// A node of the tape: one recorded op. It holds its inputs' autograd metadata strongly and its
// outputs' weakly (the tape never keeps an activation alive unless it saved it), the tensors it
// saved, and a backward function that adds into its inputs' gradients; it frees what it saved as
// soon as it has run.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/grad_capture.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/core/tangent.hpp"
#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"
#include "remat/core/timeline.hpp"

namespace remat::detail {

class Node {
 public:
  Node(std::string name, std::uint64_t id, std::vector<SavedTensor> saved)
      : name_(std::move(name)), id_(id), saved_(std::move(saved)) {
    for (SavedTensor& s : saved_) s.retain();
  }
  // Derived nodes call release() in their destructor: drop_edges is virtual, and a base
  // destructor must not call into a derived part that no longer exists.
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const char* name() const { return name_.c_str(); }
  std::uint64_t id() const { return id_; }
  bool released() const { return released_; }
  const std::vector<SavedTensor>& saved() const { return saved_; }

  /// Whether any output has a gradient waiting: only then does backward run this node.
  virtual bool has_output_grad() const = 0;
  /// Whether any output tensor is still reachable; a node with none can never run again.
  virtual bool outputs_alive() const = 0;
  /// Runs the backward function; frees saved tensors and edges unless `retain_graph`.
  virtual void run(bool retain_graph) = 0;

  /// The saved tensors made ready by the stores that packed them (a memory budget recomputes what
  /// it discarded), each held until the returned handles go, so that none is discarded again while
  /// the backward reads it. Each is held from its own turn on: one still waiting may be discarded to
  /// make room for another's recomputation, so the bytes held at any moment do not depend on what
  /// an earlier moment happened to keep.
  std::vector<std::shared_ptr<void>> pin_saved() const {
    std::vector<std::shared_ptr<void>> pins;
    for (const SavedTensor& s : saved_)
      if (std::shared_ptr<void> pin = s.pin()) pins.push_back(std::move(pin));
    return pins;
  }

  void release_saved(std::size_t i) {
    if (saved_[i].held()) saved_[i].release();
  }

  void release() {
    if (released_) return;
    for (SavedTensor& s : saved_) s.release();
    saved_.clear();
    drop_edges();
    released_ = true;
  }

 protected:
  virtual void drop_edges() = 0;

 private:
  std::string name_;
  std::uint64_t id_;
  std::vector<SavedTensor> saved_;
  bool released_ = false;
};

/// a + b as a recorded op: how gradients accumulate in a backward that records its own ops
/// (create_graph). Defined in core/autograd.hpp, beside record(), which it calls.
template <class T>
BasicTensor<T> recorded_sum(const BasicTensor<T>& a, const BasicTensor<T>& b);

/// Adds a gradient into meta's. It comes in two forms: dense() makes the whole of it, and
/// add_into(grad) adds it into a gradient meta already has, in place; a gradient that is zero
/// outside a part of the tensor (narrow's) adds that part alone there (x + 0 is x: the same sums)
/// and is made whole only where it is adopted or recorded. In a backward that records its ops
/// (`graph`), the gradient may carry a graph of its own: it is kept as it is and sums are
/// recorded, never written in place, so that the gradient can be differentiated again.
template <class T, class Dense, class AddInto>
void accumulate_grad_with(AutogradMeta<T>& meta, bool graph, Dense dense, AddInto add_into) {
  // A dry run's gradients stay inside it: none into a leaf, nor into a tensor made before it (a
  // parameter computed from another), whose node a later walk would send it on from.
  if (const std::uint64_t first = session().dry_run_first_node; first != 0 && (meta.is_leaf() || meta.node_id < first))
    return;
  GradCapture* capture = meta.is_leaf() ? session().grad_capture : nullptr;
  if (capture) capture->set_aside(meta);
  if (graph) {
    // A plain buffer another tensor shares is copied (a later in-place sum would reach both);
    // one with a graph is never written in place, so it is kept as it is.
    BasicTensor<T> g = dense();
    if (!meta.grad.defined()) meta.grad = g.meta() || g.storage().use_count() == 1 ? std::move(g) : copy_of(g);
    else meta.grad = recorded_sum(meta.grad, g);
  } else if (!meta.grad.defined()) {
    // Adopt the buffer when nothing else holds it; otherwise copy, so two gradients never alias.
    BasicTensor<T> g = dense();
    meta.grad = g.storage().use_count() == 1 && !g.meta() ? std::move(g) : copy_of(g);
  } else {
    if (meta.grad.meta()) meta.grad = copy_of(meta.grad);  // left by a create_graph backward
    add_into(meta.grad);
  }
  // Under grad() no .grad changes for good: observers (data parallel's reduction) hear nothing.
  if (meta.is_leaf() && !capture) notify([&](Observer& o) { o.leaf_grad(&meta); });
}

/// Adds g into meta's gradient (accumulate_grad_with, g whole).
template <class T>
void accumulate_grad(AutogradMeta<T>& meta, BasicTensor<T> g, bool graph = false) {
  accumulate_grad_with(meta, graph, [&] { return std::move(g); }, [&](BasicTensor<T>& sum) {
    // On threads: a sum into a gradient that two ops feed (the residual stream's) is otherwise
    // serial work the other thread waits through; element-wise, so the same bits on any count.
    T* into = sum.data();
    const T* add = g.cdata();
    parallel_for(g.numel(), kElementGrain, [=](std::int64_t b, std::int64_t e) {
      ArrayMap<T>(into + b, e - b) += ConstArrayMap<T>(add + b, e - b);
    });
  });
}

/// A node whose inputs hold elements of type In and whose outputs hold Out: the same type for
/// every op but the element-type cast (to<U>), whose backward takes the gradient of an Out tensor
/// and hands its input an In one. Ops of several input types are written over casts, one node
/// each, so a node never needs more than these two.
template <class In, class Out = In>
class TypedNode;

/// The walk's modes as every backward function sees them (BackwardContext, MixedBackwardContext).
class BackwardModes {
 public:
  BackwardModes(bool retain_graph, bool create_graph) : retain_graph_(retain_graph), create_graph_(create_graph) {}

  /// Whether this backward keeps the graph for another one (a node holding state of its own, such
  /// as a chain's snapshots, must then leave that state as it found it).
  bool retain_graph() const { return retain_graph_; }
  /// Whether this backward records its own ops so that its gradients can be differentiated again
  /// (create_graph). A backward that can do so asks, and then computes its gradients with recorded
  /// ops on as_input() / as_output(); a node whose backward never asks is an error in such a walk
  /// (its gradients would have no graph: a second differentiation would be silently wrong).
  bool create_graph() const {
    asked_create_graph_ = true;
    return create_graph_;
  }
  /// Whether the backward asked create_graph() (checked by the node after it runs).
  bool asked_create_graph() const { return asked_create_graph_; }

 protected:
  bool retain_graph_;
  bool create_graph_;
  mutable bool asked_create_graph_ = false;
};

/// What a backward function sees: the gradients of the node's outputs (element type Out), what it
/// saved, and where to add its inputs' gradients (element type In).
template <class In, class Out = In>
class BackwardContext : public BackwardModes {
 public:
  BackwardContext(TypedNode<In, Out>& node, std::vector<BasicTensor<Out>>& grad_outputs, bool retain_graph = false,
                  bool create_graph = false)
      : BackwardModes(retain_graph, create_graph), node_(node), grad_outputs_(grad_outputs) {}

  /// The gradient of output i; zeros when that output received none.
  const BasicTensor<Out>& grad_output(std::size_t i = 0);
  /// Whether output i received a gradient (ask before grad_output(i), which fills in zeros).
  bool has_grad_output(std::size_t i) const { return i < grad_outputs_.size() && grad_outputs_[i].defined(); }
  /// The gradient of output i (zeros when it received none), handed over: the node keeps no
  /// reference, so a backward that passes it on unchanged (a reshape, the residual branch of an add)
  /// lets the input adopt the buffer where a shared one would be copied. Output i is not asked for
  /// again by that backward.
  BasicTensor<Out> take_grad_output(std::size_t i = 0) {
    BasicTensor<Out> g = grad_output(i);
    grad_outputs_[i] = BasicTensor<Out>();
    return g;
  }
  /// `data` carrying input i's autograd identity when input i needs a gradient (else plain data):
  /// ops recorded on it add their gradients straight into input i, each as it runs. A replay
  /// builds its inputs this way so that an input also used outside the segment accumulates its
  /// gradient in exactly the order, and so to exactly the bits, it would without checkpointing.
  BasicTensor<In> as_input(std::size_t i, const BasicTensor<In>& data) const;
  /// `data` carrying output i's autograd identity while that output is reachable (else plain
  /// data): a recorded backward that reads a saved output depends on the input through it.
  BasicTensor<Out> as_output(std::size_t i, const BasicTensor<Out>& data) const;
  /// Saved tensor i, checked against in-place modification since it was saved.
  template <class U = In>
  BasicTensor<U> saved(std::size_t i) const;
  /// Releases saved tensor i now, before the node finishes (a backward that frees as it goes).
  void release_saved(std::size_t i);
  /// Whether input i needs a gradient (PyTorch's needs_input_grad): skip the work otherwise.
  bool needs_grad(std::size_t i) const;
  /// Adds g into input i's gradient; g must have that input's shape.
  void accumulate(std::size_t i, BasicTensor<In> g);
  /// accumulate(i, dense()) for a gradient that is zero outside a part of input i: add_into(grad)
  /// adds that part into the gradient input i already has (accumulate_grad_with); dense() is made
  /// only where there is none yet or the sum is recorded.
  template <class Dense, class AddInto>
  void accumulate_part(std::size_t i, Dense dense, AddInto add_into) {
    if (needs_grad(i)) accumulate_grad_with(gradient_of(i), create_graph_, dense, add_into);
  }

 private:
  /// Input i's autograd metadata, to add a gradient into (checked: its graph is not freed).
  AutogradMeta<In>& gradient_of(std::size_t i);

  TypedNode<In, Out>& node_;
  std::vector<BasicTensor<Out>>& grad_outputs_;
};

template <class In, class Out = In>
using BackwardFn = std::function<void(BackwardContext<In, Out>&)>;

/// T, in a context template arguments are not deduced from (C++20's std::type_identity_t): record()
/// takes its element types from the tensors, or from record<In, Out>, never from a lambda.
template <class T>
struct NonDeduced {
  using type = T;
};
template <class T>
using non_deduced = typename NonDeduced<T>::type;

/// A node's edges to its inputs of element type T: each input's autograd metadata, held strongly
/// (null where no gradient is needed: nothing is sent there), and each input's shape.
template <class T>
class InputEdges {
 public:
  InputEdges() = default;
  explicit InputEdges(const std::vector<BasicTensor<T>>& inputs) {
    for (const BasicTensor<T>& x : inputs) {
      metas_.push_back(x.requires_grad() ? x.meta() : nullptr);
      shapes_.push_back(x.shape());
    }
    if (!tangents_active()) return;
    // An input that needs no gradient but carries a tangent (a constant made dual): the formulas
    // of a backward carrying tangents read it through as_input all the same.
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (!metas_[i] && has_tangent(inputs[i])) {
        tangent_only_.resize(inputs.size());
        tangent_only_[i] = inputs[i].meta();
      }
  }

  std::size_t size() const { return metas_.size(); }
  bool needs_grad(std::size_t i) const { return i < metas_.size() && metas_[i] != nullptr; }
  const Shape& shape(std::size_t i) const { return shapes_[i]; }

  /// `data` carrying input i's autograd identity (or, needing no gradient, its tangent's), else plain.
  BasicTensor<T> as_input(std::size_t i, const BasicTensor<T>& data) const {
    BasicTensor<T> t(data.storage(), data.shape());
    if (needs_grad(i)) t.set_meta(metas_[i]);
    else if (i < tangent_only_.size() && tangent_only_[i]) t.set_meta(tangent_only_[i]);
    return t;
  }

  /// Input i's autograd metadata, to add a gradient into (checked: its graph is not freed).
  AutogradMeta<T>& gradient_of(std::size_t i, const char* node_name) const {
    AutogradMeta<T>& input = *metas_[i];
    REMAT_CHECK(!input.history_freed,
                "backward: op '{}' passes a gradient to an input of shape {} whose own graph was "
                "already freed by an earlier backward; pass retain_graph=true to that backward",
                node_name, shapes_[i]);
    return input;
  }

  /// Inside a dual level: counts the node among its inputs' tangent holders and, when it reads
  /// them (`reads`: it saves anything), their readers; `sign` -1 undoes it.
  void count_tangent_holds(int sign, bool reads) const {
    for (const auto* held : {&metas_, &tangent_only_})
      for (const auto& m : *held) {
        if (!m) continue;
        m->tangent_holders += sign;
        if (reads) m->tangent_readers += sign;
      }
  }

 private:
  std::vector<std::shared_ptr<AutogradMeta<T>>> metas_;
  // Inside a dual level, of inputs that need no gradient, those with a tangent (else empty).
  std::vector<std::shared_ptr<AutogradMeta<T>>> tangent_only_;
  std::vector<Shape> shapes_;
};

/// A node's edges to its outputs of element type T, held weakly (the tape never keeps an
/// activation alive), with their shapes: where the gradients it runs on arrive.
template <class T>
class OutputEdges {
 public:
  OutputEdges() = default;
  /// `saved`: what the node saves; inside a dual level an output it saves is read by its backward.
  OutputEdges(const std::vector<BasicTensor<T>*>& outputs, const std::vector<SavedTensor>& saved) {
    for (const BasicTensor<T>* y : outputs) {
      metas_.push_back(y->meta());
      shapes_.push_back(y->shape());
    }
    if (!tangents_active()) return;
    for (std::size_t i = 0; i < outputs.size() && i < 64; ++i)
      if (std::any_of(saved.begin(), saved.end(),
                      [&](const SavedTensor& s) { return s.saves(outputs[i]->storage().get()); }))
        read_ |= std::uint64_t{1} << i;
  }

  std::size_t size() const { return metas_.size(); }
  const Shape& shape(std::size_t i) const { return shapes_[i]; }
  bool any_grad() const {
    return std::any_of(metas_.begin(), metas_.end(), [](const auto& w) {
      auto m = w.lock();
      return m && m->grad.defined();
    });
  }
  bool any_alive() const {
    return std::any_of(metas_.begin(), metas_.end(), [](const auto& w) { return !w.expired(); });
  }

  /// The gradients waiting at the outputs, consumed (a later backward starts from nothing); an
  /// output that retains its gradient (retain_grad, or grad() capturing it) keeps a sum of what it
  /// received, recorded when the walk carries a graph or tangents (`graph`).
  std::vector<BasicTensor<T>> take_grads(bool graph) const {
    std::vector<BasicTensor<T>> grads(metas_.size());
    for (std::size_t i = 0; i < metas_.size(); ++i) {
      auto m = metas_[i].lock();
      if (!m) continue;
      grads[i] = std::move(m->grad);
      m->grad = BasicTensor<T>();
      const GradCapture* capture = session().grad_capture;
      if (!grads[i].defined() || !(capture ? capture->keeps(m.get()) : m->retains_grad)) continue;
      if (graph) {
        m->retained = m->retained.defined() ? recorded_sum(m->retained, grads[i]) : grads[i];
      } else if (m->retained.defined()) {
        if (m->retained.meta()) m->retained = copy_of(m->retained);  // left by a create_graph backward
        flat(m->retained) += flat(grads[i]);
      } else {
        m->retained = copy_of(grads[i]);
      }
    }
    return grads;
  }

  /// Output i's identity on `data` while the output is reachable (else plain data).
  BasicTensor<T> as_output(std::size_t i, const BasicTensor<T>& data) const {
    BasicTensor<T> t(data.storage(), data.shape());
    REMAT_ASSERT(i < metas_.size());
    if (auto m = metas_[i].lock()) t.set_meta(std::move(m));
    return t;
  }

  /// Once the node has run in a walk carrying tangents, no backward reads its outputs' tangents.
  void drop_tangents() const {
    for (const auto& w : metas_)
      if (auto m = w.lock()) m->tangent = BasicTensor<T>();
  }
  /// Outputs still alive learn that their history is gone, so a later backward into them throws
  /// instead of silently stopping there.
  void mark_history_freed() const {
    for (const auto& w : metas_)
      if (auto m = w.lock()) m->history_freed = true;
  }
  /// Counts the node among the tangent readers of each output it saves (past 64 outputs: read).
  void count_tangent_readers(int sign) const {
    for (std::size_t i = 0; i < metas_.size(); ++i)
      if (i >= 64 || ((read_ >> i) & 1u))
        if (auto m = metas_[i].lock()) m->tangent_readers += sign;
  }

 private:
  std::vector<std::weak_ptr<AutogradMeta<T>>> metas_;
  std::vector<Shape> shapes_;
  std::uint64_t read_ = 0;  // bit i: output i is saved by the node (inside a dual level)
};

/// Runs a node's backward function `call` (which returns whether it asked create_graph()) in the
/// walk's mode, then frees the node unless `retain_graph`; what every kind of node does around it.
template <class Call, class DropOutputTangents>
void run_node_backward(Node& node, bool graph, bool retain_graph, Call&& call, DropOutputTangents&& drop_tangents) {
  notify([&](Observer& o) { o.backward_op(node.name()); });
  TimelineSpan span(node.name(), "backward");
  const std::vector<std::shared_ptr<void>> pinned = node.pin_saved();
  bool asked = false;
  if (session().create_graph) {
    // A walk this backward runs of its own (a checkpoint's replay) is first-order: only a
    // backward that asks create_graph() records, and it does so through ordinary ops.
    Install<&Session::create_graph> first_order(false);
    asked = call();
  } else if (graph) {
    // What a replay's forward left that no backward reads goes before the walk reaches it.
    if (DualLevelState* level = session().dual_level) level->drop_unread(false);
    // Carrying tangents: the formulas' ops record nothing (a replay records its own run). Once
    // the node has run, no backward reads its outputs' tangents again (their consumers ran
    // before it): they go now, not when the dual level ends.
    Install<&Session::grad_enabled> unrecorded(false);
    asked = call();
    if (!retain_graph) drop_tangents();
  } else {
    asked = call();
  }
  REMAT_CHECK(!graph || asked,
              "backward: op '{}' cannot compute its backward in ops (create_graph, or a backward carrying "
              "tangents: hvp): its gradient would have no graph and no tangent, so a second differentiation "
              "through it would be wrong. Every op of remat can", node.name());
  if (!retain_graph) node.release();
}

/// Whether this walk computes its formulas in ops: recorded (create_graph), or carrying tangents
/// unrecorded (a tangent walk).
inline bool walk_in_ops() { return session().create_graph || session().tangent_walk; }

template <class In, class Out>
class TypedNode final : public Node {
 public:
  TypedNode(std::string name, std::uint64_t id, const std::vector<BasicTensor<In>>& inputs,
            const std::vector<BasicTensor<Out>*>& outputs, std::vector<SavedTensor> saved, BackwardFn<In, Out> fn)
      : Node(std::move(name), id, std::move(saved)), inputs_(inputs), outputs_(outputs, this->saved()),
        fn_(std::move(fn)) {
    if (tangents_active()) count_tangent_holds(+1);
  }

  ~TypedNode() override {
    release();
    if (counts_tangents_) count_tangent_holds(-1);
  }

  bool has_output_grad() const override { return outputs_.any_grad(); }
  bool outputs_alive() const override { return outputs_.any_alive(); }

  void run(bool retain_graph) override {
    REMAT_ASSERT(!released());
    const bool graph = walk_in_ops();
    std::vector<BasicTensor<Out>> grads = outputs_.take_grads(graph);
    BackwardContext<In, Out> ctx(*this, grads, retain_graph, graph);
    run_node_backward(
        *this, graph, retain_graph,
        [&] {
          fn_(ctx);
          return ctx.asked_create_graph();
        },
        [&] { outputs_.drop_tangents(); });
  }

 protected:
  void drop_edges() override {
    // The input edges stay until the node leaves the tape: during a backward walk they keep alive
    // the gradients just handed to producer nodes below.
    outputs_.mark_history_freed();
    fn_ = nullptr;
  }

 private:
  friend class BackwardContext<In, Out>;

  /// Inside a dual level: counts this node among its inputs' tangent holders and, as one that may
  /// read them, among their readers when it saves anything (its backward's formulas read inputs'
  /// tangents through saved tensors only; which saved tensor stands for which input is the op's
  /// business: cross_entropy's probabilities stand for its logits), and among the readers of each
  /// output it saves itself (softmax's y). `sign` -1 undoes it when the node goes.
  void count_tangent_holds(int sign) {
    if (sign > 0) {
      counts_tangents_ = true;
      reads_inputs_ = !saved().empty();
    }
    inputs_.count_tangent_holds(sign, reads_inputs_);
    outputs_.count_tangent_readers(sign);
  }

  InputEdges<In> inputs_;
  OutputEdges<Out> outputs_;
  BackwardFn<In, Out> fn_;
  bool counts_tangents_ = false;   // counted in its inputs' and outputs' tangent books
  bool reads_inputs_ = false;      // counted among its inputs' tangent readers
};

template <class In, class Out>
const BasicTensor<Out>& BackwardContext<In, Out>::grad_output(std::size_t i) {
  REMAT_ASSERT(i < grad_outputs_.size());
  if (!grad_outputs_[i].defined()) {
    BasicTensor<Out> zeros(node_.outputs_.shape(i));
    flat(zeros).setZero();
    grad_outputs_[i] = zeros;
  }
  return grad_outputs_[i];
}

template <class In, class Out>
template <class U>
BasicTensor<U> BackwardContext<In, Out>::saved(std::size_t i) const {
  REMAT_ASSERT(i < node_.saved().size());
  return node_.saved()[i].template get<U>(node_.name());
}

template <class In, class Out>
void BackwardContext<In, Out>::release_saved(std::size_t i) {
  REMAT_ASSERT(i < node_.saved().size());
  node_.release_saved(i);
}

template <class In, class Out>
BasicTensor<In> BackwardContext<In, Out>::as_input(std::size_t i, const BasicTensor<In>& data) const {
  return node_.inputs_.as_input(i, data);
}

template <class In, class Out>
BasicTensor<Out> BackwardContext<In, Out>::as_output(std::size_t i, const BasicTensor<Out>& data) const {
  return node_.outputs_.as_output(i, data);
}

template <class In, class Out>
bool BackwardContext<In, Out>::needs_grad(std::size_t i) const {
  return node_.inputs_.needs_grad(i);
}

template <class In, class Out>
void BackwardContext<In, Out>::accumulate(std::size_t i, BasicTensor<In> g) {
  if (!needs_grad(i)) return;
  REMAT_ASSERT(g.shape() == node_.inputs_.shape(i));
  accumulate_grad(gradient_of(i), std::move(g), create_graph_);
}

template <class In, class Out>
AutogradMeta<In>& BackwardContext<In, Out>::gradient_of(std::size_t i) {
  return node_.inputs_.gradient_of(i, node_.name());
}

}  // namespace remat::detail
