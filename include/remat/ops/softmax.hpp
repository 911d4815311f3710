#pragma once
// softmax and log_softmax over the last dim.
//
// Derivation (one row x of length C, y = softmax(x), y_i = e^{x_i} / Σ_k e^{x_k}):
//   ∂y_i/∂x_j = y_i (δ_ij − y_j)                      (quotient rule)
//   dx_j = Σ_i dy_i ∂y_i/∂x_j = y_j dy_j − y_j Σ_i dy_i y_i = y_j (dy_j − ⟨dy, y⟩)
// so backward needs only y and one dot product per row: Saves y, never x.
// Shifting x by the row max m changes nothing (the e^{−m} cancels) and keeps exp finite.
//
// log_softmax: z_i = x_i − m − log Σ_k e^{x_k − m}, ∂z_i/∂x_j = δ_ij − y_j with y = e^z, so
//   dx_j = dy_j − y_j Σ_i dy_i = dy_j − e^{z_j} Σ_i dy_i          Saves z (y is recomputed as e^z).

#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/exp.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/exp.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sub.hpp"
#include "remat/ops/sum.hpp"

namespace remat {
namespace op {
/// The id of softmax(x): the softmax over the last dim.
inline const OpId softmax = register_op("softmax", tangent_rule);
/// The id of log_softmax(x): the log of the softmax over the last dim.
inline const OpId log_softmax = register_op("log_softmax", tangent_rule);
}  // namespace op

namespace detail {

inline void check_last_dim(const Shape& s, std::int64_t dim, const char* op) {
  const int d = s.dim(dim, op);
  REMAT_CHECK(d == s.rank() - 1, "{}: only the last dim is supported (dim -1 or {}), got dim {} for shape {}",
              op, s.rank() - 1, dim, s);
}

/// y = softmax(x)'s tangent from x's: the Jacobian diag(y) - y yᵀ is symmetric, so it is the
/// backward's formula applied to the tangent.
template <class T>
void softmax_tangent(const BasicTensor<T>& x, BasicTensor<T>& y) {
  push_tangent(y, [&](const BasicTensor<T>& t) { return y * (t - remat::sum(t * y, -1, true)); }, x);
}

/// Records softmax's node for x -> y (y's values given) and y's tangent: what softmax() records,
/// and what a backward in ops gives saved probabilities (cross_entropy's): a graph back to the
/// logits, or a tangent from theirs.
template <class T>
void record_softmax(const BasicTensor<T>& x, BasicTensor<T>& y) {
  softmax_tangent(x, y);
  if (!grad_needed(x)) return;
  const std::int64_t c = x.size(-1);
  record<T>(op::softmax, {x}, {&y}, {y}, [c](BackwardContext<T>& ctx) {
    const BasicTensor<T> yv = ctx.saved(0);
    if (ctx.create_graph()) {  // the same formula on tensors
      const BasicTensor<T> ys = ctx.as_output(0, yv), dy = ctx.grad_output();
      return ctx.accumulate(0, ys * (dy - remat::sum(dy * ys, -1, true)));
    }
    const T* py = yv.data();
    const T* pd = ctx.grad_output().data();
    BasicTensor<T> dx(yv.shape());
    T* px = dx.data();
    parallel_for(yv.numel() / std::max<std::int64_t>(c, 1), std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                 [&](std::int64_t r0, std::int64_t r1) {
                   for (std::int64_t r = r0; r < r1; ++r) {
                     const ConstArrayMap<T> ys(py + r * c, c), dy(pd + r * c, c);
                     // The dot is summed from a stored product, as sum(dy * y, -1) sums it
                     // (Eigen's reduction order follows the data's alignment): the recorded
                     // form above gives the same bits.
                     ArrayMap<T> out(px + r * c, c);
                     out = dy * ys;
                     const T dot = out.sum();
                     out = ys * (dy - dot);
                   }
                 });
    ctx.accumulate(0, std::move(dx));
  });
}

}  // namespace detail

/// y = exp(x - max) / Σ exp(x - max) over the last dim (shifting by the row max keeps exp finite).
/// dx = y ⊙ (dy - Σ_j dy_j y_j)   (the Jacobian is diag(y) - y yᵀ).  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> softmax(const BasicTensor<T>& x, std::int64_t dim = -1) {
  if constexpr (detail::routed<T>()) return detail::route([dim](const auto& a) { return remat::softmax(a, dim); }, x);
  else {
    detail::check_last_dim(x.shape(), dim, "softmax");
    const std::int64_t c = x.size(-1);
    BasicTensor<T> y = detail::produce<T>(op::softmax, x.shape(), 5.0 * static_cast<double>(x.numel()), {x}, [=] {
      BasicTensor<T> result(x.shape());
      const T* px = x.data();
      T* py = result.data();
      parallel_for(x.numel() / std::max<std::int64_t>(c, 1), std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                   [&](std::int64_t r0, std::int64_t r1) {
                     // Row by row on contiguous maps: Eigen vectorises exp along a row, not across a
                     // block broadcast column-wise (that ran glibc's scalar expf per element).
                     for (std::int64_t r = r0; r < r1; ++r) {
                       const detail::ConstArrayMap<T> in(px + r * c, c);
                       detail::ArrayMap<T> out(py + r * c, c);
                       out = detail::exp_or_zero(in - in.maxCoeff());
                       out /= out.sum();
                     }
                   });
      return result;
    });
    detail::record_softmax(x, y);
    return y;
  }
}

