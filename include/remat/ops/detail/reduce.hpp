#pragma once
// Dim reductions view a tensor as (outer, n, inner): reducing dim d sums/maxes over n.

#include "remat/core/tensor.hpp"

namespace remat::detail {

inline Shape reduced_shape(const Shape& s, int dim, bool keepdim) {
  return keepdim ? s.with(dim, 1) : s.without(dim);
}

/// out[o, i] = Σ_k x[o, k, i] * scale.
template <class T>
BasicTensor<T> sum_over_dim(const BasicTensor<T>& x, int dim, bool keepdim, T scale) {
  const std::int64_t outer = x.shape().outer(dim), n = x.shape()[dim], inner = x.shape().inner(dim);
  BasicTensor<T> out(reduced_shape(x.shape(), dim, keepdim));
  const T* px = x.data();
  T* po = out.data();
  for (std::int64_t o = 0; o < outer; ++o)
    ArrayMap<T>(po + o * inner, inner) =
        ConstRowArrayMap<T>(px + o * n * inner, n, inner).colwise().sum().transpose() * scale;
  return out;
}

/// The reverse of sum_over_dim: dx[o, k, i] = dy[o, i] * scale for every k.
template <class T>
BasicTensor<T> expand_over_dim(const BasicTensor<T>& dy, const Shape& input_shape, int dim, T scale) {
  const std::int64_t outer = input_shape.outer(dim), n = input_shape[dim], inner = input_shape.inner(dim);
  BasicTensor<T> dx(input_shape);
  const T* pd = dy.data();
  T* px = dx.data();
  for (std::int64_t o = 0; o < outer; ++o)
    RowArrayMap<T>(px + o * n * inner, n, inner).rowwise() =
        ConstArrayMap<T>(pd + o * inner, inner).transpose() * scale;
  return dx;
}

}  // namespace remat::detail
