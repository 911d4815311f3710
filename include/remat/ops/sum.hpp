#pragma once
#include "remat/core/produce.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/reduce.hpp"

namespace remat {
namespace op {
/// The id of sum(x): the sum of every element, a scalar.
inline const OpId sum = register_op("sum", tangent_rule);
/// The id of sum(x, dim): the sum along a dim.
inline const OpId sum_dim = register_op("sum_dim", tangent_rule);
}  // namespace op


/// y = Σ x over all elements, a scalar (rank 0).  dx = dy everywhere.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> sum(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::sum(a); }, x);
  else {
    BasicTensor<T> y = detail::produce<T>(op::sum, Shape{}, static_cast<double>(x.numel()), {x}, [=] {
      BasicTensor<T> total(Shape{});
      total.data()[0] = detail::flat(x).sum();
      return total;
    });
    if (detail::grad_needed(x))
      detail::record<T>(op::sum, {x}, {&y}, {}, [shape = x.shape()](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph()) return ctx.accumulate(0, broadcast_to(ctx.grad_output(), shape));
        BasicTensor<T> dx(shape);
        detail::flat(dx).setConstant(ctx.grad_output().data()[0]);
        ctx.accumulate(0, std::move(dx));
      });
    detail::push_tangent(y, [](const BasicTensor<T>& t) { return sum(t); }, x);  // linear: the same sum
    return y;
  }
}

/// y = Σ_k x[..., k, ...] over `dim` (negative counts from the end).  dx = dy repeated along dim.
/// Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> sum(const BasicTensor<T>& x, std::int64_t dim, bool keepdim = false) {
  if constexpr (detail::routed<T>()) return detail::route([=](const auto& a) { return remat::sum(a, dim, keepdim); }, x);
  else {
    const int d = x.shape().dim(dim, "sum");
    BasicTensor<T> y = detail::produce<T>(op::sum_dim, detail::reduced_shape(x.shape(), d, keepdim),
                                          static_cast<double>(x.numel()),
                                          {x}, [=] { return detail::sum_over_dim(x, d, keepdim, T(1)); });
    if (detail::grad_needed(x))
      detail::record<T>(op::sum_dim, {x}, {&y}, {}, [shape = x.shape(), d](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph())
          return ctx.accumulate(0, broadcast_to(detail::keep_dim(ctx.grad_output(), shape, d), shape));
        ctx.accumulate(0, detail::expand_over_dim(ctx.grad_output(), shape, d, T(1)));
      });
    detail::push_tangent(y, [=](const BasicTensor<T>& t) { return sum(t, d, keepdim); }, x);
    return y;
  }
}

}  // namespace remat
