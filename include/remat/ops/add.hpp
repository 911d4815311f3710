#pragma once
#include <type_traits>

#include "remat/ops/detail/binary.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of add(x, s), x + s and s + x: a scalar added to every element.
inline const OpId add_scalar = register_op("add_scalar", tangent_rule);
/// The id of add(a, b) and a + b: the elementwise sum, broadcast.
inline const OpId add = register_op("add", tangent_rule);
}  // namespace op


/// z = a + b, numpy broadcasting.  da = sum_to(dz, a.shape), db = sum_to(dz, b.shape).
/// Saves: nothing.
/// Dtype: mixed element types promote (bfloat16 < float32 < float64) through the differentiable cast;
/// bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> add(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  if constexpr (detail::routed<A, B>()) return detail::route([](const auto& x, const auto& y) { return remat::add(x, y); }, a, b);
  else return detail::binary_op(
      op::add, a, b, [](const auto& x, const auto& y) { return x + y; }, detail::partial_one, detail::partial_one);
}

/// y = x + s.  dx = dy.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> add(const BasicTensor<T>& x, S s) {
  if constexpr (detail::routed<T>()) return detail::route([s](const auto& a) { return remat::add(a, s); }, x);
  else {
    const T c = static_cast<T>(s);
    return detail::unary_saving_nothing(
        op::add_scalar, x, [c](const auto& a) { return a + c; }, [](const auto& dy) { return dy; }, detail::same_formula);
  }
}

/// a + b (add).
template <class A, class B>
BasicTensor<detail::promote_t<A, B>> operator+(const BasicTensor<A>& a, const BasicTensor<B>& b) {
  return add(a, b);
}
/// x + s (add).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator+(const BasicTensor<T>& x, S s) { return add(x, s); }
/// s + x (add).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator+(S s, const BasicTensor<T>& x) { return add(x, s); }

}  // namespace remat
