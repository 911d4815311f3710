#pragma once
#include <unsupported/Eigen/SpecialFunctions>

#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/exp.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/neg.hpp"

namespace remat {
namespace op {
/// The id of erf(x): the elementwise error function.
inline const OpId erf = register_op("erf", tangent_rule);
}  // namespace op


/// y = erf(x) = 2/√π ∫₀ˣ e^{-t²} dt.  dx = dy * 2/√π e^{-x²}.  Saves: x.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> erf(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::erf(a); }, x);
  else return detail::unary_saving_input(
      op::erf, x, [](const auto& a) { return a.erf(); },
      [](const auto& dy, const auto& a) { return dy * (detail::exp_of(-(a * a)) * T(1.12837916709551257390)); },
      detail::same_formula);
}

namespace detail {
/// erf on Eigen arrays (Eigen's vectorised one) and on tensors (the op), for formulas written once
/// for both (GELU's derivative).
template <class X>
auto erf_of(const Eigen::ArrayBase<X>& x) {
  return x.erf();
}
template <class T>
BasicTensor<T> erf_of(const BasicTensor<T>& x) {
  return remat::erf(x);
}
}  // namespace detail

}  // namespace remat
