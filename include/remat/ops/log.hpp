#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/div.hpp"

namespace remat {
namespace op {
/// The id of log(x): the elementwise natural logarithm.
inline const OpId log = register_op("log", tangent_rule);
}  // namespace op


/// y = log(x).  dx = dy / x.  Saves: x.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> log(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::log(a); }, x);
  else return detail::unary_saving_input(
      op::log, x, [](const auto& a) { return a.log(); }, [](const auto& dy, const auto& v) { return dy / v; },
      detail::same_formula);
}

}  // namespace remat
