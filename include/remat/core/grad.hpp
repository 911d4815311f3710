#pragma once
// remat::grad: the gradients of outputs with respect to chosen inputs, returned as tensors
// (PyTorch's torch.autograd.grad). The same walk as backward(), through checkpoints and chain
// schedules alike, but it writes no .grad: every leaf's gradient is put back as it was
// (core/grad_capture.hpp), and what reached the inputs is handed back instead.

#include <algorithm>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/grad_capture.hpp"

namespace remat {

/// Options of grad(), named as PyTorch's.
struct GradOptions {
  /// Keep the graph for another backward or grad() (otherwise freed as it is walked).
  bool retain_graph = false;
  /// Record the backward so the gradients can be differentiated again (any order); implies
  /// retain_graph. Ops whose backward cannot be recorded yet are named by a remat::Error when the
  /// walk reaches them (the list is in core/node.hpp's message and in README).
  bool create_graph = false;
  /// An input the outputs do not depend on gets an undefined tensor instead of an error.
  bool allow_unused = false;
};

/// The gradients of `outputs` (weighted by `grad_outputs`, each of its output's shape; may be
/// empty when every output holds one element) with respect to `inputs`: one tensor per input, in
/// order. Inputs may be leaves or tensors computed on the way. No .grad is written anywhere, and
/// observers do not hear leaf gradients (a DataParallel does not reduce them). A walk that throws
/// returns nothing, as a MemoryBudget's over-the-cap error at the end of a complete walk does too
/// (backward() leaves .grad complete then; grad() has nowhere to leave its results).
template <class T>
std::vector<BasicTensor<T>> grad(const std::vector<BasicTensor<T>>& outputs, const std::vector<BasicTensor<T>>& inputs,
                                 const std::vector<BasicTensor<T>>& grad_outputs = {}, const GradOptions& options = {}) {
  REMAT_CHECK(!outputs.empty(), "grad: no outputs to differentiate");
  REMAT_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
              "grad: {} grad_outputs for {} outputs — pass one per output, or none for one-element outputs",
              grad_outputs.size(), outputs.size());
  std::vector<detail::BackwardRoot<T>> roots;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const BasicTensor<T>& y = outputs[i];
    REMAT_CHECK(y.defined(), "grad: output {} is undefined", i);
    REMAT_CHECK(y.requires_grad(),
                "grad: output {} (shape {}) does not require grad — it was not computed from a tensor that "
                "requires grad (a gradient computed without create_graph is one such: it has no graph)", i,
                y.shape());
    BasicTensor<T> seed;
    const bool given = !grad_outputs.empty() && grad_outputs[i].defined();
    if (given) {
      REMAT_CHECK(grad_outputs[i].shape() == y.shape(), "grad: grad_outputs[{}] has shape {}, output {} has shape {}",
                  i, grad_outputs[i].shape(), i, y.shape());
      // Under create_graph a weight with a graph of its own keeps it (the result depends on it).
      seed = options.create_graph && grad_outputs[i].requires_grad() ? grad_outputs[i] : detail::copy_of(grad_outputs[i]);
    } else {
      REMAT_CHECK(y.numel() == 1,
                  "grad: output {} has shape {} — a gradient is implied only for a one-element output; pass "
                  "grad_outputs[{}] of that shape", i, y.shape(), i);
      seed = BasicTensor<T>(y.shape());
      detail::flat(seed).setOnes();
    }
    roots.push_back({&outputs[i], std::move(seed)});
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    REMAT_CHECK(inputs[i].defined(), "grad: input {} is undefined", i);
    REMAT_CHECK(inputs[i].requires_grad(), "grad: input {} (shape {}) does not require grad", i, inputs[i].shape());
  }

  detail::GradCapture capture;  // every .grad and retained gradient as it was, when it goes
  for (const BasicTensor<T>& x : inputs) {
    if (x.meta()->is_leaf()) capture.set_aside(*x.meta());
    else capture.keep(*x.meta());
  }
  {
    detail::Install<&detail::Session::grad_capture> capturing(&capture);
    detail::run_backward<T>("grad", std::move(roots), options.retain_graph, options.create_graph);
  }
  std::vector<BasicTensor<T>> result;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& meta = inputs[i].meta();
    // A leaf's is what the walk accumulated (set back by the capture after this); a computed
    // input's is what its node received (or, when it is an output itself, its seed, not yet run).
    BasicTensor<T>& slot = meta->is_leaf() ? meta->grad : (meta->retained.defined() ? meta->retained : meta->grad);
    BasicTensor<T> g = slot;
    REMAT_CHECK(g.defined() || options.allow_unused,
                "grad: input {} (shape {}) was not used to compute the outputs (no gradient reached it); "
                "pass allow_unused = true to get an undefined tensor for it", i, inputs[i].shape());
    // With create_graph the tensor itself, graph and all (nothing writes a graph's tensors in place).
    if (options.create_graph && g.defined() && g.meta()) {
      result.push_back(g);
      continue;
    }
    // The walk's own tensor, taken from its slot (the capture puts the slot back as it was anyway):
    // a copy would hold every gradient twice as grad() returns, the step's peak under per-block
    // checkpointing. A copy still where its bytes are shared: an input listed again later, or one
    // gradient passed on to two inputs.
    const bool listed_again = std::any_of(inputs.begin() + static_cast<std::ptrdiff_t>(i) + 1, inputs.end(),
                                          [&](const BasicTensor<T>& x) { return x.meta() == meta; });
    if (!listed_again) slot = BasicTensor<T>();
    if (!g.defined()) result.emplace_back();
    else if (g.storage().use_count() == 1) result.emplace_back(g.storage(), g.shape());
    else result.push_back(detail::copy_of(g));
    // Inside a dual level the gradient carries its tangent (hvp: forward-over-reverse).
    if (detail::has_tangent(g)) detail::set_tangent(result.back(), detail::tangent_of(g));
  }
  return result;
}

/// grad() of one output.
template <class T>
std::vector<BasicTensor<T>> grad(const BasicTensor<T>& output, const std::vector<detail::non_deduced<BasicTensor<T>>>& inputs,
                                 const GradOptions& options = {}) {
  return grad(std::vector<BasicTensor<T>>{output}, inputs, {}, options);
}

}  // namespace remat
