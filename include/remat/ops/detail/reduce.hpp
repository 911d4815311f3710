#pragma once
// Dim reductions view a tensor as (outer, n, inner): reducing dim d sums/maxes over n.

#include <vector>

#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"

namespace remat::detail {

inline Shape reduced_shape(const Shape& s, int dim, bool keepdim) {
  return keepdim ? s.with(dim, 1) : s.without(dim);
}

/// Rows per block of column_sums: fixed, so its sums do not depend on the thread count.
inline constexpr std::int64_t kColumnSumRows = 64;

/// out[j] = Σ_i row_i[j] over `rows` rows of `cols` values, on all threads and the same bits on
/// any thread count: rows are summed in order within fixed blocks of kColumnSumRows, and the block
/// sums added in block order. `add_row(i, acc)` adds row i into acc (cols values, zeroed first).
/// Bias, norm-weight and broadcast gradients are such sums; run serially they were the serial part
/// of a training step's backward.
template <class T, class AddRow>
void column_sums(std::int64_t rows, std::int64_t cols, T* out, AddRow add_row) {
  const std::int64_t blocks = (rows + kColumnSumRows - 1) / kColumnSumRows;
  auto sum_block = [&](std::int64_t b, T* acc) {
    ArrayMap<T>(acc, cols).setZero();
    for (std::int64_t i = b * kColumnSumRows; i < std::min(rows, (b + 1) * kColumnSumRows); ++i) add_row(i, acc);
  };
  if (blocks <= 1) {
    sum_block(0, out);
    return;
  }
  std::vector<T> partial(static_cast<std::size_t>(blocks * cols));
  const std::int64_t grain = std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(1, kColumnSumRows * cols));
  parallel_for(blocks, grain, [&](std::int64_t b0, std::int64_t b1) {
    for (std::int64_t b = b0; b < b1; ++b) sum_block(b, partial.data() + b * cols);
  });
  ArrayMap<T> total(out, cols);
  total = ConstArrayMap<T>(partial.data(), cols);
  for (std::int64_t b = 1; b < blocks; ++b) total += ConstArrayMap<T>(partial.data() + b * cols, cols);
}

/// out[o, i] = Σ_k x[o, k, i] * scale.
template <class T>
BasicTensor<T> sum_over_dim(const BasicTensor<T>& x, int dim, bool keepdim, T scale) {
  const std::int64_t outer = x.shape().outer(dim), n = x.shape()[dim], inner = x.shape().inner(dim);
  BasicTensor<T> out(reduced_shape(x.shape(), dim, keepdim));
  const T* px = x.data();
  T* po = out.data();
  if (inner == 1) {  // the last dim: each sum is a contiguous run, reduced as softmax's row dots are
    for (std::int64_t o = 0; o < outer; ++o) po[o] = ConstArrayMap<T>(px + o * n, n).sum() * scale;
    return out;
  }
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
