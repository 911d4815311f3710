#pragma once
#include <cstring>

#include "remat/core/produce.hpp"
#include "remat/ops/detail/dtype.hpp"

namespace remat {
namespace op {
/// The id of embedding(indices, weight): rows of a table picked by integer ids.
inline const OpId embedding = register_op("embedding", tangent_rule);
/// The id of embedding's backward as an op of its own (recorded under create_graph): dy summed
/// into the rows its positions picked.
inline const OpId embedding_backward = register_op("embedding_backward", tangent_rule);
}  // namespace op

template <class T>
BasicTensor<T> embedding(const LongTensor& indices, const BasicTensor<T>& weight);

namespace detail {
/// dweight[v] = Σ over positions holding v of dy[position], a (rows, C) table: embedding's backward.
/// sum_rows_into_table is the kernel; embedding_backward the op, for a backward recorded under
/// create_graph: it is linear in dy, and its own backward is embedding(indices, ·), whose backward
/// is this again, so any order is recorded.
template <class T>
BasicTensor<T> sum_rows_into_table(const BasicTensor<T>& dy, const LongTensor& indices, std::int64_t rows) {
  const std::int64_t c = dy.size(-1);
  BasicTensor<T> out(Shape{rows, c});
  flat(out).setZero();
  const T* pd = dy.data();
  T* pw = out.data();
  const std::int64_t* ids = indices.data();
  for (std::int64_t i = 0; i < indices.numel(); ++i) ArrayMap<T>(pw + ids[i] * c, c) += ConstArrayMap<T>(pd + i * c, c);
  return out;
}

/// out[..., :] = table[indices[...], :]: embedding's kernel.
template <class T>
BasicTensor<T> gather_rows(const LongTensor& indices, const BasicTensor<T>& table) {
  const std::int64_t c = table.size(1);
  std::vector<std::int64_t> s = indices.shape().vec();
  s.push_back(c);
  BasicTensor<T> out{Shape(s)};
  const std::int64_t* ids = indices.data();
  const T* pw = table.data();
  T* py = out.data();
  for (std::int64_t i = 0; i < indices.numel(); ++i)
    std::memcpy(py + i * c, pw + ids[i] * c, static_cast<std::size_t>(c) * sizeof(T));
  return out;
}

template <class T>
BasicTensor<T> embedding_backward(const BasicTensor<T>& dy, const LongTensor& indices, std::int64_t rows) {
  BasicTensor<T> dw = produce<T>(op::embedding_backward, Shape{rows, dy.size(-1)}, static_cast<double>(dy.numel()),
                                 {dy, indices}, [=] { return sum_rows_into_table(dy, indices, rows); });
  if (grad_needed(dy))
    record<T>(op::embedding_backward, {dy}, {&dw}, {indices}, [](BackwardContext<T>& ctx) {
      const LongTensor idx = ctx.template saved<std::int64_t>(0);
      if (ctx.create_graph()) return ctx.accumulate(0, remat::embedding(idx, ctx.grad_output()));
      ctx.accumulate(0, gather_rows(idx, ctx.grad_output()));
    });
  push_tangent(dw, [&](const BasicTensor<T>& t) { return embedding_backward(t, indices, rows); }, dy);  // linear
  return dw;
}
}  // namespace detail


/// y[..., :] = weight[indices[...], :]: rows of a (V, C) table picked by integer ids, giving
/// shape indices.shape + (C,).  dweight[v] = Σ over positions holding v of dy (the op
/// embedding_backward, so a recorded backward is the same computation).  Saves: indices.
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
    BasicTensor<T> y = detail::produce<T>(op::embedding, Shape(s), static_cast<double>(indices.numel() * c),
                                          {indices, weight}, [=] { return detail::gather_rows(indices, weight); });
    if (detail::grad_needed(weight))
      detail::record<T>(op::embedding, {weight}, {&y}, {indices}, [rows = weight.size(0)](detail::BackwardContext<T>& ctx) {
        const LongTensor idx = ctx.template saved<std::int64_t>(0);
        // Recorded (create_graph), the same kernel as an op of its own.
        if (ctx.create_graph()) return ctx.accumulate(0, detail::embedding_backward(ctx.grad_output(), idx, rows));
        ctx.accumulate(0, detail::sum_rows_into_table(ctx.grad_output(), idx, rows));
      });
    detail::push_tangent(y, [&](const BasicTensor<T>& t) { return embedding(indices, t); }, weight);  // linear in the table
    return y;
  }
}

}  // namespace remat
