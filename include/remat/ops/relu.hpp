#pragma once
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of relu(x): max(x, 0) elementwise.
inline const OpId relu = register_op("relu");
}  // namespace op


/// y = max(x, 0).  dx = dy where y > 0, else 0.  Saves: y.
template <class T>
BasicTensor<T> relu(const BasicTensor<T>& x) {
  return detail::unary_saving_output(
      op::relu, x, [](const auto& a) { return a.max(T(0)); },
      [](const auto& dy, const auto& y) { return (y > T(0)).select(dy, T(0)); });
}

}  // namespace remat
