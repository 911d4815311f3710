#pragma once
#include <algorithm>
#include <cstring>

#include "remat/core/produce.hpp"

namespace remat {
namespace op {
/// The id of narrow(x, dim, start, length) (and slice, split, chunk): a copied range along a dim.
inline const OpId narrow = register_op("narrow", tangent_rule);
}  // namespace op

namespace detail {

/// f(o0, o1) over the outer index of tensors laid out as (outer, n, inner), on threads when each
/// piece moves at least kElementGrain of `per_outer` elements (q, k and v out of a packed
/// projection are a serial copy otherwise, while the other thread waits).
template <class F>
void for_outer(std::int64_t outer, std::int64_t per_outer, F f) {
  parallel_for(outer, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(per_outer, 1)), f);
}

/// Copies a block of `length` positions along `dim` between tensors laid out as (outer, n, inner):
/// from src positions [src_start, +length) to dst positions [dst_start, +length).
template <class T>
void copy_along(const BasicTensor<T>& src, std::int64_t src_start, BasicTensor<T>& dst, std::int64_t dst_start,
                int dim, std::int64_t length) {
  const std::int64_t outer = src.shape().outer(dim), inner = src.shape().inner(dim);
  const std::int64_t ns = src.shape()[dim], nd = dst.shape()[dim];
  const T* ps = src.data();
  T* pd = dst.data();
  const std::size_t bytes = static_cast<std::size_t>(length * inner) * sizeof(T);
  if (bytes == 0) return;
  for_outer(outer, length * inner, [=](std::int64_t o0, std::int64_t o1) {
    for (std::int64_t o = o0; o < o1; ++o)
      std::memcpy(pd + (o * nd + dst_start) * inner, ps + (o * ns + src_start) * inner, bytes);
  });
}

/// x's positions [start, start + length) along `dim`, copied out: narrow's forward, and the first
/// order backward of narrow_backward.
template <class T>
BasicTensor<T> take_along(const BasicTensor<T>& x, int dim, std::int64_t start, std::int64_t length) {
  BasicTensor<T> part(x.shape().with(dim, length));
  copy_along(x, start, part, 0, dim, length);
  return part;
}

/// part placed at [start, start + part.size(dim)) along `dim` of a zero tensor of `shape`:
/// narrow_backward's forward, and the first order backward of narrow.
template <class T>
BasicTensor<T> place_along(const BasicTensor<T>& part, const Shape& shape, int dim, std::int64_t start) {
  BasicTensor<T> out(shape);
  const std::int64_t outer = shape.outer(dim), inner = shape.inner(dim), n = shape[dim];
  const std::int64_t length = part.shape()[dim], end = start + length;
  const T* pp = part.data();
  T* po = out.data();
  // Row by row: zeros before the part, the part, zeros after (each element written once).
  for_outer(outer, n * inner, [=](std::int64_t o0, std::int64_t o1) {
    for (std::int64_t o = o0; o < o1; ++o) {
      T* row = po + o * n * inner;
      std::fill(row, row + start * inner, T(0));
      std::copy(pp + o * length * inner, pp + (o + 1) * length * inner, row + start * inner);
      std::fill(row + end * inner, row + n * inner, T(0));
    }
  });
  return out;
}

/// sum's positions [start, start + part.size(dim)) along `dim` += part: place_along(part, ...)
/// added into sum without the zeros.
template <class T>
void add_along(const BasicTensor<T>& part, BasicTensor<T>& sum, int dim, std::int64_t start) {
  const std::int64_t outer = sum.shape().outer(dim), inner = sum.shape().inner(dim), n = sum.shape()[dim];
  const std::int64_t block = part.shape()[dim] * inner;
  const T* pp = part.data();
  T* ps = sum.data();
  for_outer(outer, block, [=](std::int64_t o0, std::int64_t o1) {
    for (std::int64_t o = o0; o < o1; ++o)
      ArrayMap<T>(ps + (o * n + start) * inner, block) += ConstArrayMap<T>(pp + o * block, block);
  });
}

}  // namespace detail

