#pragma once
// Hessian-vector products by forward-over-reverse: the inputs are made dual with the direction as
// their tangent, f runs (every op carries the tangents forward), and the gradient's backward runs
// inside the dual level, where each op's backward computes in ops whose tangent rules carry the
// tangents into the gradients (the fused ops: their first-order kernels with the tangents beside
// them). The gradient's tangent is H·v. Nothing of the first backward is kept (no create_graph),
// and a checkpointed segment replays with its tangents. Measured on a small GPT (bench_hvp_step):
// 2.8-2.9x a gradient's time and 1.95-2.1x its peak bytes, against 3.6-4.2x and 5.0-8.2x for double
// backward; the tangents live in the autograd metadata the graph holds, and those no backward
// reads are dropped before the walk reaches them (core/tangent.hpp).

#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/forward_ad.hpp"
#include "remat/core/grad.hpp"

namespace remat {

/// f(inputs) (one element) and the Hessian-vector products H·v, one per input, H the Hessian of f
/// with respect to all inputs together and v one direction per input (each of its input's shape),
/// as torch.autograd.functional.hvp, by forward-over-reverse. An input f does not depend on gets
/// zeros. f runs with grad enabled; the inputs are not changed and get no .grad.
template <class T, class F>
std::pair<BasicTensor<T>, std::vector<BasicTensor<T>>> hvp(F&& f, const std::vector<BasicTensor<T>>& inputs,
                                                          const std::vector<BasicTensor<T>>& v) {
  REMAT_CHECK(inputs.size() == v.size(), "hvp: {} inputs but {} directions", inputs.size(), v.size());
  for (std::size_t i = 0; i < inputs.size(); ++i)
    REMAT_CHECK(inputs[i].defined() && v[i].defined() && inputs[i].shape() == v[i].shape(),
                "hvp: direction {} has shape {}, its input {}", i, v[i].shape(), inputs[i].shape());
  enable_grad on;
  dual_level level;
  std::vector<BasicTensor<T>> leaves, duals;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    leaves.push_back(inputs[i].detach().requires_grad_());
    duals.push_back(make_dual(leaves.back(), v[i]));
  }
  const BasicTensor<T> y = f(duals);
  REMAT_CHECK(y.defined() && y.numel() == 1, "hvp: f must return one element, got shape {}", y.shape());
  REMAT_CHECK(y.requires_grad(), "hvp: f's output does not depend on the inputs through differentiable ops");
  GradOptions options;
  options.allow_unused = true;
  const std::vector<BasicTensor<T>> g = grad(y, leaves, options);
  std::vector<BasicTensor<T>> products;
  for (std::size_t i = 0; i < g.size(); ++i) {
    BasicTensor<T> hv = detail::tangent_of(g[i]);
    if (hv.defined()) {
      products.push_back(detail::copy_of(hv));
    } else {
      products.emplace_back(inputs[i].shape());
      detail::flat(products.back()).setZero();
    }
  }
  return {y.detach(), std::move(products)};
}

/// hvp of a function of one tensor: {f(x), H·v}.
template <class T, class F, class = std::enable_if_t<std::is_invocable_v<F&, const BasicTensor<T>&>>>
std::pair<BasicTensor<T>, BasicTensor<T>> hvp(F&& f, const BasicTensor<T>& x, const BasicTensor<T>& v) {
  auto [y, products] = hvp([&](const std::vector<BasicTensor<T>>& xs) { return BasicTensor<T>(f(xs[0])); },
                           std::vector<BasicTensor<T>>{x}, std::vector<BasicTensor<T>>{v});
  return {y, products[0]};
}

}  // namespace remat
