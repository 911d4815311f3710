#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of relu(x): max(x, 0) elementwise.
inline const OpId relu = register_op("relu");
}  // namespace op


/// y = max(x, 0).  dx = dy where y > 0, else 0.  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> relu(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::relu(a); }, x);
  else return detail::unary_saving_output(
      op::relu, x, [](const auto& a) { return a.max(T(0)); },
      [](const auto& dy, const auto& y) { return (y > T(0)).select(dy, T(0)); });
}

}  // namespace remat
