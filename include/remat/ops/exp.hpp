#pragma once
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
inline const OpId exp = register_op("exp");
}  // namespace op


/// y = exp(x).  dx = dy * y.  Saves: y.
template <class T>
BasicTensor<T> exp(const BasicTensor<T>& x) {
  return detail::unary_saving_output(
      op::exp, x, [](const auto& a) { return a.exp(); }, [](const auto& dy, const auto& y) { return dy * y; });
}

}  // namespace remat
