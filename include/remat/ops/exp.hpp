#pragma once
#include "remat/ops/detail/exp.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of exp(x): the elementwise exponential.
inline const OpId exp = register_op("exp");
}  // namespace op


/// y = exp(x) (exactly 0 below the smallest normal: detail/exp.hpp).  dx = dy * y.  Saves: y.
template <class T>
BasicTensor<T> exp(const BasicTensor<T>& x) {
  return detail::unary_saving_output(
      op::exp, x, [](const auto& a) { return detail::exp_or_zero(a); }, [](const auto& dy, const auto& y) { return dy * y; });
}

}  // namespace remat
