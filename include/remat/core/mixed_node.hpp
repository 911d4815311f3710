#pragma once
// A node whose inputs and outputs may hold any floating element type, side by side: what a
// checkpointed segment is, since its arguments and results are whatever the user's function takes
// and returns (a float64 model, bfloat16 activations, a float32 block fed a float64 residual).
// Ops never need one: each is one element type in and out (core/node.hpp's TypedNode), and an op
// of several types is written over casts. Edges are kept per type, so a gradient is never
// converted: each input receives its gradient in its own type, as without the node.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "remat/core/node.hpp"

namespace remat::detail {

/// One `Of<T>` for each element type that carries gradients (float32, float64, bfloat16).
template <template <class> class Of>
struct PerFloatingType {
  std::tuple<Of<float>, Of<double>, Of<bfloat16>> of;

  template <class T>
  Of<T>& get() {
    return std::get<Of<T>>(of);
  }
  template <class T>
  const Of<T>& get() const {
    return std::get<Of<T>>(of);
  }
  /// f(x) for each type's x, in a fixed order.
  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... x) { (f(x), ...); }, of);
  }
  template <class F>
  void each(F&& f) const {
    std::apply([&](const auto&... x) { (f(x), ...); }, of);
  }
  /// Whether f(x) holds for some type's x.
  template <class F>
  bool any(F&& f) const {
    return std::apply([&](const auto&... x) { return (f(x) || ...); }, of);
  }
};

template <class T>
using TensorList = std::vector<BasicTensor<T>>;
template <class T>
using TensorPointers = std::vector<BasicTensor<T>*>;

class MixedNode;

/// What a mixed node's backward sees: BackwardContext's calls, with the element type named. Input i
/// and output i count among the node's inputs (outputs) of that type only.
class MixedBackwardContext : public BackwardModes {
 public:
  MixedBackwardContext(MixedNode& node, PerFloatingType<TensorList>& grad_outputs, bool retain_graph,
                       bool create_graph)
      : BackwardModes(retain_graph, create_graph), node_(node), grad_outputs_(grad_outputs) {}

  /// Whether output i of type T received a gradient.
  template <class T>
  bool has_grad_output(std::size_t i) const {
    const TensorList<T>& g = grad_outputs_.get<T>();
    return i < g.size() && g[i].defined();
  }
  /// The gradient of output i of type T; zeros when it received none.
  template <class T>
  const BasicTensor<T>& grad_output(std::size_t i);
  /// `data` carrying input i's (of type T) autograd identity when it needs a gradient.
  template <class T>
  BasicTensor<T> as_input(std::size_t i, const BasicTensor<T>& data) const;
  /// Saved tensor k, of type T, checked against in-place modification since it was saved.
  template <class T>
  BasicTensor<T> saved(std::size_t k) const;
  /// Saved tensor k with its element type erased (a selective segment's kept op outputs, any type).
  TensorRef saved_ref(std::size_t k) const;

 private:
  MixedNode& node_;
  PerFloatingType<TensorList>& grad_outputs_;
};

using MixedBackwardFn = std::function<void(MixedBackwardContext&)>;

class MixedNode final : public Node {
 public:
  MixedNode(std::string name, std::uint64_t id, const PerFloatingType<TensorList>& inputs,
            const PerFloatingType<TensorPointers>& outputs, std::vector<SavedTensor> saved, MixedBackwardFn fn)
      : Node(std::move(name), id, std::move(saved)), fn_(std::move(fn)) {
    // Each type's edges from that type's lists (a generic lambda cannot name the type; these can).
    init_edges<float>(inputs, outputs);
    init_edges<double>(inputs, outputs);
    init_edges<bfloat16>(inputs, outputs);
    if (tangents_active()) count_tangent_holds(+1);
  }

  ~MixedNode() override {
    release();
    if (counts_tangents_) count_tangent_holds(-1);
  }

  bool has_output_grad() const override {
    return outputs_.any([](const auto& edges) { return edges.any_grad(); });
  }
  bool outputs_alive() const override {
    return outputs_.any([](const auto& edges) { return edges.any_alive(); });
  }

  void run(bool retain_graph) override {
    REMAT_ASSERT(!released());
    const bool graph = walk_in_ops();
    PerFloatingType<TensorList> grads;
    take_grads<float>(grads, graph);
    take_grads<double>(grads, graph);
    take_grads<bfloat16>(grads, graph);
    MixedBackwardContext ctx(*this, grads, retain_graph, graph);
    run_node_backward(
        *this, graph, retain_graph,
        [&] {
          fn_(ctx);
          return ctx.asked_create_graph();
        },
        [&] { outputs_.each([](const auto& edges) { edges.drop_tangents(); }); });
  }

 protected:
  void drop_edges() override {
    outputs_.each([](const auto& edges) { edges.mark_history_freed(); });
    fn_ = nullptr;
  }

 private:
  friend class MixedBackwardContext;

  template <class T>
  void init_edges(const PerFloatingType<TensorList>& inputs, const PerFloatingType<TensorPointers>& outputs) {
    inputs_.get<T>() = InputEdges<T>(inputs.get<T>());
    outputs_.get<T>() = OutputEdges<T>(outputs.get<T>(), saved());
  }
  template <class T>
  void take_grads(PerFloatingType<TensorList>& grads, bool graph) const {
    grads.get<T>() = outputs_.get<T>().take_grads(graph);
  }

  void count_tangent_holds(int sign) {
    if (sign > 0) {
      counts_tangents_ = true;
      reads_inputs_ = !saved().empty();
    }
    inputs_.each([&](const auto& edges) { edges.count_tangent_holds(sign, reads_inputs_); });
    outputs_.each([&](const auto& edges) { edges.count_tangent_readers(sign); });
  }

  PerFloatingType<InputEdges> inputs_;
  PerFloatingType<OutputEdges> outputs_;
  MixedBackwardFn fn_;
  bool counts_tangents_ = false;
  bool reads_inputs_ = false;
};

template <class T>
const BasicTensor<T>& MixedBackwardContext::grad_output(std::size_t i) {
  TensorList<T>& g = grad_outputs_.get<T>();
  REMAT_ASSERT(i < g.size());
  if (!g[i].defined()) {
    BasicTensor<T> zeros(node_.outputs_.get<T>().shape(i));
    flat(zeros).setZero();
    g[i] = zeros;
  }
  return g[i];
}

template <class T>
BasicTensor<T> MixedBackwardContext::as_input(std::size_t i, const BasicTensor<T>& data) const {
  return node_.inputs_.get<T>().as_input(i, data);
}

template <class T>
BasicTensor<T> MixedBackwardContext::saved(std::size_t k) const {
  REMAT_ASSERT(k < node_.saved().size());
  return node_.saved()[k].template get<T>(node_.name());
}

inline TensorRef MixedBackwardContext::saved_ref(std::size_t k) const {
  REMAT_ASSERT(k < node_.saved().size());
  return node_.saved()[k].ref(node_.name());
}

}  // namespace remat::detail
