#pragma once
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/masked_fill.hpp"

namespace remat {
namespace op {
/// The id of relu(x): max(x, 0) elementwise.
inline const OpId relu = register_op("relu", tangent_rule);
}  // namespace op

namespace detail {

/// relu's backward, dy where y > 0 and +0 elsewhere (NaN included): on Eigen arrays, or on tensors
/// as a recorded masked_fill making the same selection (create_graph).
template <class D, class Y>
auto relu_grad(const D& dy, const Y& y) {
  using S = typename Y::Scalar;
  return (y > S(0)).select(dy, S(0));
}
template <class T>
BasicTensor<T> relu_grad(const BasicTensor<T>& dy, const BasicTensor<T>& y) {
  BoolTensor off(y.shape());
  const T* py = y.data();
  bool* po = off.data();
  for (std::int64_t i = 0; i < y.numel(); ++i) po[i] = !(py[i] > T(0));
  return masked_fill(dy, off, 0);
}

}  // namespace detail

/// y = max(x, 0).  dx = dy where y > 0, else 0.  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> relu(const BasicTensor<T>& x) {
  if constexpr (detail::routed<T>()) return detail::route([](const auto& a) { return remat::relu(a); }, x);
  else return detail::unary_saving_output(
      op::relu, x, [](const auto& a) { return a.max(T(0)); },
      [](const auto& dy, const auto& y) { return detail::relu_grad(dy, y); }, detail::same_formula);
}

}  // namespace remat
