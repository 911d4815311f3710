#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of neg(x) and -x: the elementwise negation.
inline const OpId neg = register_op("neg", tangent_rule);
}  // namespace op


/// y = -x.  dx = -dy.  Saves: nothing.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> neg(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::neg(a); }, x);
  else return detail::unary_saving_nothing(
      op::neg, x, [](const auto& a) { return -a; }, [](const auto& dy) { return -dy; }, detail::same_formula);
}

/// -x (neg).
template <class T>
BasicTensor<T> operator-(const BasicTensor<T>& x) { return neg(x); }

}  // namespace remat
