#pragma once
#include <type_traits>

#include "remat/ops/detail/binary.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/neg.hpp"

namespace remat {
namespace op {
/// The id of sub(x, s) and x - s: a scalar subtracted from every element.
inline const OpId sub_scalar = register_op("sub_scalar", tangent_rule);
/// The id of rsub(x, s) and s - x: every element subtracted from a scalar.
inline const OpId rsub_scalar = register_op("rsub_scalar", tangent_rule);
/// The id of sub(a, b) and a - b: the elementwise difference, broadcast.
inline const OpId sub = register_op("sub", tangent_rule);
}  // namespace op


/// z = a - b, numpy broadcasting.  da = sum_to(dz, a.shape), db = -sum_to(dz, b.shape).
/// Saves: nothing.
/// Dtype: mixed element types promote (bfloat16 < float32 < float64) through the differentiable cast;
/// bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> sub(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  if constexpr (detail::routed<A, B>()) return detail::route([](const auto& x, const auto& y) { return remat::sub(x, y); }, a, b);
  else return detail::binary_op(
      op::sub, a, b, [](const auto& x, const auto& y) { return x - y; }, detail::partial_one,
      detail::partial_minus_one);
}

/// y = x - s.  dx = dy.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> sub(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::sub(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_nothing(
        op::sub_scalar, x, [c](const auto& a) { return a - c; }, [](const auto& dy) { return dy; }, detail::same_formula);
  }
}

/// y = s - x.  dx = -dy.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> rsub(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::rsub(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_nothing(
        op::rsub_scalar, x, [c](const auto& a) { return c - a; }, [](const auto& dy) { return -dy; }, detail::same_formula);
  }
}

/// a - b (sub).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> operator-(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  return sub(a, b);
}
/// x - s (sub).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator-(const BasicTensor<T>& x, S s) { return sub(x, s); }
/// s - x (rsub).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator-(S s, const BasicTensor<T>& x) { return rsub(x, s); }

}  // namespace remat
