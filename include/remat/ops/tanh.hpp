#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sub.hpp"

namespace remat {
namespace op {
/// The id of tanh(x): the elementwise hyperbolic tangent.
inline const OpId tanh = register_op("tanh", tangent_rule);
}  // namespace op


/// y = tanh(x).  dx = dy * (1 - y²).  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> tanh(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::tanh(a); }, x);
  else return detail::unary_saving_output(
      op::tanh, x, [](const auto& a) { return a.tanh(); },
      [](const auto& dy, const auto& y) { return dy * (T(1) - y * y); }, detail::same_formula);
}

namespace detail {
/// tanh on Eigen arrays and on tensors (the op), for formulas written once for both.
template <class X>
auto tanh_of(const Eigen::ArrayBase<X>& x) {
  return x.tanh();
}
template <class T>
BasicTensor<T> tanh_of(const BasicTensor<T>& x) {
  return remat::tanh(x);
}
}  // namespace detail

}  // namespace remat
