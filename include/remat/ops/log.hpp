#pragma once
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of log(x): the elementwise natural logarithm.
inline const OpId log = register_op("log");
}  // namespace op


/// y = log(x).  dx = dy / x.  Saves: x.
template <class T>
BasicTensor<T> log(const BasicTensor<T>& x) {
  return detail::unary_saving_input(
      op::log, x, [](const auto& a) { return a.log(); }, [](const auto& dy, const auto& v) { return dy / v; });
}

}  // namespace remat