template <class T>
BasicTensor<T> narrow(const BasicTensor<T>& x, std::int64_t dim, std::int64_t start, std::int64_t length);

namespace op {
/// The id of narrow's backward as an op of its own (recorded under create_graph): dy placed in a
/// zero tensor of the input's shape.
inline const OpId narrow_backward = register_op("narrow_backward", tangent_rule);
}  // namespace op

namespace detail {
/// dy placed at [start, start + dy.size(dim)) along `dim` of a zero tensor of `shape`: narrow's
/// backward as an op, for a backward recorded under create_graph. It is linear in dy and its own
/// backward is narrow, whose backward is this again, so any order is recorded.
template <class T>
BasicTensor<T> narrow_backward(const BasicTensor<T>& dy, const Shape& shape, int d, std::int64_t start) {
  const std::int64_t length = dy.shape()[d];
  BasicTensor<T> dx = produce<T>(op::narrow_backward, shape, static_cast<double>(dy.numel()), {dy},
                                 [=] { return place_along(dy, shape, d, start); });
  if (grad_needed(dy))
    record<T>(op::narrow_backward, {dy}, {&dx}, {}, [d, start, length](BackwardContext<T>& ctx) {
      if (ctx.create_graph()) return ctx.accumulate(0, remat::narrow(ctx.grad_output(), d, start, length));
      ctx.accumulate(0, take_along(ctx.grad_output(), d, start, length));
    });
  push_tangent(dx, [&](const BasicTensor<T>& t) { return narrow_backward(t, shape, d, start); }, dy);
  return dx;
}
}  // namespace detail

/// y = x[..., start : start + length, ...] along `dim`, copied.
/// dx = zeros with dy placed at [start, start + length).  Saves: nothing.
/// Dtype: any element type; bfloat16 directly (it only moves elements: the float32 route's bits).
template <class T>
BasicTensor<T> narrow(const BasicTensor<T>& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  const int d = x.shape().dim(dim, "narrow");
  const std::int64_t n = x.shape()[d];
  if (start < 0) start += n;
  REMAT_CHECK(start >= 0 && length >= 0 && start + length <= n,
              "narrow: range [{}, {}) is outside dim {} of shape {} (size {})", start, start + length, dim,
              x.shape(), n);
  const Shape shape = x.shape().with(d, length);
  BasicTensor<T> y = detail::produce<T>(op::narrow, shape, static_cast<double>(shape.numel()), {x},
                                        [=] { return detail::take_along(x, d, start, length); });
  if (detail::grad_needed(x))
    detail::record<T>(op::narrow, {x}, {&y}, {}, [shape = x.shape(), d, start](detail::BackwardContext<T>& ctx) {
      // Recorded (create_graph), the same copy as an op of its own.
      if (ctx.create_graph()) return ctx.accumulate(0, detail::narrow_backward(ctx.grad_output(), shape, d, start));
      // A split's parts each add their own range: only the first makes the whole gradient.
      const BasicTensor<T>& dy = ctx.grad_output();
      ctx.accumulate_part(
          0, [&] { return detail::place_along(dy, shape, d, start); },
          [&](BasicTensor<T>& sum) { detail::add_along(dy, sum, d, start); });
    });
  detail::push_tangent(y, [&](const BasicTensor<T>& t) { return narrow(t, d, start, length); }, x);
  return y;
}

/// y = x[..., start:end, ...] along `dim` (Python slice bounds: negative counts from the end,
/// out-of-range bounds clamp).
template <class T>
BasicTensor<T> slice(const BasicTensor<T>& x, std::int64_t dim, std::int64_t start, std::int64_t end) {
  const int d = x.shape().dim(dim, "slice");
  const std::int64_t n = x.shape()[d];
  auto clamp = [n](std::int64_t i) { return std::min(n, std::max<std::int64_t>(0, i < 0 ? i + n : i)); };
  const std::int64_t s = clamp(start), e = clamp(end);
  return narrow(x, d, s, std::max<std::int64_t>(0, e - s));
}

}  // namespace remat
