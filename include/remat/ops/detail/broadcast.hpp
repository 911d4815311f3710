#pragma once
// numpy broadcasting for binary ops: the result shape, an element-wise apply over broadcast
// operands, and the reverse (summing a gradient back down to an operand's shape).

#include <algorithm>
#include <array>

#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/detail/reduce.hpp"

namespace remat::detail {

/// Aligns shapes from the right; sizes must match or be 1 (numpy rules).
inline Shape broadcast_shape(const Shape& a, const Shape& b, const char* op) {
  const int rank = std::max(a.rank(), b.rank());
  std::vector<std::int64_t> out(static_cast<std::size_t>(rank));
  for (int i = 0; i < rank; ++i) {
    const int ia = a.rank() - rank + i, ib = b.rank() - rank + i;
    const std::int64_t sa = ia >= 0 ? a[ia] : 1, sb = ib >= 0 ? b[ib] : 1;
    REMAT_CHECK(sa == sb || sa == 1 || sb == 1,
                "{}: shapes {} and {} cannot be broadcast together (dim {} from the right: {} vs {})",
                op, a, b, rank - i, sa, sb);
    out[static_cast<std::size_t>(i)] = sa == 1 ? sb : sa;
  }
  return Shape(out);
}

/// Strides of `s` seen as a tensor of shape `out` (rank 4, left-padded): 0 on broadcast dims.
inline std::array<std::int64_t, 4> broadcast_strides(const Shape& s, const Shape& out) {
  std::array<std::int64_t, 4> strides{0, 0, 0, 0};
  const int pad = 4 - out.rank();
  for (int i = 0; i < out.rank(); ++i) {
    const int is = s.rank() - out.rank() + i;
    if (is >= 0 && s[is] != 1) strides[static_cast<std::size_t>(pad + i)] = s.stride(is);
  }
  return strides;
}

inline std::array<std::int64_t, 4> padded_sizes(const Shape& s) {
  std::array<std::int64_t, 4> sizes{1, 1, 1, 1};
  for (int i = 0; i < s.rank(); ++i) sizes[static_cast<std::size_t>(4 - s.rank() + i)] = s[i];
  return sizes;
}

/// Whether `small` equals the trailing dims of `big` (after dropping its own leading 1s), so that
/// `big` viewed as rows of small.numel() elements pairs each row with all of `small`.
inline bool is_trailing(const Shape& small, const Shape& big) {
  int lead = 0;
  while (lead < small.rank() && small[lead] == 1) ++lead;
  const int n = small.rank() - lead;
  if (n > big.rank()) return false;
  for (int i = 0; i < n; ++i)
    if (small[lead + i] != big[big.rank() - n + i]) return false;
  return true;
}

/// out = f(a, b) with broadcasting; f takes two Eigen arrays, or an array and a scalar (either
/// side), so one generic lambda (`[](auto x, auto y) { return x * y; }`) serves every path.
template <class T, class F>
BasicTensor<T> broadcast_apply(const BasicTensor<T>& a, const BasicTensor<T>& b, const char* op, F f) {
  const Shape shape = broadcast_shape(a.shape(), b.shape(), op);
  BasicTensor<T> out(shape);
  T* po = out.data();
  const T* pa = a.data();
  const T* pb = b.data();
  const std::int64_t n = out.numel();
  if (a.shape() == b.shape()) {
    parallel_for(n, kElementGrain, [&](std::int64_t s, std::int64_t e) {
      ArrayMap<T>(po + s, e - s) = f(ConstArrayMap<T>(pa + s, e - s), ConstArrayMap<T>(pb + s, e - s));
    });
  } else if (b.numel() == 1 && a.numel() == n) {
    parallel_for(n, kElementGrain, [&](std::int64_t s, std::int64_t e) {
      ArrayMap<T>(po + s, e - s) = f(ConstArrayMap<T>(pa + s, e - s), pb[0]);
    });
  } else if (a.numel() == 1 && b.numel() == n) {
    parallel_for(n, kElementGrain, [&](std::int64_t s, std::int64_t e) {
      ArrayMap<T>(po + s, e - s) = f(pa[0], ConstArrayMap<T>(pb + s, e - s));
    });
  } else if (a.shape() == shape && is_trailing(b.shape(), shape)) {
    const std::int64_t m = b.numel();
    parallel_for(n / m, std::max<std::int64_t>(1, kElementGrain / m), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r)
        ArrayMap<T>(po + r * m, m) = f(ConstArrayMap<T>(pa + r * m, m), ConstArrayMap<T>(pb, m));
    });
  } else if (b.shape() == shape && is_trailing(a.shape(), shape)) {
    const std::int64_t m = a.numel();
    parallel_for(n / m, std::max<std::int64_t>(1, kElementGrain / m), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t r = r0; r < r1; ++r)
        ArrayMap<T>(po + r * m, m) = f(ConstArrayMap<T>(pa, m), ConstArrayMap<T>(pb + r * m, m));
    });
  } else {
    const auto sizes = padded_sizes(shape);
    const auto& n = sizes;
    const auto sa = broadcast_strides(a.shape(), shape), sb = broadcast_strides(b.shape(), shape);
    for (std::int64_t i0 = 0; i0 < n[0]; ++i0)
      for (std::int64_t i1 = 0; i1 < n[1]; ++i1)
        for (std::int64_t i2 = 0; i2 < n[2]; ++i2) {
          const std::int64_t oa = i0 * sa[0] + i1 * sa[1] + i2 * sa[2];
          const std::int64_t ob = i0 * sb[0] + i1 * sb[1] + i2 * sb[2];
          for (std::int64_t i3 = 0; i3 < n[3]; ++i3) *po++ = f(pa[oa + i3 * sa[3]], pb[ob + i3 * sb[3]]);
        }
  }
  return out;
}

/// Sums `g` (of a broadcast result's shape) down to `shape`: the gradient of an operand that was
/// broadcast. Returns `g` itself when no dim was broadcast.
template <class T>
BasicTensor<T> sum_to(const BasicTensor<T>& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  BasicTensor<T> out(shape);
  if (shape.numel() == 1) {
    out.data()[0] = flat(g).sum();
  } else if (is_trailing(shape, g.shape())) {
    const std::int64_t cols = shape.numel();
    const T* pg = g.data();
    column_sums(g.numel() / cols, cols, out.data(), [&](std::int64_t i, T* acc) {
      ArrayMap<T>(acc, cols) += ConstArrayMap<T>(pg + i * cols, cols);
    });
  } else {
    flat(out).setZero();
    const auto n = padded_sizes(g.shape());
    const auto so = broadcast_strides(shape, g.shape());
    const T* pg = g.data();
    T* po = out.data();
    for (std::int64_t i0 = 0; i0 < n[0]; ++i0)
      for (std::int64_t i1 = 0; i1 < n[1]; ++i1)
        for (std::int64_t i2 = 0; i2 < n[2]; ++i2) {
          const std::int64_t oo = i0 * so[0] + i1 * so[1] + i2 * so[2];
          for (std::int64_t i3 = 0; i3 < n[3]; ++i3) po[oo + i3 * so[3]] += *pg++;
        }
  }
  return out;
}

}  // namespace remat::detail