/// y = x - max - log Σ exp(x - max) over the last dim.
/// dx = dy - exp(y) Σ_j dy_j.  Saves: y.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> log_softmax(const BasicTensor<T>& x, std::int64_t dim = -1) {
  if constexpr (detail::routed<T>()) return detail::route([dim](const auto& a) { return remat::log_softmax(a, dim); }, x);
  else {
    detail::check_last_dim(x.shape(), dim, "log_softmax");
    const std::int64_t c = x.size(-1);
    BasicTensor<T> y = detail::produce<T>(op::log_softmax, x.shape(), 5.0 * static_cast<double>(x.numel()), {x}, [=] {
      BasicTensor<T> result(x.shape());
      auto in = detail::rows(x, c);
      auto out = detail::rows(result, c);
      out = in.colwise() - in.rowwise().maxCoeff();
      out.colwise() -= detail::exp_or_zero(out).rowwise().sum().log();
      return result;
    });
    if (detail::grad_needed(x))
      detail::record<T>(op::log_softmax, {x}, {&y}, {y}, [c](detail::BackwardContext<T>& ctx) {
        const BasicTensor<T> yv = ctx.saved(0);
        const BasicTensor<T>& dy = ctx.grad_output();
        if (ctx.create_graph())  // the same formula on tensors
          return ctx.accumulate(0, dy - exp(ctx.as_output(0, yv)) * sum(dy, -1, true));
        // In the steps the recorded form takes, so its bits are these: e^y as the exp op makes it
        // (map_elements: every element on Eigen's vector path), each row's Σ dy as sum(dy, -1) sums it.
        BasicTensor<T> dx(yv.shape());
        detail::map_elements(dx, [](const auto& y) { return detail::exp_or_zero(y); }, yv);
        const T* pd = dy.data();
        T* px = dx.data();
        parallel_for(yv.numel() / std::max<std::int64_t>(c, 1), std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                     [&](std::int64_t r0, std::int64_t r1) {
                       for (std::int64_t r = r0; r < r1; ++r) {
                         const detail::ConstArrayMap<T> dy_row(pd + r * c, c);
                         detail::ArrayMap<T> out(px + r * c, c);
                         out = dy_row - out * dy_row.sum();
                       }
                     });
        ctx.accumulate(0, std::move(dx));
      });
    // ∂z_i/∂x_j = δ_ij − y_j: the tangent is t − ⟨y, t⟩ per row, y = e^z.
    detail::push_tangent(y, [&](const BasicTensor<T>& t) { return t - remat::sum(exp(y) * t, -1, true); }, x);
    return y;
  }
}

}  // namespace remat
