#pragma once
#include <array>
#include <vector>

#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"

namespace remat {
namespace op {
/// The id of permute(x, dims) (and transpose): the dims reordered, copied contiguous.
inline const OpId permute = register_op("permute", tangent_rule);
}  // namespace op

namespace detail {

/// A contiguous copy of x with its dims reordered: out dim i is x dim perm[i].
template <class T>
BasicTensor<T> permuted_copy(const BasicTensor<T>& x, const std::vector<int>& perm) {
  const Shape& s = x.shape();
  const int r = s.rank();
  std::vector<std::int64_t> out_sizes(static_cast<std::size_t>(r));
  std::array<std::int64_t, 4> n{1, 1, 1, 1}, stride{0, 0, 0, 0};  // out-ordered, left-padded
  for (int i = 0; i < r; ++i) {
    out_sizes[static_cast<std::size_t>(i)] = s[perm[static_cast<std::size_t>(i)]];
    n[static_cast<std::size_t>(4 - r + i)] = s[perm[static_cast<std::size_t>(i)]];
    stride[static_cast<std::size_t>(4 - r + i)] = s.stride(perm[static_cast<std::size_t>(i)]);
  }
  BasicTensor<T> out{Shape(out_sizes)};
  const T* px = x.data();
  T* po = out.data();
  // Rows of the output (all dims but the last), split across threads.
  parallel_for(n[0] * n[1] * n[2], std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(n[3], 1)),
               [&](std::int64_t r0, std::int64_t r1) {
                 for (std::int64_t r = r0; r < r1; ++r) {
                   const std::int64_t i2 = r % n[2], i1 = (r / n[2]) % n[1], i0 = r / (n[2] * n[1]);
                   const T* base = px + i0 * stride[0] + i1 * stride[1] + i2 * stride[2];
                   T* row = po + r * n[3];
                   for (std::int64_t i3 = 0; i3 < n[3]; ++i3) row[i3] = base[i3 * stride[3]];
                 }
               });
  return out;
}

}  // namespace detail

/// y = x with dims reordered (y dim i = x dim dims[i]), copied contiguous.
/// dx = dy permuted by the inverse order.  Saves: nothing.
/// Dtype: any element type; bfloat16 directly (it only moves elements: the float32 route's bits).
template <class T>
BasicTensor<T> permute(const BasicTensor<T>& x, const std::vector<std::int64_t>& dims) {
  const int r = x.dim();
  REMAT_CHECK(static_cast<int>(dims.size()) == r, "permute: got {} dims for a tensor of shape {}",
              dims.size(), x.shape());
  std::vector<int> perm(dims.size()), inverse(dims.size(), -1);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    perm[i] = x.shape().dim(dims[i], "permute");
    REMAT_CHECK(inverse[static_cast<std::size_t>(perm[i])] < 0,
                "permute: dim {} appears twice in the order given for shape {}", dims[i], x.shape());
    inverse[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
  }
  std::vector<std::int64_t> sizes;
  for (int p : perm) sizes.push_back(x.shape()[p]);
  BasicTensor<T> y = detail::produce<T>(op::permute, Shape(sizes), static_cast<double>(x.numel()),
                                        {x}, [=] { return detail::permuted_copy(x, perm); });
  if (detail::grad_needed(x))
    detail::record<T>(op::permute, {x}, {&y}, {}, [inverse](detail::BackwardContext<T>& ctx) {
      if (ctx.create_graph())  // the same copy, recorded
        return ctx.accumulate(0, permute(ctx.grad_output(), std::vector<std::int64_t>(inverse.begin(), inverse.end())));
      ctx.accumulate(0, detail::permuted_copy(ctx.grad_output(), inverse));
    });
  detail::push_tangent(y, [&](const BasicTensor<T>& t) { return permute(t, dims); }, x);
  return y;
}

/// Swaps two dims (a permute).
template <class T>
BasicTensor<T> transpose(const BasicTensor<T>& x, std::int64_t dim0, std::int64_t dim1) {
  const int d0 = x.shape().dim(dim0, "transpose"), d1 = x.shape().dim(dim1, "transpose");
  std::vector<std::int64_t> order(static_cast<std::size_t>(x.dim()));
  for (int i = 0; i < x.dim(); ++i) order[static_cast<std::size_t>(i)] = i;
  std::swap(order[static_cast<std::size_t>(d0)], order[static_cast<std::size_t>(d1)]);
  return permute(x, order);
}

}  // namespace remat
