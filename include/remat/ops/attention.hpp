#pragma once
// Causal scaled-dot-product attention as one op: for each (batch, head) the scores, the causal
// mask, the softmax, dropout and the product with v run in one pass, and only q, k, v and a
// log-sum-exp per query row are saved; backward recomputes the probabilities from them (the
// memory-efficient attention of Rabe & Staats and FlashAttention, on the CPU).
//
// Derivation (one (batch, head); Q, K, V of shape (T, D); a = 1/√D; row i sees keys j ≤ i):
//   S = a Q Kᵀ (masked: S_ij = −∞ for j > i),  ℓ_i = log Σ_{j≤i} e^{S_ij},  P_ij = e^{S_ij − ℓ_i}
//   M = dropout multipliers (keep/(1−p) or 0),  Pd = M ⊙ P,  Y = Pd V.
// Backward, from dY:
//   dV = Pdᵀ dY                                  (Y is linear in V)
//   dPd = dY Vᵀ,  dP = M ⊙ dPd                   (dropout is a fixed elementwise mask)
//   dS_ij = P_ij (dP_ij − Σ_k dP_ik P_ik)        (the softmax backward, row by row; see softmax.hpp)
//   dQ = a dS K,  dK = a dSᵀ Q.
// Why the log-sum-exp is enough: P_ij = exp(S_ij − ℓ_i) is exact given ℓ_i, and S is one GEMM
// away from the saved Q and K, so the (T, T) matrix P never has to be kept — B·H·T floats instead
// of B·H·T². M is regenerated from the generator state at entry by the element rule of
// core/random.hpp, drawing exactly what dropout() on the (B, H, T, T) probabilities would draw.

#include <array>
#include <cmath>
#include <limits>

#include "remat/core/random.hpp"
#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"

namespace remat {
namespace op {
inline const OpId causal_attention = register_op("causal_attention");
}  // namespace op

namespace detail {

/// The dropout multipliers of one (batch, head)'s (T, T) probabilities — keep/(1-p) or 0 — drawn
/// exactly as dropout() on the flattened (B, H, T, T) tensor would draw them from `state`: the
/// elements [bh·T², (bh+1)·T²) of that draw, by the generator's element rule.
template <class T>
void attention_dropout_mask(Generator::State state, std::int64_t bh, std::int64_t t, float p, T keep_scale,
                            Eigen::Matrix<T, -1, -1, Eigen::RowMajor>& mask) {
  const auto first = static_cast<std::uint64_t>(bh * t * t), last = first + static_cast<std::uint64_t>(t * t);
  T* m = mask.data();  // row-major (T, T): element i of the draw is entry i - first
  // Copies, not references, in the loop: a store through `piece` could otherwise change them,
  // and the loop would not vectorise.
  for_each_uniform24_run(state, first, last, [m, first, p, keep_scale](std::uint64_t i, const float* u, std::uint64_t n) {
    T* piece = m + (i - first);
    for (std::uint64_t j = 0; j < n; ++j) piece[j] = u[j] >= p ? keep_scale : T(0);
  });
}

/// Probabilities of one (batch, head): P = softmax(mask(q kᵀ · scale)) row by row, from the saved
/// log-sum-exp when `lse_in` is given, else computing it into `lse_out`.
template <class T>
void attention_probs(const T* q, const T* k, std::int64_t t, std::int64_t d, T scale, Eigen::Matrix<T, -1, -1, Eigen::RowMajor>& p,
                     const T* lse_in, T* lse_out) {
  p.noalias() = ConstMatrixMap<T>(q, t, d) * ConstMatrixMap<T>(k, t, d).transpose();
  for (std::int64_t i = 0; i < t; ++i) {
    auto row = p.row(i).array();
    row.head(i + 1) *= scale;
    T lse;
    if (lse_in) {
      lse = lse_in[i];
    } else {
      const T m = row.head(i + 1).maxCoeff();
      lse = m + std::log((row.head(i + 1) - m).exp().sum());
      lse_out[i] = lse;
    }
    row.head(i + 1) = (row.head(i + 1) - lse).exp();
    row.tail(t - i - 1).setZero();
  }
}

}  // namespace detail

/// y = dropout(softmax(mask(q kᵀ / √D))) v for q, k, v of shape (B, H, T, D), causal mask, dropout
/// probability p in training (drawn from `gen` exactly as dropout() on the (B, H, T, T) tensor).
/// Backward, with P the probabilities, M the dropout mask / (1-p), Pd = M ⊙ P:
///   dV = Pdᵀ dY,  dP = M ⊙ (dY Vᵀ),  dS = P ⊙ (dP − rowsum(dP ⊙ P)),  dQ = dS K / √D,  dK = dSᵀ Q / √D.
/// Saves: q, k, v and one log-sum-exp per query row (B, H, T); never a (T, T) tensor.
template <class T>
BasicTensor<T> causal_attention(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                double dropout_p = 0.0, bool training = true, Generator& gen = default_generator()) {
  REMAT_CHECK(q.dim() == 4 && k.shape() == q.shape() && v.shape() == q.shape(),
              "causal_attention: q, k, v must share one (B, H, T, D) shape, got {}, {}, {}", q.shape(), k.shape(), v.shape());
  REMAT_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "causal_attention: dropout must be in [0, 1), got {}", dropout_p);
  const std::int64_t B = q.size(0), H = q.size(1), t = q.size(2), d = q.size(3);
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const float p = training ? static_cast<float>(dropout_p) : 0.0f;
  const T keep_scale = p > 0 ? static_cast<T>(1.0 / (1.0 - dropout_p)) : T(1);  // as dropout() computes it
  const Generator::State rng = gen.state();
  if (p > 0) gen.set_state({rng.seed, rng.offset + detail::uniform24_blocks(static_cast<std::uint64_t>(B * H * t * t))});

