#pragma once
#include <type_traits>

#include "remat/core/produce.hpp"
#include "remat/ops/detail/broadcast.hpp"
#include "remat/ops/detail/unary.hpp"

namespace remat {
namespace op {
/// The id of mul(x, s), x * s and s * x: every element times a scalar.
inline const OpId mul_scalar = register_op("mul_scalar");
/// The id of mul(a, b) and a * b: the elementwise product, broadcast.
inline const OpId mul = register_op("mul");
}  // namespace op


/// z = a * b, numpy broadcasting.  da = sum_to(dz * b, a.shape), db = sum_to(dz * a, b.shape).
/// Saves: b if a needs a gradient, a if b does.
template <class T>
BasicTensor<T> mul(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  auto times = [](const auto& x, const auto& y) { return x * y; };
  const Shape shape = detail::broadcast_shape(a.shape(), b.shape(), "mul");
  BasicTensor<T> z = detail::produce<T>(op::mul, shape, static_cast<double>(shape.numel()),
                                        {a, b}, [=] { return detail::broadcast_apply(a, b, "mul", times); });
  if (detail::grad_needed(a, b)) {
    const bool da = a.requires_grad(), db = b.requires_grad();
    std::vector<detail::SavedTensor> saved;
    if (da) saved.emplace_back(b);
    if (db) saved.emplace_back(a);
    detail::record<T>(op::mul, {a, b}, {&z}, std::move(saved),
                      [da, db, sa = a.shape(), sb = b.shape(), times](detail::BackwardContext<T>& ctx) {
                        const BasicTensor<T>& dz = ctx.grad_output();
                        if (da) {
                          const BasicTensor<T> other = ctx.saved(0);
                          ctx.accumulate(0, detail::sum_to(detail::broadcast_apply(dz, other, "mul", times), sa));
                        }
                        if (db) {
                          const BasicTensor<T> other = ctx.saved(da ? 1 : 0);
                          ctx.accumulate(1, detail::sum_to(detail::broadcast_apply(dz, other, "mul", times), sb));
                        }
                      });
  }
  return z;
}

/// y = x * s.  dx = dy * s.  Saves: nothing.
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> mul(const BasicTensor<T>& x, S s) {
  const T c = static_cast<T>(s);
  return detail::unary_saving_nothing(
      op::mul_scalar, x, [c](const auto& a) { return a * c; }, [c](const auto& dy) { return dy * c; });
}

/// a * b (mul).
template <class T>
BasicTensor<T> operator*(const BasicTensor<T>& a, const BasicTensor<T>& b) { return mul(a, b); }
/// x * s (mul).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator*(const BasicTensor<T>& x, S s) { return mul(x, s); }
/// s * x (mul).
template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>
BasicTensor<T> operator*(S s, const BasicTensor<T>& x) { return mul(x, s); }

}  // namespace remat
