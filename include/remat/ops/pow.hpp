#pragma once
#include <type_traits>

#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of pow(x, p): every element to a scalar power.
inline const OpId pow = register_op("pow");
}  // namespace op


/// y = x^p for a scalar exponent p.  dx = dy * p * x^(p-1).  Saves: x.
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> pow(const BasicTensor<T>& x, S exponent) {
  const T p = static_cast<T>(exponent);
  return detail::unary_saving_input(
      op::pow, x, [p](const auto& a) { return a.pow(p); },
      [p](const auto& dy, const auto& v) { return dy * p * v.pow(p - T(1)); });
}

}  // namespace remat
