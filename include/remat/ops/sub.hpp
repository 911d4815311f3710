#pragma once
#include <type_traits>

#include "remat/ops/detail/binary.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of sub(x, s) and x - s: a scalar subtracted from every element.
inline const OpId sub_scalar = register_op("sub_scalar");
/// The id of rsub(x, s) and s - x: every element subtracted from a scalar.
inline const OpId rsub_scalar = register_op("rsub_scalar");
/// The id of sub(a, b) and a - b: the elementwise difference, broadcast.
inline const OpId sub = register_op("sub");
}  // namespace op


/// z = a - b, numpy broadcasting.  da = sum_to(dz, a.shape), db = -sum_to(dz, b.shape).
/// Saves: nothing.
template <class T>
BasicTensor<T> sub(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return detail::binary_op(
      op::sub, a, b, [](const auto& x, const auto& y) { return x - y; }, detail::partial_one,
      detail::partial_minus_one);
}

/// y = x - s.  dx = dy.  Saves: nothing.
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> sub(const BasicTensor<T>& x, S s) {
  const T c = static_cast<T>(s);
  return detail::unary_saving_nothing(
      op::sub_scalar, x, [c](const auto& a) { return a - c; }, [](const auto& dy) { return dy; });
}

/// y = s - x.  dx = -dy.  Saves: nothing.
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> rsub(const BasicTensor<T>& x, S s) {
  const T c = static_cast<T>(s);
  return detail::unary_saving_nothing(
      op::rsub_scalar, x, [c](const auto& a) { return c - a; }, [](const auto& dy) { return -dy; });
}

/// a - b (sub).
template <class T>
BasicTensor<T> operator-(const BasicTensor<T>& a, const BasicTensor<T>& b) { return sub(a, b); }
/// x - s (sub).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator-(const BasicTensor<T>& x, S s) { return sub(x, s); }
/// s - x (rsub).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator-(S s, const BasicTensor<T>& x) { return rsub(x, s); }

}  // namespace remat
