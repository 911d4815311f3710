#pragma once
// The residual join of a Transformer block, x + dropout(h), as one pass over memory: the
// dropped-out branch is never written on its own.

#include "remat/ops/add.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/dropout.hpp"

namespace remat {
namespace op {
/// The id of dropout_add(h, residual, p): residual + dropout(h, p), fused.
inline const OpId dropout_add = register_op("dropout_add", tangent_rule);
}  // namespace op


/// y = residual + dropout(h, p): the mask is drawn from `gen` exactly as dropout() draws it, and
/// every element is the same float sum as residual + dropout(h), so the two are bitwise equal
/// (evaluation or p = 0: residual + h, the add op itself).
/// d residual = dy,  dh = dy ⊙ m / (1 - p).
/// Saves: only the generator state at entry, as dropout.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> dropout_add(const BasicTensor<T>& h, const BasicTensor<T>& residual, double p, bool training = true,
                           Generator& gen = default_generator()) {
  if constexpr (detail::routed<T>()) return detail::route([&](const auto& a, const auto& b) { return remat::dropout_add(a, b, p, training, gen); }, h, residual);
  else {
    REMAT_CHECK(p >= 0.0 && p <= 1.0, "dropout_add: probability must be in [0, 1], got {}", p);
    REMAT_CHECK(h.shape() == residual.shape(),
                "dropout_add: the branch {} and the residual {} must have one shape (no broadcasting)", h.shape(),
                residual.shape());
    if (!training || p == 0.0) return add(residual, h);
    const std::int64_t n = h.numel();
    const detail::DropoutDraw<T> draw(p, static_cast<std::uint64_t>(n), gen);
    const Generator::State at_entry = draw.at_entry;
    const T scale = draw.scale;
    const float threshold = draw.threshold;
    BasicTensor<T> y = detail::produce<T>(op::dropout_add, h.shape(), 2.0 * static_cast<double>(n), {h, residual}, [=] {
      BasicTensor<T> out(h.shape());
      const T* ph = h.cdata();
      const T* pr = residual.cdata();
      T* po = out.data();
      const auto blocks = static_cast<std::int64_t>(detail::uniform24_blocks(static_cast<std::uint64_t>(n)));
      parallel_for(blocks, kDropoutGrain / 4, [&](std::int64_t b0, std::int64_t b1) {
        detail::for_each_uniform24_run(
            at_entry, static_cast<std::uint64_t>(4 * b0), static_cast<std::uint64_t>(std::min(4 * b1, n)),
            [ph, pr, po, threshold, scale](std::uint64_t i, const float* u, std::uint64_t m) {
              for (std::uint64_t j = 0; j < m; ++j) {  // unconditional loads: see apply_dropout_mask
                const T kept = ph[i + j] * scale;
                po[i + j] = pr[i + j] + (u[j] >= threshold ? kept : T(0));
              }
            });
      });
      return out;
    });
    if (detail::grad_needed(h, residual))
      detail::record<T>(op::dropout_add, {h, residual}, {&y}, {},
                        [draw, at_entry, threshold, scale, n](detail::BackwardContext<T>& ctx) {
                          // Taken: the residual's gradient is dy itself, adopted rather than copied.
                          BasicTensor<T> dy = ctx.take_grad_output();
                          if (ctx.create_graph()) {  // the same mask, as a recorded dropout
                            if (ctx.needs_grad(0)) ctx.accumulate(0, detail::apply_dropout(dy, draw));
                            if (ctx.needs_grad(1)) ctx.accumulate(1, dy);
                            return;
                          }
                          if (ctx.needs_grad(0)) {
                            BasicTensor<T> dh(dy.shape());
                            detail::apply_dropout_mask(dy.cdata(), dh.data(), n, threshold, scale, at_entry);
                            ctx.accumulate(0, std::move(dh));
                          }
                          if (ctx.needs_grad(1)) ctx.accumulate(1, std::move(dy));
                        });
    detail::push_tangent(y, [&](const BasicTensor<T>& th, const BasicTensor<T>& tr) {
      return detail::tangent_sum(th.defined() ? detail::apply_dropout(th, draw) : BasicTensor<T>(), tr);
    }, h, residual);
    return y;
  }
}

}  // namespace remat
