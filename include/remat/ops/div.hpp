#pragma once
#include <type_traits>

#include "remat/ops/detail/binary.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/neg.hpp"

namespace remat {
namespace op {
/// The id of div(x, s) and x / s: every element divided by a scalar.
inline const OpId div_scalar = register_op("div_scalar", tangent_rule);
/// The id of rdiv(x, s) and s / x: a scalar divided by every element.
inline const OpId rdiv_scalar = register_op("rdiv_scalar", tangent_rule);
/// The id of div(a, b) and a / b: the elementwise quotient, broadcast.
inline const OpId div = register_op("div", tangent_rule);
}  // namespace op


/// z = a / b, numpy broadcasting.  da = sum_to(dz / b, a.shape),
/// db = sum_to(-dz * z / b, b.shape)  (since dz/db = -a/b² = -z/b).
/// Saves: b, and z when b needs a gradient.
/// Dtype: mixed element types promote (bfloat16 < float32 < float64) through the differentiable cast;
/// bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> div(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  if constexpr (detail::routed<A, B>()) return detail::route([](const auto& x, const auto& y) { return remat::div(x, y); }, a, b);
  else {
    auto over = [](const auto& x, const auto& y) { return x / y; };
    return detail::binary_op(
        op::div, a, b, over,
        detail::partial<detail::reads_b>(
            [over](const auto& dz, const auto& v) { return detail::broadcast_apply(dz, v.b, "div", over); },
            [](const auto& dz, const auto& v) { return div(dz, v.b); }),
        detail::partial<detail::reads_b | detail::reads_z>(
            [over](const BasicTensor<A>& dz, const auto& v) {
              BasicTensor<A> g(dz.shape());
              detail::flat(g) = -detail::flat(dz) * detail::flat(v.z);
              return detail::broadcast_apply(g, v.b, "div", over);
            },
            [](const auto& dz, const auto& v) { return div(mul(neg(dz), v.z), v.b); }));
  }
}

/// y = x / s.  dx = dy / s.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> div(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::div(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_nothing(
        op::div_scalar, x, [c](const auto& a) { return a / c; }, [c](const auto& dy) { return dy / c; },
        detail::same_formula);
  }
}

/// y = s / x.  dx = -dy * s / x².  Saves: x.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> rdiv(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::rdiv(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_input(
        op::rdiv_scalar, x, [c](const auto& a) { return c / a; },
        [c](const auto& dy, const auto& v) { return -dy * c / (v * v); }, detail::same_formula);
  }
}

/// a / b (div).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> operator/(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  return div(a, b);
}
/// x / s (div).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator/(const BasicTensor<T>& x, S s) { return div(x, s); }
/// s / x (rdiv).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator/(S s, const BasicTensor<T>& x) { return rdiv(x, s); }

}  // namespace remat
