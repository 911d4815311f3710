#pragma once
#include <vector>

#include "remat/core/produce.hpp"

namespace remat {
namespace op {
/// The id of reshape(x, sizes) (and view, squeeze, unsqueeze, flatten): a new shape on the same data.
inline const OpId reshape = register_op("reshape", tangent_rule);
}  // namespace op

namespace detail {
/// t's storage under another shape, t's own reference dropped: a buffer nothing else holds stays
/// that way, so a gradient passed on reshaped is adopted by its input, never copied.
template <class T>
BasicTensor<T> with_shape(BasicTensor<T> t, const Shape& shape) {
  std::shared_ptr<Storage> storage = t.storage();
  t = BasicTensor<T>();
  return BasicTensor<T>(std::move(storage), shape);
}
}  // namespace detail

/// y = x with a new shape and the same data (a view: storage is shared). One size may be -1 and
/// is inferred.  dx = dy reshaped back.  Saves: nothing.
/// Dtype: any element type; bfloat16 directly (it only moves elements: the float32 route's bits).
template <class T>
BasicTensor<T> reshape(const BasicTensor<T>& x, std::vector<std::int64_t> sizes) {
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      REMAT_CHECK(infer < 0, "reshape: only one size may be -1, got {} for shape {}", fmt::join(sizes, ", "), x.shape());
      infer = static_cast<int>(i);
    } else {
      REMAT_CHECK(sizes[i] >= 0, "reshape: invalid size {} in [{}]", sizes[i], fmt::join(sizes, ", "));
      REMAT_CHECK(sizes[i] == 0 || known <= Shape::kMaxNumel / sizes[i], "reshape: sizes [{}] describe too many elements",
                  fmt::join(sizes, ", "));
      known *= sizes[i];
    }
  }
  if (infer >= 0) {
    REMAT_CHECK(known > 0 && x.numel() % known == 0,
                "reshape: shape [{}] is invalid for a tensor of shape {} ({} elements)",
                fmt::join(sizes, ", "), x.shape(), x.numel());
    sizes[static_cast<std::size_t>(infer)] = x.numel() / known;
  }
  const Shape shape(sizes);
  REMAT_CHECK(shape.numel() == x.numel(), "reshape: shape {} has {} elements, the tensor of shape {} has {}",
              shape, shape.numel(), x.shape(), x.numel());
  BasicTensor<T> y = detail::produce<T>(op::reshape, shape, 0.0, {x}, [=] { return BasicTensor<T>(x.storage(), shape); });
  if (detail::grad_needed(x))
    detail::record<T>(op::reshape, {x}, {&y}, {}, [in = x.shape()](detail::BackwardContext<T>& ctx) {
      if (ctx.create_graph()) ctx.accumulate(0, reshape(ctx.grad_output(), in.vec()));
      else ctx.accumulate(0, detail::with_shape(ctx.take_grad_output(), in));
    });
  detail::push_tangent(y, [&](const BasicTensor<T>& t) { return reshape(t, shape.vec()); }, x);
  return y;
}

/// Same as reshape (every remat tensor is contiguous, so a view always exists).
template <class T>
BasicTensor<T> view(const BasicTensor<T>& x, std::vector<std::int64_t> sizes) {
  return reshape(x, std::move(sizes));
}

/// Inserts a dim of size 1 at `dim` (which may equal the rank, appending).
template <class T>
BasicTensor<T> unsqueeze(const BasicTensor<T>& x, std::int64_t dim) {
  const std::int64_t r = x.dim() + 1;
  REMAT_CHECK(dim >= -r && dim < r, "unsqueeze: dim {} is out of range for shape {}", dim, x.shape());
  std::vector<std::int64_t> s = x.shape().vec();
  s.insert(s.begin() + (dim < 0 ? dim + r : dim), 1);
  return reshape(x, s);
}

/// Removes `dim`, which must have size 1.
template <class T>
BasicTensor<T> squeeze(const BasicTensor<T>& x, std::int64_t dim) {
  const int d = x.shape().dim(dim, "squeeze");
  REMAT_CHECK(x.shape()[d] == 1, "squeeze: dim {} of shape {} has size {}, not 1", dim, x.shape(), x.shape()[d]);
  return reshape(x, x.shape().without(d).vec());
}

/// Flattens everything into one dim.
template <class T>
BasicTensor<T> flatten(const BasicTensor<T>& x) {
  return reshape(x, {x.numel()});
}

}  // namespace remat
