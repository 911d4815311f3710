#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/div.hpp"
#include "remat/ops/mul.hpp"

namespace remat {
namespace op {
/// The id of sqrt(x): the elementwise square root.
inline const OpId sqrt = register_op("sqrt", tangent_rule);
}  // namespace op


/// y = sqrt(x).  dx = dy / (2 y).  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> sqrt(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::sqrt(a); }, x);
  else return detail::unary_saving_output(
      op::sqrt, x, [](const auto& a) { return a.sqrt(); },
      [](const auto& dy, const auto& y) { return dy / (T(2) * y); }, detail::same_formula);
}

}  // namespace remat
