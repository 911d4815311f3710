#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sub.hpp"

namespace remat {
namespace op {
/// The id of tanh(x): the elementwise hyperbolic tangent.
inline const OpId tanh = register_op("tanh");
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

}  // namespace remat
