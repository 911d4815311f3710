#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sub.hpp"

namespace remat {
namespace op {
/// The id of sigmoid(x): 1 / (1 + exp(-x)) elementwise.
inline const OpId sigmoid = register_op("sigmoid", tangent_rule);
}  // namespace op


/// y = 1 / (1 + exp(-x)).  dx = dy * y * (1 - y).  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> sigmoid(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::sigmoid(a); }, x);
  else return detail::unary_saving_output(
      op::sigmoid, x, [](const auto& a) { return a.logistic(); },
      [](const auto& dy, const auto& y) { return dy * y * (T(1) - y); }, detail::same_formula);
}

}  // namespace remat
