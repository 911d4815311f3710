#pragma once
// The tape: a Wengert list of nodes, one per recorded op, walked in reverse by backward(). Each
// node holds its inputs' autograd metadata, the tensors it saved, and a backward function that
// adds into its inputs' gradients. Nodes free what they saved as soon as they have run.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/tensor.hpp"

namespace remat {
namespace detail {

/// A tensor a node keeps for its backward, type-erased so one node can keep float data and int64
/// indices. The version taken at save time catches in-place writes made before backward.
class SavedTensor {
 public:
  template <class U>
  SavedTensor(const BasicTensor<U>& t)  // NOLINT: implicit, so ops write {y, indices}
      : storage_(t.storage()), shape_(t.shape()), version_(t.storage()->version()),
        dtype_(detail::dtype_name<U>()) {}

  template <class U>
  BasicTensor<U> get(const char* op) const {
    REMAT_CHECK(storage_ != nullptr, "{}: a saved tensor was already freed; backward through this "
                "part of the graph ran before (use retain_graph=true to run it twice)", op);
    REMAT_CHECK(storage_->version() == version_,
                "{}: a tensor of shape {} saved for backward was modified in place after it was "
                "saved (version {} now, {} when saved); its gradient would be wrong",
                op, shape_, storage_->version(), version_);
    return BasicTensor<U>(storage_, shape_);
  }
  const Shape& shape() const { return shape_; }
  const char* dtype() const { return dtype_; }
  const detail::Storage* storage() const { return storage_.get(); }
  std::size_t bytes() const { return storage_ ? storage_->bytes() : 0; }

  void retain() { storage_->retain_saved(); }
  void release() {
    if (!storage_) return;
    storage_->release_saved();
    storage_.reset();
  }

 private:
  std::shared_ptr<detail::Storage> storage_;
  Shape shape_;
  std::uint64_t version_;
  const char* dtype_;
};

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

  void release_saved(std::size_t i) {
    if (saved_[i].storage() != nullptr) saved_[i].release();
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

template <class T>
void accumulate_grad(AutogradMeta<T>& meta, BasicTensor<T> g) {
  if (!meta.grad.defined()) {
    // Adopt the buffer when nothing else holds it; otherwise copy, so two gradients never alias.
    meta.grad = g.storage().use_count() == 1 && !g.meta() ? std::move(g) : copy_of(g);
  } else {
    flat(meta.grad) += flat(g);
  }
}

template <class T>
class TypedNode;

/// What a backward function sees: the gradients of the node's outputs, what it saved, and where
/// to add its inputs' gradients.
template <class T>
class BackwardContext {
 public:
  BackwardContext(TypedNode<T>& node, std::vector<BasicTensor<T>>& grad_outputs)
      : node_(node), grad_outputs_(grad_outputs) {}

  /// The gradient of output i; zeros when that output received none.
  const BasicTensor<T>& grad_output(std::size_t i = 0);
  /// Saved tensor i, checked against in-place modification since it was saved.
  template <class U = T>
  BasicTensor<U> saved(std::size_t i) const;
  /// Releases saved tensor i now, before the node finishes (a backward that frees as it goes).
  void release_saved(std::size_t i);
  /// Whether input i needs a gradient (PyTorch's needs_input_grad): skip the work otherwise.
  bool needs_grad(std::size_t i) const;
  /// Adds g into input i's gradient; g must have that input's shape.
  void accumulate(std::size_t i, BasicTensor<T> g);

 private:
  TypedNode<T>& node_;
  std::vector<BasicTensor<T>>& grad_outputs_;
};

template <class T>
using BackwardFn = std::function<void(BackwardContext<T>&)>;

template <class T>
class TypedNode final : public Node {
 public:
  TypedNode(std::string name, std::uint64_t id, const std::vector<BasicTensor<T>>& inputs,
            const std::vector<BasicTensor<T>*>& outputs, std::vector<SavedTensor> saved, BackwardFn<T> fn)
      : Node(std::move(name), id, std::move(saved)), fn_(std::move(fn)) {
    for (const BasicTensor<T>& x : inputs) {
      inputs_.push_back(x.requires_grad() ? x.meta() : nullptr);
      input_shapes_.push_back(x.shape());
    }
    for (const BasicTensor<T>* y : outputs) {
      outputs_.push_back(y->meta());
      output_shapes_.push_back(y->shape());
    }
  }

  ~TypedNode() override { release(); }

  bool has_output_grad() const override {
    return std::any_of(outputs_.begin(), outputs_.end(), [](const auto& w) {
      auto m = w.lock();
      return m && m->grad.defined();
    });
  }
  bool outputs_alive() const override {
    return std::any_of(outputs_.begin(), outputs_.end(), [](const auto& w) { return !w.expired(); });
  }

  void run(bool retain_graph) override {
    REMAT_ASSERT(!released());
    std::vector<BasicTensor<T>> grads(outputs_.size());
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      if (auto m = outputs_[i].lock()) {
        grads[i] = m->grad;
        if (!m->retains_grad) m->grad = BasicTensor<T>();  // consumed: free it now
      }
    }
    BackwardContext<T> ctx(*this, grads);
    fn_(ctx);
    if (!retain_graph) release();
  }

 protected:
  void drop_edges() override {
    // Outputs still alive learn that their history is gone, so a later backward into them throws
    // instead of silently stopping there. The input edges stay until the node leaves the tape:
    // during a backward walk they keep alive the gradients just handed to producer nodes below.
    for (const auto& w : outputs_)
      if (auto m = w.lock()) m->history_freed = true;
    fn_ = nullptr;
  }

 private:
  friend class BackwardContext<T>;
  std::vector<std::shared_ptr<AutogradMeta<T>>> inputs_;  // null where no gradient is needed
  std::vector<Shape> input_shapes_;
  std::vector<std::weak_ptr<AutogradMeta<T>>> outputs_;
  std::vector<Shape> output_shapes_;
  BackwardFn<T> fn_;
};

template <class T>
const BasicTensor<T>& BackwardContext<T>::grad_output(std::size_t i) {
  REMAT_ASSERT(i < grad_outputs_.size());
  if (!grad_outputs_[i].defined()) {
    BasicTensor<T> zeros(node_.output_shapes_[i]);
    flat(zeros).setZero();
    grad_outputs_[i] = zeros;
  }
  return grad_outputs_[i];
}

template <class T>
template <class U>
BasicTensor<U> BackwardContext<T>::saved(std::size_t i) const {
  REMAT_ASSERT(i < node_.saved().size());
  return node_.saved()[i].template get<U>(node_.name());
}

template <class T>
void BackwardContext<T>::release_saved(std::size_t i) {
  REMAT_ASSERT(i < node_.saved().size());
  node_.release_saved(i);
}

template <class T>
bool BackwardContext<T>::needs_grad(std::size_t i) const {
  return i < node_.inputs_.size() && node_.inputs_[i] != nullptr;
}

template <class T>
void BackwardContext<T>::accumulate(std::size_t i, BasicTensor<T> g) {
  if (!needs_grad(i)) return;
  REMAT_ASSERT(g.shape() == node_.input_shapes_[i]);
  AutogradMeta<T>& input = *node_.inputs_[i];
  REMAT_CHECK(!input.history_freed,
              "backward: op '{}' passes a gradient to an input of shape {} whose own graph was "
              "already freed by an earlier backward; pass retain_graph=true to that backward",
              node_.name(), node_.input_shapes_[i]);
  accumulate_grad(input, std::move(g));
}

}  // namespace detail

/// A tape position: the number of nodes before it.
using TapePosition = std::size_t;

/// A Wengert list. The thread's root tape records by default; checkpoint replays push a nested
/// tape, record into it and walk it backward. Positions support mark / backward-between / reset.
class Tape {
 public:
  Tape() = default;
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
  ~Tape() { reset(0); }

