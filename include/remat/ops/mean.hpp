#pragma once
#include "remat/core/produce.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/div.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/reduce.hpp"

namespace remat {
namespace op {
/// The id of mean(x): the mean of every element, a scalar.
inline const OpId mean = register_op("mean", tangent_rule);
/// The id of mean(x, dim): the mean along a dim.
inline const OpId mean_dim = register_op("mean_dim", tangent_rule);
}  // namespace op


/// y = (1/n) Σ x over all n elements, a scalar.  dx = dy / n everywhere.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> mean(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::mean(a); }, x);
  else {
    REMAT_CHECK(x.numel() > 0, "mean: the tensor of shape {} has no elements", x.shape());
    BasicTensor<T> y = detail::produce<T>(op::mean, Shape{}, static_cast<double>(x.numel()), {x}, [=] {
      BasicTensor<T> average(Shape{});
      average.data()[0] = detail::flat(x).mean();
      return average;
    });
    if (detail::grad_needed(x))
      detail::record<T>(op::mean, {x}, {&y}, {}, [shape = x.shape()](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph())
          return ctx.accumulate(0, broadcast_to(div(ctx.grad_output(), static_cast<T>(shape.numel())), shape));
        BasicTensor<T> dx(shape);
        detail::flat(dx).setConstant(ctx.grad_output().data()[0] / static_cast<T>(shape.numel()));
        ctx.accumulate(0, std::move(dx));
      });
    detail::push_tangent(y, [](const BasicTensor<T>& t) { return mean(t); }, x);  // linear: the same mean
    return y;
  }
}

/// y = (1/n) Σ_k x[..., k, ...] over `dim` of size n.  dx = dy / n repeated along dim.
/// Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> mean(const BasicTensor<T>& x, std::int64_t dim, bool keepdim = false) {
  if constexpr (detail::routed<T>()) return detail::route([=](const auto& a) { return remat::mean(a, dim, keepdim); }, x);
  else {
    const int d = x.shape().dim(dim, "mean");
    const std::int64_t n = x.shape()[d];
    REMAT_CHECK(n > 0, "mean: dim {} of shape {} is empty", dim, x.shape());
    const T scale = T(1) / static_cast<T>(n);
    BasicTensor<T> y = detail::produce<T>(op::mean_dim, detail::reduced_shape(x.shape(), d, keepdim),
                                          static_cast<double>(x.numel()),
                                          {x}, [=] { return detail::sum_over_dim(x, d, keepdim, scale); });
    if (detail::grad_needed(x))
      detail::record<T>(op::mean_dim, {x}, {&y}, {}, [shape = x.shape(), d, scale](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph())
          return ctx.accumulate(0, broadcast_to(detail::keep_dim(mul(ctx.grad_output(), scale), shape, d), shape));
        ctx.accumulate(0, detail::expand_over_dim(ctx.grad_output(), shape, d, scale));
      });
    detail::push_tangent(y, [=](const BasicTensor<T>& t) { return mean(t, d, keepdim); }, x);
    return y;
  }
}

}  // namespace remat
