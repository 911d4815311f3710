#pragma once
// cross_entropy: log-softmax and the negative log-likelihood fused into one op.
//
// Derivation (one row: logits z of length C, target t, p = softmax(z)):
//   loss_row = −log p_t = −z_t + log Σ_k e^{z_k}
//   ∂loss_row/∂z_j = −δ_jt + e^{z_j} / Σ_k e^{z_k} = p_j − δ_jt
// With the mean over the m rows that are not ignored, dz = dloss · (p − onehot(t)) / m, and 0 on
// ignored rows. Fusing avoids the (N, C) log-probabilities that log_softmax then nll would keep
// and the catastrophic cancellation of log(softmax(z)) when p_t underflows: the forward computes
// log Σ e^{z − max} − (z_t − max) directly.
// Saves: p (the backward is p − onehot, so p is all it needs) and the targets.
//
// Recorded (create_graph), the backward is the same formula in tensor ops, with the saved p given
// softmax's node back to the logits (its values are the forward's, so the bits are the fused
// backward's, and a second derivative reaches the logits through softmax's Jacobian).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/exp.hpp"
#include "remat/ops/div.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/softmax.hpp"
#include "remat/ops/sub.hpp"

namespace remat {
namespace op {
/// The id of cross_entropy(logits, targets): the mean negative log-likelihood under softmax, fused.
inline const OpId cross_entropy = register_op("cross_entropy", tangent_rule);
}  // namespace op


/// Mean negative log-likelihood of integer targets under softmax(logits), fused:
///   loss = -(1/m) Σ_{i: t_i ≠ ignore} log softmax(logits_i)[t_i],  m = number of rows not ignored.
/// logits (N, C) or (B, T, C); targets (N) or (B, T). With every row ignored, loss is NaN (0/0),
/// as in PyTorch.  dlogits_i = dloss (softmax(logits_i) - onehot(t_i)) / m; zero on ignored rows.
/// Saves: softmax(logits) and targets.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> cross_entropy(const BasicTensor<T>& logits, const LongTensor& targets, std::int64_t ignore_index = -100) {
  if constexpr (detail::routed<T>()) return detail::route([&](const auto& a) { return remat::cross_entropy(a, targets, ignore_index); }, logits);
  else {
    REMAT_CHECK(logits.dim() >= 2 && targets.dim() == logits.dim() - 1,
                "cross_entropy: expected logits (..., C) and targets of the same shape without C, got logits {} and "
                "targets {}", logits.shape(), targets.shape());
    REMAT_CHECK(targets.shape() == logits.shape().without(logits.dim() - 1),
                "cross_entropy: targets shape {} does not match logits shape {} without its last dim",
                targets.shape(), logits.shape());
    const std::int64_t c = logits.size(-1), n = targets.numel();
    const std::int64_t* t = targets.data();
    std::int64_t counted = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (t[i] == ignore_index) continue;
      REMAT_CHECK(t[i] >= 0 && t[i] < c,
                  "cross_entropy: target {} at flat position {} is out of range for {} classes (ignore_index is {})",
                  t[i], i, c, ignore_index);
      ++counted;
    }
    auto [loss, probs] = detail::produce_all<T, T>(
        op::cross_entropy, {Shape{}, logits.shape()}, 5.0 * static_cast<double>(logits.numel()), {logits, targets}, [=] {
          const std::int64_t* t = targets.data();
          BasicTensor<T> out_probs(logits.shape());
          const T* pz = logits.data();
          T* pp = out_probs.data();
          // Rows on all threads; each row's loss term kept, then added in row order (the same bits on
          // any thread count).
          std::vector<T> term(static_cast<std::size_t>(n), T(0));
          parallel_for(n, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t i = r0; i < r1; ++i) {
                           const detail::ConstArrayMap<T> z(pz + i * c, c);
                           detail::ArrayMap<T> p(pp + i * c, c);
                           const T top = z.maxCoeff();
                           p = detail::exp_or_zero(z - top);
                           const T norm = p.sum();
                           p /= norm;
                           // -log p = log Σ exp(z - max) - (z_t - max): exact even where p underflows to 0.
                           if (t[i] != ignore_index) term[static_cast<std::size_t>(i)] = std::log(norm) - (z(t[i]) - top);
                         }
                       });
          T total = 0;
          for (std::int64_t i = 0; i < n; ++i)
            if (t[i] != ignore_index) total += term[static_cast<std::size_t>(i)];
          BasicTensor<T> out_loss(Shape{});
          out_loss.data()[0] = counted ? total / static_cast<T>(counted) : std::numeric_limits<T>::quiet_NaN();
          return std::make_tuple(out_loss, out_probs);
        });
    if (detail::grad_needed(logits))
      detail::record<T>(op::cross_entropy, {logits}, {&loss}, {probs, targets},
                        [c, counted, ignore_index](detail::BackwardContext<T>& ctx) {
                          const BasicTensor<T> pv = ctx.saved(0);
                          const LongTensor tv = ctx.template saved<std::int64_t>(1);
                          if (ctx.create_graph()) {
                            BasicTensor<T> p(pv.storage(), pv.shape());
                            detail::record_softmax(ctx.as_input(0, pv), p);
                            // onehot(t) and the kept rows, constants of the targets.
                            BasicTensor<T> onehot = zeros<T>(pv.shape());
                            BasicTensor<T> kept = zeros<T>(pv.shape().with(pv.dim() - 1, 1));
                            for (std::int64_t i = 0; i < tv.numel(); ++i)
                              if (tv.data()[i] != ignore_index) {
                                onehot.data()[i * c + tv.data()[i]] = T(1);
                                kept.data()[i] = T(1);
                              }
                            const BasicTensor<T> scale = ctx.grad_output() / static_cast<T>(counted);
                            return ctx.accumulate(0, (p * scale - onehot * scale) * kept);
                          }
                          const T scale = ctx.grad_output().data()[0] / static_cast<T>(counted);
                          BasicTensor<T> dz(pv.shape());
                          const T* pp = pv.data();
                          T* pg = dz.data();
                          const std::int64_t* t = tv.data();
                          parallel_for(tv.numel(), std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                                       [&](std::int64_t r0, std::int64_t r1) {
                                         for (std::int64_t i = r0; i < r1; ++i) {
                                           detail::ArrayMap<T> g(pg + i * c, c);
                                           if (t[i] == ignore_index) {
                                             g.setZero();
                                             continue;
                                           }
                                           g = detail::ConstArrayMap<T>(pp + i * c, c) * scale;
                                           g(t[i]) -= scale;
                                         }
                                       });
                          ctx.accumulate(0, std::move(dz));
                        });
    // The tangent: the mean over kept rows of ⟨p, t⟩ − t[target] (the gradient's rows against t).
    detail::push_tangent(loss, [&, p = probs](const BasicTensor<T>& tz) {
      const std::int64_t* tt = targets.data();
      T total = 0;
      for (std::int64_t i = 0; i < n; ++i)
        if (tt[i] != ignore_index)
          total += (detail::ConstArrayMap<T>(p.cdata() + i * c, c) * detail::ConstArrayMap<T>(tz.cdata() + i * c, c)).sum() -
                   tz.cdata()[i * c + tt[i]];
      BasicTensor<T> out(Shape{});
      out.data()[0] = counted ? total / static_cast<T>(counted) : std::numeric_limits<T>::quiet_NaN();
      return out;
    }, logits);
    return loss;
  }
}

}  // namespace remat
