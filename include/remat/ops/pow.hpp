#pragma once
#include <type_traits>

#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/mul.hpp"

namespace remat {
namespace op {
/// The id of pow(x, p): every element to a scalar power.
inline const OpId pow = register_op("pow", tangent_rule);
}  // namespace op


/// y = x^p for a scalar exponent p.  dx = dy * p * x^(p-1).  Saves: x.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> pow(const BasicTensor<T>& x, S exponent) {
  if constexpr (detail::routed<T>()) return detail::route([exponent](const auto& a) { return remat::pow(a, exponent); }, x);
  else {
    const T p = static_cast<T>(exponent);
    return detail::unary_saving_input(
        op::pow, x, [p](const auto& a) { return a.pow(p); },
        [p](const auto& dy, const auto& v) { return dy * p * pow(v, p - T(1)); }, detail::same_formula);
  }
}

}  // namespace remat
