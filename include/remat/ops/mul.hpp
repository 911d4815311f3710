#pragma once
#include <type_traits>

#include "remat/ops/detail/binary.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of mul(x, s), x * s and s * x: every element times a scalar.
inline const OpId mul_scalar = register_op("mul_scalar", tangent_rule);
/// The id of mul(a, b) and a * b: the elementwise product, broadcast.
inline const OpId mul = register_op("mul", tangent_rule);
}  // namespace op


/// z = a * b, numpy broadcasting.  da = sum_to(dz * b, a.shape), db = sum_to(dz * a, b.shape).
/// Saves: b if a needs a gradient, a if b does.
/// Dtype: mixed element types promote (bfloat16 < float32 < float64) through the differentiable cast;
/// bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> mul(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  if constexpr (detail::routed<A, B>()) return detail::route([](const auto& x, const auto& y) { return remat::mul(x, y); }, a, b);
  else {
    auto times = [](const auto& x, const auto& y) { return x * y; };
    return detail::binary_op(
        op::mul, a, b, times,
        detail::partial<detail::reads_b>(
            [times](const auto& dz, const auto& v) { return detail::broadcast_apply(dz, v.b, "mul", times); },
            [](const auto& dz, const auto& v) { return mul(dz, v.b); }),
        detail::partial<detail::reads_a>(
            [times](const auto& dz, const auto& v) { return detail::broadcast_apply(dz, v.a, "mul", times); },
            [](const auto& dz, const auto& v) { return mul(dz, v.a); }));
  }
}

/// y = x * s.  dx = dy * s.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> mul(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::mul(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_nothing(
        op::mul_scalar, x, [c](const auto& a) { return a * c; }, [c](const auto& dy) { return dy * c; },
        detail::same_formula);
  }
}

/// a * b (mul).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> operator*(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  return mul(a, b);
}
/// x * s (mul).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator*(const BasicTensor<T>& x, S s) { return mul(x, s); }
/// s * x (mul).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator*(S s, const BasicTensor<T>& x) { return mul(x, s); }

}  // namespace remat
