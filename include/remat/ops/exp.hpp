#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/exp.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"

namespace remat {
namespace op {
/// The id of exp(x): the elementwise exponential.
inline const OpId exp = register_op("exp", tangent_rule);
}  // namespace op


/// y = exp(x) (exactly 0 below the smallest normal: detail/exp.hpp).  dx = dy * y.  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> exp(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::exp(a); }, x);
  else return detail::unary_saving_output(
      op::exp, x, [](const auto& a) { return detail::exp_or_zero(a); }, [](const auto& dy, const auto& y) { return dy * y; },
      detail::same_formula);
}

namespace detail {
/// e^x on Eigen arrays (exp_or_zero, as every op computes it) and on tensors (the op), for
/// formulas written once for both: the two give the same bits.
template <class X>
auto exp_of(const Eigen::ArrayBase<X>& x) {
  return exp_or_zero(x);
}
template <class T>
BasicTensor<T> exp_of(const BasicTensor<T>& x) {
  return remat::exp(x);
}
}  // namespace detail

}  // namespace remat
