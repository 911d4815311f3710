#pragma once
#include <vector>

#include "remat/core/produce.hpp"
#include "remat/ops/narrow.hpp"

namespace remat {
namespace op {
/// The id of cat(xs, dim): tensors joined along a dim.
inline const OpId cat = register_op("cat", tangent_rule);
}  // namespace op


/// y = the tensors joined along `dim`; all other dims must match.
/// dx_i = dy[..., offset_i : offset_i + n_i, ...].  Saves: nothing.
/// Dtype: any element type; bfloat16 directly (it only moves elements: the float32 route's bits).
/// Mixed element types: convert first (one std::vector holds one type), e.g.
/// cat(std::vector<Tensor>{to<float>(h), x}, d).
template <class T>
BasicTensor<T> cat(const std::vector<BasicTensor<T>>& xs, std::int64_t dim) {
  REMAT_CHECK(!xs.empty(), "cat: needs at least one tensor");
  const Shape& first = xs[0].shape();
  const int d = first.dim(dim, "cat");
  std::int64_t total = 0;
  bool needs_grad = false;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const Shape& s = xs[i].shape();
    REMAT_CHECK(s.rank() == first.rank() && s.with(d, 0) == first.with(d, 0),
                "cat: tensor {} has shape {}, which does not match tensor 0's shape {} outside dim {}", i, s,
                first, dim);
    total += s[d];
    needs_grad = needs_grad || detail::grad_needed(xs[i]);
  }
  std::vector<std::int64_t> offsets;
  std::int64_t at = 0;
  for (const BasicTensor<T>& x : xs) {
    offsets.push_back(at);
    at += x.shape()[d];
  }
  const Shape shape = first.with(d, total);
  BasicTensor<T> y = detail::produce<T>(op::cat, shape, static_cast<double>(shape.numel()), {xs}, [=] {
    BasicTensor<T> joined(shape);
    for (std::size_t i = 0; i < xs.size(); ++i) detail::copy_along(xs[i], 0, joined, offsets[i], d, xs[i].shape()[d]);
    return joined;
  });
  if (needs_grad) {
    std::vector<Shape> shapes;
    for (const BasicTensor<T>& x : xs) shapes.push_back(x.shape());
    detail::record<T>(op::cat, xs, {&y}, {}, [shapes, offsets, d](detail::BackwardContext<T>& ctx) {
      const bool graph = ctx.create_graph();  // each piece by narrow (recorded, it is an op)
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        if (!ctx.needs_grad(i)) continue;
        const std::int64_t length = shapes[i][d];
        ctx.accumulate(i, graph ? narrow(ctx.grad_output(), d, offsets[i], length)
                                : detail::take_along(ctx.grad_output(), d, offsets[i], length));
      }
    });
  }
  // The tangent: the inputs' tangents joined the same way, zeros for an input without one.
  detail::push_tangent_list(y, [&](std::vector<BasicTensor<T>> tangents) {
    for (std::size_t i = 0; i < xs.size(); ++i)
      if (!tangents[i].defined()) {
        tangents[i] = BasicTensor<T>(xs[i].shape());
        detail::flat(tangents[i]).setZero();
      }
    return cat(tangents, d);
  }, xs);
  return y;
}

/// Pieces of `size` along `dim` (the last may be shorter), each a narrow of x.
template <class T>
std::vector<BasicTensor<T>> split(const BasicTensor<T>& x, std::int64_t size, std::int64_t dim) {
  const int d = x.shape().dim(dim, "split");
  REMAT_CHECK(size > 0, "split: piece size must be positive, got {}", size);
  std::vector<BasicTensor<T>> pieces;
  for (std::int64_t start = 0; start < x.shape()[d]; start += size)
    pieces.push_back(narrow(x, d, start, std::min(size, x.shape()[d] - start)));
  return pieces;
}

/// `chunks` pieces of equal size along `dim` (the last may be shorter, as torch.chunk).
template <class T>
std::vector<BasicTensor<T>> chunk(const BasicTensor<T>& x, std::int64_t chunks, std::int64_t dim) {
  const int d = x.shape().dim(dim, "chunk");
  REMAT_CHECK(chunks > 0, "chunk: number of chunks must be positive, got {}", chunks);
  const std::int64_t n = x.shape()[d];
  return split(x, std::max<std::int64_t>(1, (n + chunks - 1) / chunks), d);
}

}  // namespace remat
