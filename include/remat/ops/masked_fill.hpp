#pragma once
#include <type_traits>

#include "remat/core/produce.hpp"
#include "remat/ops/detail/broadcast.hpp"
#include "remat/ops/detail/dtype.hpp"

namespace remat {
namespace op {
/// The id of masked_fill(x, mask, value): value where mask is true, else x.
inline const OpId masked_fill = register_op("masked_fill", tangent_rule);
}  // namespace op

namespace detail {

/// out = where(mask, fill, x), mask broadcast to x's shape.
template <class T>
BasicTensor<T> masked_select_fill(const BasicTensor<T>& x, const BoolTensor& mask, T fill) {
  BasicTensor<T> out(x.shape());
  const auto n = padded_sizes(x.shape());
  const auto sm = broadcast_strides(mask.shape(), x.shape());
  const T* px = x.data();
  const bool* pm = mask.data();
  T* po = out.data();
  parallel_for(n[0] * n[1] * n[2], std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(n[3], 1)),
               [&](std::int64_t r0, std::int64_t r1) {
                 for (std::int64_t r = r0; r < r1; ++r) {
                   const std::int64_t i2 = r % n[2], i1 = (r / n[2]) % n[1], i0 = r / (n[2] * n[1]);
                   const bool* row = pm + i0 * sm[0] + i1 * sm[1] + i2 * sm[2];
                   const T* xr = px + r * n[3];
                   T* yr = po + r * n[3];
                   if (sm[3] == 1) {
                     // A mask row as stored (a causal mask's): read as bytes and selected against a
                     // local fill, the compiler vectorises it (as bools, or with fill behind a
                     // reference a store may alias, it branches per element).
                     const auto* m = reinterpret_cast<const unsigned char*>(row);
                     const T f = fill;
                     for (std::int64_t i3 = 0; i3 < n[3]; ++i3) yr[i3] = m[i3] != 0 ? f : xr[i3];
                   } else {
                     for (std::int64_t i3 = 0; i3 < n[3]; ++i3) yr[i3] = row[i3 * sm[3]] ? fill : xr[i3];
                   }
                 }
               });
  return out;
}

}  // namespace detail

/// y = value where mask, else x; mask broadcasts to x's shape (e.g. (T, T) over (B, H, T, T)).
/// dx = dy where not mask, else 0.  Saves: mask.
/// Dtype: any element type; bfloat16 directly, value rounded to nearest even as to<bfloat16> does
/// (it only selects elements: the float32 route's bits).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> masked_fill(const BasicTensor<T>& x, const BoolTensor& mask, S value) {
  REMAT_CHECK(detail::broadcast_shape(x.shape(), mask.shape(), "masked_fill") == x.shape(),
              "masked_fill: mask of shape {} must broadcast to the input's shape {}", mask.shape(), x.shape());
  BasicTensor<T> y = detail::produce<T>(op::masked_fill, x.shape(), static_cast<double>(x.numel()),
                                        {x, mask}, [=] { return detail::masked_select_fill(x, mask, detail::element_of<T>(value)); });
  if (detail::grad_needed(x))
    detail::record<T>(op::masked_fill, {x}, {&y}, {mask}, [](detail::BackwardContext<T>& ctx) {
      if (ctx.create_graph()) return ctx.accumulate(0, masked_fill(ctx.grad_output(), ctx.template saved<bool>(0), 0));
      ctx.accumulate(0, detail::masked_select_fill(ctx.grad_output(), ctx.template saved<bool>(0), T(0)));
    });
  // The filled places are constants: their tangent is zero.
  detail::push_tangent(y, [&](const BasicTensor<T>& t) { return masked_fill(t, mask, 0); }, x);
  return y;
}

/// The (T, T) mask of future positions: true where column > row. For causal attention:
/// masked_fill(scores, causal_mask(T), -inf).
inline BoolTensor causal_mask(std::int64_t t) {
  REMAT_CHECK(t >= 0, "causal_mask: size must be non-negative, got {}", t);
  BoolTensor m(Shape{t, t});
  bool* p = m.data();
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t j = 0; j < t; ++j) p[i * t + j] = j > i;
  return m;
}

}  // namespace remat
