#pragma once
#include <cstring>

#include "remat/core/produce.hpp"
#include "remat/ops/detail/dtype.hpp"

namespace remat {
namespace op {
/// The id of embedding(indices, weight): rows of a table picked by integer ids.
inline const OpId embedding = register_op("embedding");
}  // namespace op


/// y[..., :] = weight[indices[...], :]: rows of a (V, C) table picked by integer ids, giving
/// shape indices.shape + (C,).  dweight[v] = Σ over positions holding v of dy.  Saves: indices.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> embedding(const LongTensor& indices, const BasicTensor<T>& weight) {
  if constexpr (detail::routed<T>()) return detail::route([&](const auto& a) { return remat::embedding(indices, a); }, weight);
  else {
    REMAT_CHECK(weight.dim() == 2, "embedding: weight must be 2-D (num_embeddings, dim), got shape {}", weight.shape());
    REMAT_CHECK(indices.dim() < Shape::kMaxRank, "embedding: indices of shape {} leave no room for the embedding dim",
                indices.shape());
    const std::int64_t v = weight.size(0), c = weight.size(1);
    const std::int64_t* ids = indices.data();
    for (std::int64_t i = 0; i < indices.numel(); ++i)
      REMAT_CHECK(ids[i] >= 0 && ids[i] < v,
                  "embedding: index {} at flat position {} of indices {} is out of range for a table of {} rows",
                  ids[i], i, indices.shape(), v);
    std::vector<std::int64_t> s = indices.shape().vec();
    s.push_back(c);
    BasicTensor<T> y = detail::produce<T>(op::embedding, Shape(s), static_cast<double>(indices.numel() * c), {indices, weight}, [=] {
      const std::int64_t* ids = indices.data();
      BasicTensor<T> rows{Shape(s)};
      const T* pw = weight.data();
      T* py = rows.data();
      for (std::int64_t i = 0; i < indices.numel(); ++i)
        std::memcpy(py + i * c, pw + ids[i] * c, static_cast<std::size_t>(c) * sizeof(T));
      return rows;
    });
    if (detail::grad_needed(weight))
      detail::record<T>(op::embedding, {weight}, {&y}, {indices}, [wshape = weight.shape()](detail::BackwardContext<T>& ctx) {
        const LongTensor idx = ctx.template saved<std::int64_t>(0);
        const std::int64_t c = wshape[1];
        BasicTensor<T> dw(wshape);
        detail::flat(dw).setZero();
        const T* pd = ctx.grad_output().data();
        T* pw = dw.data();
        const std::int64_t* ids = idx.data();
        for (std::int64_t i = 0; i < idx.numel(); ++i)
          detail::ArrayMap<T>(pw + ids[i] * c, c) += detail::ConstArrayMap<T>(pd + i * c, c);
        ctx.accumulate(0, std::move(dw));
      });
    return y;
  }
}

}  // namespace remat