  // The log-sum-exp per row is an output too: whoever keeps y keeps what its backward needs.
  const double flops = 4.0 * static_cast<double>(B * H) * static_cast<double>(t * t) * static_cast<double>(d);
  auto [y, lse] = detail::produce_all<T, T>(op::causal_attention, {q.shape(), Shape{B, H, t}}, flops, [&] {
    BasicTensor<T> out_y(q.shape()), out_lse(Shape{B, H, t});
    const T* pq = q.data();
    const T* pk = k.data();
    const T* pv = v.data();
    T* py = out_y.data();
    T* pl = out_lse.data();
    parallel_for(B * H, 1, [&](std::int64_t b0, std::int64_t b1) {
      Eigen::Matrix<T, -1, -1, Eigen::RowMajor> probs(t, t), mask;
      if (p > 0) mask.resize(t, t);
      for (std::int64_t bh = b0; bh < b1; ++bh) {
        const std::int64_t off = bh * t * d;
        detail::attention_probs(pq + off, pk + off, t, d, scale, probs, static_cast<const T*>(nullptr), pl + bh * t);
        if (p > 0) {
          detail::attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
          probs.array() *= mask.array();
        }
        detail::MatrixMap<T>(py + off, t, d).noalias() = probs * detail::ConstMatrixMap<T>(pv + off, t, d);
      }
    });
    return std::make_tuple(out_y, out_lse);
  });

  if (detail::grad_needed(q, k, v))
    detail::record<T>(op::causal_attention, {q, k, v}, {&y}, {q, k, v, lse}, [=](detail::BackwardContext<T>& ctx) {
      const BasicTensor<T> qs = ctx.saved(0), ks = ctx.saved(1), vs = ctx.saved(2), ls = ctx.saved(3);
      const T* dy = ctx.grad_output().data();
      BasicTensor<T> dq(qs.shape()), dk(qs.shape()), dv(qs.shape());
      parallel_for(B * H, 1, [&](std::int64_t b0, std::int64_t b1) {
        Eigen::Matrix<T, -1, -1, Eigen::RowMajor> probs(t, t), dp(t, t), mask;
        if (p > 0) mask.resize(t, t);
        for (std::int64_t bh = b0; bh < b1; ++bh) {
          const std::int64_t off = bh * t * d;
          detail::attention_probs(qs.data() + off, ks.data() + off, t, d, scale, probs, ls.data() + bh * t, static_cast<T*>(nullptr));
          detail::ConstMatrixMap<T> dY(dy + off, t, d), Q(qs.data() + off, t, d), K(ks.data() + off, t, d), V(vs.data() + off, t, d);
          dp.noalias() = dY * V.transpose();
          if (p > 0) {
            detail::attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
            dp.array() *= mask.array();  // dP = M ⊙ (dY Vᵀ); above the diagonal P is 0 anyway
            detail::MatrixMap<T>(dv.data() + off, t, d).noalias() = (mask.array() * probs.array()).matrix().transpose() * dY;
          } else {
            detail::MatrixMap<T>(dv.data() + off, t, d).noalias() = probs.transpose() * dY;
          }
          const Eigen::Array<T, -1, 1> rowdot = (dp.array() * probs.array()).rowwise().sum();
          dp.array() = probs.array() * (dp.array().colwise() - rowdot);
          dp *= scale;
          detail::MatrixMap<T>(dq.data() + off, t, d).noalias() = dp * K;
          detail::MatrixMap<T>(dk.data() + off, t, d).noalias() = dp.transpose() * Q;
        }
      });
      ctx.accumulate(0, std::move(dq));
      ctx.accumulate(1, std::move(dk));
      ctx.accumulate(2, std::move(dv));
    });
  return y;
}

}  // namespace remat
