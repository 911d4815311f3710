#pragma once
#include "remat/core/produce.hpp"
#include "remat/ops/detail/broadcast.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/reshape.hpp"

namespace remat {
namespace op {
/// The id of broadcast_to(x, shape): x repeated along the dims it is broadcast over.
inline const OpId broadcast_to = register_op("broadcast_to", tangent_rule);
/// The id of sum_to_size(x, shape): x summed over the dims `shape` is broadcast along.
inline const OpId sum_to_size = register_op("sum_to_size", tangent_rule);
}  // namespace op

namespace detail {

/// x repeated to `shape` (numpy broadcasting, which the caller has checked).
template <class T>
BasicTensor<T> expand_to(const BasicTensor<T>& x, const Shape& shape) {
  BasicTensor<T> out(shape);
  const auto n = padded_sizes(shape);
  const auto sx = broadcast_strides(x.shape(), shape);
  const T* px = x.data();
  T* po = out.data();
  for (std::int64_t i0 = 0; i0 < n[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < n[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < n[2]; ++i2) {
        const T* row = px + i0 * sx[0] + i1 * sx[1] + i2 * sx[2];
        for (std::int64_t i3 = 0; i3 < n[3]; ++i3) *po++ = row[i3 * sx[3]];
      }
  return out;
}

/// The gradient of a reduction over dim d of `shape` (keepdim or not) as a recorded view with d
/// kept at size 1, ready to be broadcast back to `shape`.
template <class T>
BasicTensor<T> keep_dim(const BasicTensor<T>& dy, const Shape& shape, int d) {
  return reshape(dy, shape.with(d, 1).vec());
}

}  // namespace detail

template <class T>
BasicTensor<T> sum_to_size(const BasicTensor<T>& x, const Shape& shape);

/// y = x repeated along the dims where it is broadcast to `shape` (numpy rules; PyTorch's
/// broadcast_to, here a copy rather than a strided view). x itself when the shapes are equal.
/// dx = sum_to_size(dy, x.shape).  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (exact: it only copies).
template <class T>
BasicTensor<T> broadcast_to(const BasicTensor<T>& x, const Shape& shape) {
  if constexpr (detail::routed<T>()) return detail::route([shape](const auto& a) { return remat::broadcast_to(a, shape); }, x);
  else {
    REMAT_CHECK(detail::broadcast_shape(x.shape(), shape, "broadcast_to") == shape,
                "broadcast_to: a tensor of shape {} cannot be broadcast to shape {} (it would become {})", x.shape(),
                shape, detail::broadcast_shape(x.shape(), shape, "broadcast_to"));
    if (x.shape() == shape) return x;
    BasicTensor<T> y = detail::produce<T>(op::broadcast_to, shape, 0.0, {x}, [=] { return detail::expand_to(x, shape); });
    if (detail::grad_needed(x))
      detail::record<T>(op::broadcast_to, {x}, {&y}, {}, [in = x.shape()](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph()) ctx.accumulate(0, sum_to_size(ctx.grad_output(), in));
        else ctx.accumulate(0, detail::sum_to(ctx.grad_output(), in));
      });
    detail::push_tangent(y, [&](const BasicTensor<T>& t) { return broadcast_to(t, shape); }, x);
    return y;
  }
}

/// y = x summed over the dims along which `shape` broadcasts to x's shape, so that y has `shape`
/// (PyTorch's Tensor.sum_to_size: the gradient of a broadcast operand). x itself when the shapes
/// are equal.  dx = broadcast_to(dy, x.shape).  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> sum_to_size(const BasicTensor<T>& x, const Shape& shape) {
  if constexpr (detail::routed<T>()) return detail::route([shape](const auto& a) { return remat::sum_to_size(a, shape); }, x);
  else {
    REMAT_CHECK(detail::broadcast_shape(shape, x.shape(), "sum_to_size") == x.shape(),
                "sum_to_size: shape {} does not broadcast to the tensor's shape {}, so the tensor cannot be summed "
                "to it", shape, x.shape());
    if (x.shape() == shape) return x;
    BasicTensor<T> y = detail::produce<T>(op::sum_to_size, shape, static_cast<double>(x.numel()), {x},
                                          [=] { return detail::sum_to(x, shape); });
    if (detail::grad_needed(x))
      detail::record<T>(op::sum_to_size, {x}, {&y}, {}, [in = x.shape()](detail::BackwardContext<T>& ctx) {
        if (ctx.create_graph()) ctx.accumulate(0, broadcast_to(ctx.grad_output(), in));
        else ctx.accumulate(0, detail::expand_to(ctx.grad_output(), in));
      });
    detail::push_tangent(y, [&](const BasicTensor<T>& t) { return sum_to_size(t, shape); }, x);
    return y;
  }
}

}  // namespace remat