  TapePosition position() const { return nodes_.size(); }
  std::size_t size() const { return nodes_.size(); }
  const std::vector<std::unique_ptr<detail::Node>>& nodes() const { return nodes_; }

  void push(std::unique_ptr<detail::Node> node) {
    prune();
    nodes_.push_back(std::move(node));
  }

  /// Runs, newest first, every node in [to, from) whose outputs have gradients.
  void backward(TapePosition from, TapePosition to = 0, bool retain_graph = false) {
    REMAT_CHECK(to <= from && from <= nodes_.size(),
                "Tape::backward: positions [{}, {}) are not within the tape of {} nodes", to, from,
                nodes_.size());
    for (TapePosition i = from; i-- > to;) {
      detail::Node& node = *nodes_[i];
      if (node.released()) continue;
      if (node.has_output_grad()) {
        node.run(retain_graph);
      } else if (!node.outputs_alive()) {
        node.release();  // unreachable: free what it saved now rather than at the next prune
      }
    }
    prune();
  }

  /// Drops every node at or after `to`, freeing what they saved.
  void reset(TapePosition to = 0) {
    while (nodes_.size() > to) nodes_.pop_back();
  }

  /// Finds the node with this id (ids increase along a tape); -1 when it is not here.
  std::ptrdiff_t find(std::uint64_t id) const {
    auto it = std::lower_bound(nodes_.begin(), nodes_.end(), id,
                               [](const auto& n, std::uint64_t v) { return n->id() < v; });
    if (it == nodes_.end() || (*it)->id() != id) return -1;
    return it - nodes_.begin();
  }

 private:
  // Nodes at the tail whose outputs are gone can never run: drop them, which in turn may make
  // their inputs' producers unreachable. This is what frees a graph that is never backpropagated.
  void prune() {
    while (!nodes_.empty() && (nodes_.back()->released() || !nodes_.back()->outputs_alive()))
      nodes_.pop_back();
  }

