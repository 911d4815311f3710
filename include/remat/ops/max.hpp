#pragma once
#include "remat/core/factory.hpp"
#include "remat/core/produce.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/reduce.hpp"
#include "remat/ops/mul.hpp"

namespace remat {
namespace op {
/// The id of max(x, dim): the maxima along a dim and their indices.
inline const OpId max_dim = register_op("max_dim", tangent_rule);
}  // namespace op


/// What max(x, dim) returns: the maxima and where they are.
template <class T>
struct MaxResult {
  /// The maxima along the reduced dim.
  BasicTensor<T> values;
  LongTensor indices;  ///< position of the (first) maximum along the reduced dim
};

/// values[o, i] = max_k x[o, k, i], indices = argmax (first on ties, as PyTorch on CPU).
/// dx[o, indices[o, i], i] = dy[o, i], zero elsewhere.  Saves: indices.
/// Dtype: any element type; bfloat16 directly (it only moves elements: the float32 route's bits).
template <class T>
MaxResult<T> max(const BasicTensor<T>& x, std::int64_t dim, bool keepdim = false) {
  const int d = x.shape().dim(dim, "max");
  const std::int64_t outer = x.shape().outer(d), n = x.shape()[d], inner = x.shape().inner(d);
  REMAT_CHECK(n > 0, "max: dim {} of shape {} is empty; a maximum needs at least one element", dim, x.shape());
  const Shape out_shape = detail::reduced_shape(x.shape(), d, keepdim);
  auto [values, indices] = detail::produce_all<T, std::int64_t>(
      op::max_dim, {out_shape, out_shape}, static_cast<double>(x.numel()), {x}, [=] {
        BasicTensor<T> out_values(out_shape);
        LongTensor out_indices(out_shape);
        const T* px = x.data();
        T* pv = out_values.data();
        std::int64_t* pi = out_indices.data();
        for (std::int64_t o = 0; o < outer; ++o)
          for (std::int64_t i = 0; i < inner; ++i) {
            const T* col = px + o * n * inner + i;
            std::int64_t best = 0;
            for (std::int64_t k = 1; k < n; ++k)
              if (col[k * inner] > col[best * inner] ||
                  (col[k * inner] != col[k * inner] && col[best * inner] == col[best * inner]))
                best = k;  // NaN wins, as in PyTorch
            pv[o * inner + i] = col[best * inner];
            pi[o * inner + i] = best;
          }
        return std::make_tuple(out_values, out_indices);
      });
  if (detail::grad_needed(x))
    detail::record<T>(op::max_dim, {x}, {&values}, {indices}, [shape = x.shape(), d](detail::BackwardContext<T>& ctx) {
      const std::int64_t outer = shape.outer(d), n = shape[d], inner = shape.inner(d);
      const LongTensor idx = ctx.template saved<std::int64_t>(0);
      const std::int64_t* pi = idx.data();
      if (ctx.create_graph()) {  // dy spread along the dim, times a constant mask of the maxima
        BasicTensor<T> at_max = zeros<T>(shape);
        for (std::int64_t o = 0; o < outer; ++o)
          for (std::int64_t i = 0; i < inner; ++i) at_max.data()[(o * n + pi[o * inner + i]) * inner + i] = T(1);
        return ctx.accumulate(0, broadcast_to(detail::keep_dim(ctx.grad_output(), shape, d), shape) * at_max);
      }
      const T* pd = ctx.grad_output().data();
      BasicTensor<T> dx(shape);
      detail::flat(dx).setZero();
      T* px = dx.data();
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t i = 0; i < inner; ++i)
          px[(o * n + pi[o * inner + i]) * inner + i] = pd[o * inner + i];
      ctx.accumulate(0, std::move(dx));
    });
  // The tangent at each maximum's position (the indices are constants).
  detail::push_tangent(values, [&, at = indices](const BasicTensor<T>& t) {
    BasicTensor<T> picked(out_shape);
    const std::int64_t* pi = at.data();
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t i = 0; i < inner; ++i) picked.data()[o * inner + i] = t.data()[(o * n + pi[o * inner + i]) * inner + i];
    return picked;
  }, x);
  return {values, indices};
}

}  // namespace remat
