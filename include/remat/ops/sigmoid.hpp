#pragma once
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of sigmoid(x): 1 / (1 + exp(-x)) elementwise.
inline const OpId sigmoid = register_op("sigmoid");
}  // namespace op


/// y = 1 / (1 + exp(-x)).  dx = dy * y * (1 - y).  Saves: y.
template <class T>
BasicTensor<T> sigmoid(const BasicTensor<T>& x) {
  return detail::unary_saving_output(
      op::sigmoid, x, [](const auto& a) { return a.logistic(); },
      [](const auto& dy, const auto& y) { return dy * y * (T(1) - y); });
}

}  // namespace remat