  std::vector<std::unique_ptr<detail::Node>> nodes_;
};

namespace detail {

struct AutogradState {
  bool grad_enabled = true;
  bool recording = true;  ///< false inside a checkpointed forward: requires_grad flows, no nodes
  int replay_depth = 0;   ///< > 0 while a checkpoint replays a segment's forward
  std::uint64_t next_node_id = 1;
  Tape root;
  std::vector<Tape*> tapes{&root};
};

inline AutogradState& autograd_state() {
  thread_local AutogradState state;
  return state;
}

/// Whether an op with these inputs must produce a tensor that requires grad.
template <class T, class... Rest>
bool grad_needed(const BasicTensor<T>& x, const Rest&... rest) {
  if (!autograd_state().grad_enabled) return false;
  return x.requires_grad() || (rest.requires_grad() || ...);
}

/// Makes `outputs` require grad and, unless recording is suspended, puts one node on the current
/// tape. Call it only when grad_needed(inputs...) holds.
template <class T>
void record(std::string op, const std::vector<BasicTensor<T>>& inputs,
            const std::vector<BasicTensor<T>*>& outputs, std::vector<SavedTensor> saved, BackwardFn<T> fn) {
  AutogradState& state = autograd_state();
  for (BasicTensor<T>* y : outputs) {
    auto meta = std::make_shared<AutogradMeta<T>>();
    meta->requires_grad = true;
    y->set_meta(std::move(meta));
  }
  if (!state.recording) return;
  const std::uint64_t id = state.next_node_id++;
  for (BasicTensor<T>* y : outputs) y->meta()->node_id = id;
  state.tapes.back()->push(
      std::make_unique<TypedNode<T>>(std::move(op), id, inputs, outputs, std::move(saved), std::move(fn)));
}

/// The tape holding node `id` among the thread's live tapes, innermost first.
inline std::pair<Tape*, std::ptrdiff_t> locate_node(std::uint64_t id) {
  auto& tapes = autograd_state().tapes;
  for (auto it = tapes.rbegin(); it != tapes.rend(); ++it)
    if (std::ptrdiff_t i = (*it)->find(id); i >= 0) return {*it, i};
  return {nullptr, -1};
}

}  // namespace detail

/// The tape ops record into now.
inline Tape& current_tape() { return *detail::autograd_state().tapes.back(); }

/// Makes `tape` the current tape for the guard's lifetime (nested tapes are how replay works).
class TapeGuard {
 public:
  explicit TapeGuard(Tape& tape) { detail::autograd_state().tapes.push_back(&tape); }
  ~TapeGuard() { detail::autograd_state().tapes.pop_back(); }
  TapeGuard(const TapeGuard&) = delete;
  TapeGuard& operator=(const TapeGuard&) = delete;
};

inline bool is_grad_enabled() { return detail::autograd_state().grad_enabled; }

/// True while a checkpoint replays a segment's forward during backward. Code with side effects
/// (counters, logging, running statistics, caches) checks it so that replay does not repeat them.
inline bool is_replaying() { return detail::autograd_state().replay_depth > 0; }

/// RAII: no op records a node or produces a tensor that requires grad while it lives.
class no_grad {
 public:
  no_grad() : previous_(detail::autograd_state().grad_enabled) {
    detail::autograd_state().grad_enabled = false;
  }
  ~no_grad() { detail::autograd_state().grad_enabled = previous_; }
  no_grad(const no_grad&) = delete;
  no_grad& operator=(const no_grad&) = delete;

 private:
  bool previous_;
};

/// RAII: turns gradient recording back on inside a no_grad region.
class enable_grad {
 public:
  enable_grad() : previous_(detail::autograd_state().grad_enabled) {
    detail::autograd_state().grad_enabled = true;
  }
  ~enable_grad() { detail::autograd_state().grad_enabled = previous_; }
  enable_grad(const enable_grad&) = delete;
  enable_grad& operator=(const enable_grad&) = delete;

 private:
  bool previous_;
};

template <class T>
void BasicTensor<T>::backward(const BasicTensor& gradient, bool retain_graph) const {
  REMAT_CHECK(defined(), "backward: the tensor is undefined");
  REMAT_CHECK(requires_grad(), "backward: tensor of shape {} does not require grad and has no grad_fn",
              shape_);
  BasicTensor seed;
  if (gradient.defined()) {
    REMAT_CHECK(gradient.shape() == shape_,
                "backward: gradient of shape {} does not match the tensor's shape {}", gradient.shape(),
                shape_);
    seed = detail::copy_of(gradient);
  } else {
    REMAT_CHECK(numel() == 1,
                "backward: a gradient can be created implicitly only for a one-element output (a "
                "loss); this tensor has shape {} — pass a gradient of that shape", shape_);
    seed = BasicTensor(shape_);
    detail::flat(seed).setOnes();
  }
  if (meta_->is_leaf()) {
    detail::accumulate_grad(*meta_, std::move(seed));
    return;
  }
  auto [tape, index] = detail::locate_node(meta_->node_id);
  REMAT_CHECK(tape != nullptr && !meta_->history_freed,
              "backward: the graph that produced this tensor (shape {}) has already been freed — "
              "backward ran through it before; pass retain_graph=true to the first backward to run "
              "it twice", shape_);
  detail::accumulate_grad(*meta_, std::move(seed));
  tape->backward(static_cast<TapePosition>(index) + 1, 0, retain_graph);
}

}  // namespace remat
