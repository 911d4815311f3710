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
//
// Two layouts share one kernel: q, k, v as (B, H, T, D) tensors (causal_attention), and the packed
// (B, T, 3C) output of a Transformer's qkv projection read in place, heads taken by stride, with
// the result written straight into (B, T, C) (causal_self_attention): no head split, no permute
// copies either way.
//
// Under autocast (float32 tensors; core/autocast.hpp) both products of each pass take bfloat16
// operands with float32 sums: q, k, v are narrowed once (and saved narrowed: half the bytes), the
// scores, the softmax, its log-sum-exp and the softmax backward stay float32, and the probabilities
// P (forward: P V) and dS (backward: dS K, dSᵀ Q) are narrowed to bfloat16 just before their
// products — what PyTorch's autocast does to the explicit composition, whose softmax runs in float32
// and whose matmuls cast their operands. The output, P V's float32 sums, is rounded to bfloat16
// values as that composition's last matmul rounds it (core/autocast.hpp: round_product_output), so
// both forms hand the next op the same kind of value; its gradient passes through unchanged.
//
// Recorded (create_graph), the backward is the formulas above in tensor ops — the probabilities
// computed again by matmul, masked_fill and softmax from q and k (with their graph), the dropout
// mask applied by the recorded dropout (the same draw) — so a second derivative reaches q, k and v
// through P. Equal to the fused backward to rounding (P comes from softmax, not from the saved
// log-sum-exp), not bit for bit.
//
// Carrying tangents (forward mode, and a backward inside a dual level: hvp), the kernels stay fused:
// the forward's tangent is one more pass per (batch, head) with P rebuilt from the log-sum-exp
// (attention_forward_tangent), and backward computes the first-order kernel's gradients, bit for
// bit, with their tangents beside them (attention_backward_tangents): no (T, T) tensor either way.

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "remat/core/autocast.hpp"
#include "remat/core/gemm.hpp"
#include "remat/core/random.hpp"
#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/detail/dropout_draw.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/exp.hpp"
#include "remat/ops/cat.hpp"
#include "remat/ops/dropout.hpp"
#include "remat/ops/masked_fill.hpp"
#include "remat/ops/matmul.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/narrow.hpp"
#include "remat/ops/permute.hpp"
#include "remat/ops/reshape.hpp"
#include "remat/ops/softmax.hpp"
#include "remat/ops/sub.hpp"
#include "remat/ops/sum.hpp"

namespace remat {
namespace op {
/// The id of causal_attention(q, k, v): fused causal scaled-dot-product attention.
inline const OpId causal_attention = register_op("causal_attention", tangent_rule);
/// The id of causal_self_attention(qkv, n_head): causal attention on a packed q | k | v projection.
inline const OpId causal_self_attention = register_op("causal_self_attention", tangent_rule);
}  // namespace op

namespace detail {

template <class T>
using RowMajorMatrix = Eigen::Matrix<T, -1, -1, Eigen::RowMajor>;

/// A (T, T) matrix as a product's operand in element type E: the matrix itself when E is T, else
/// its bfloat16 copy in `scratch` (the autocast rule: narrowed just before the product).
template <class E, class T>
const E* attention_operand(const RowMajorMatrix<T>& m, RowMajorMatrix<E>& scratch) {
  if constexpr (std::is_same_v<E, T>) {
    return m.data();
  } else {
    scratch.resize(m.rows(), m.cols());
    narrow_to_bfloat16(m.data(), scratch.data(), m.size());  // per (batch, head): already on a thread
    return scratch.data();
  }
}

/// Where each (batch, head)'s rows live: q, k, v (and their gradients) at in_offset(bh) from their
/// base pointers, rows ld_in apart; y and dy at out_offset(bh), rows ld_out apart.
struct AttentionLayout {
  std::int64_t batch, heads, t, d;
  std::int64_t ld_in, in_head_stride, in_batch_stride;     // q, k, v and their gradients
  std::int64_t ld_out, out_head_stride, out_batch_stride;  // y and dy
  std::int64_t in_offset(std::int64_t bh) const { return (bh / heads) * in_batch_stride + (bh % heads) * in_head_stride; }
  std::int64_t out_offset(std::int64_t bh) const { return (bh / heads) * out_batch_stride + (bh % heads) * out_head_stride; }

  /// q, k, v and y as (B, H, T, D) tensors.
  static AttentionLayout separate(std::int64_t B, std::int64_t H, std::int64_t t, std::int64_t d) {
    return {B, H, t, d, d, t * d, H * t * d, d, t * d, H * t * d};
  }
  /// q | k | v side by side in (B, T, 3C) rows, y in (B, T, C) rows, C = H·D.
  static AttentionLayout packed(std::int64_t B, std::int64_t H, std::int64_t t, std::int64_t d) {
    const std::int64_t C = H * d;
    return {B, H, t, d, 3 * C, d, t * 3 * C, C, d, t * C};
  }
};

/// The dropout multipliers of one (batch, head)'s (T, T) probabilities — keep/(1-p) or 0 — drawn
/// exactly as dropout() on the flattened (B, H, T, T) tensor would draw them from `state`: the
/// elements [bh·T², (bh+1)·T²) of that draw, by the generator's element rule. Only the causal part
/// (column ≤ row) is drawn; above the diagonal the probabilities are 0, and so is the mask.
template <class T>
void attention_dropout_mask(Generator::State state, std::int64_t bh, std::int64_t t, float p, T keep_scale,
                            RowMajorMatrix<T>& mask) {
  T* m = mask.data();  // row-major (T, T)
  for (std::int64_t i = 0; i < t; ++i) {
    const auto row_first = static_cast<std::uint64_t>((bh * t + i) * t);
    T* row = m + i * t;
    // Copies, not references, in the loop: a store through `row` could otherwise change them, and
    // the loop would not vectorise.
    for_each_uniform24_run(state, row_first, row_first + static_cast<std::uint64_t>(i + 1),
                           [row, row_first, p, keep_scale](std::uint64_t e, const float* u, std::uint64_t n) {
                             T* piece = row + (e - row_first);
                             for (std::uint64_t j = 0; j < n; ++j) piece[j] = u[j] >= p ? keep_scale : T(0);
                           });
    std::fill(row + i + 1, row + t, T(0));
  }
}

/// Probabilities of one (batch, head): P = softmax(mask(q kᵀ · scale)) row by row, from the saved
/// log-sum-exp when `lse_in` is given, else computing it into `lse_out`.
template <class T, class E>
void attention_probs(const E* q, const E* k, std::int64_t ld, std::int64_t t, std::int64_t d, T scale,
                     RowMajorMatrix<T>& p, const T* lse_in, T* lse_out) {
  gemm(false, true, t, t, d, q, ld, k, ld, p.data(), t);  // q kᵀ, k read transposed in place
  for (std::int64_t i = 0; i < t; ++i) {
    auto row = p.row(i).array();
    row.head(i + 1) *= scale;
    T lse;
    if (lse_in) {
      lse = lse_in[i];
    } else {
      const T m = row.head(i + 1).maxCoeff();
      lse = m + std::log(exp_or_zero(row.head(i + 1) - m).sum());
      lse_out[i] = lse;
    }
    row.head(i + 1) = exp_or_zero(row.head(i + 1) - lse);
    row.tail(t - i - 1).setZero();
  }
}

/// Forward of every (batch, head): y and the log-sum-exp per query row (B·H·T of them), q, k, v
/// in the products' element type E (T, or bfloat16 under autocast).
template <class T, class E>
void attention_forward(const AttentionLayout& L, const E* q, const E* k, const E* v, T* y, T* lse, T scale, float p,
                       T keep_scale, Generator::State rng) {
  const std::int64_t t = L.t, d = L.d;
  parallel_for(L.batch * L.heads, 1, [&](std::int64_t b0, std::int64_t b1) {
    RowMajorMatrix<T> probs(t, t), mask;
    RowMajorMatrix<E> narrowed;  // the probabilities as P V reads them, under autocast
    if (p > 0) mask.resize(t, t);
    for (std::int64_t bh = b0; bh < b1; ++bh) {
      const std::int64_t in = L.in_offset(bh);
      attention_probs(q + in, k + in, L.ld_in, t, d, scale, probs, static_cast<const T*>(nullptr), lse + bh * t);
      if (p > 0) {
        attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
        probs.array() *= mask.array();
      }
      gemm(false, false, t, d, t, attention_operand(probs, narrowed), t, v + in, L.ld_in, y + L.out_offset(bh), L.ld_out);
    }
  });
}

/// Backward of every (batch, head) from dy: dq, dk, dv laid out as q, k, v; q, k, v and dy in the
/// products' element type E.
template <class T, class E>
void attention_backward(const AttentionLayout& L, const E* q, const E* k, const E* v, const T* lse, const E* dy, T* dq,
                        T* dk, T* dv, T scale, float p, T keep_scale, Generator::State rng) {
  const std::int64_t t = L.t, d = L.d;
  parallel_for(L.batch * L.heads, 1, [&](std::int64_t b0, std::int64_t b1) {
    RowMajorMatrix<T> probs(t, t), dp(t, t), mask;
    RowMajorMatrix<E> narrowed;  // Pd, then dS, as their products read them, under autocast
    if (p > 0) mask.resize(t, t);
    for (std::int64_t bh = b0; bh < b1; ++bh) {
      const std::int64_t in = L.in_offset(bh);
      attention_probs(q + in, k + in, L.ld_in, t, d, scale, probs, lse + bh * t, static_cast<T*>(nullptr));
      const E* dY = dy + L.out_offset(bh);
      const std::int64_t ld = L.ld_in, ldo = L.ld_out;
      gemm(false, true, t, t, d, dY, ldo, v + in, ld, dp.data(), t);  // dY Vᵀ
      const RowMajorMatrix<T>* pd = &probs;  // Pd: the probabilities as dropout left them
      if (p > 0) {
        attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
        dp.array() *= mask.array();  // dP = M ⊙ (dY Vᵀ); above the diagonal P is 0 anyway
        mask.array() *= probs.array();
        pd = &mask;
      }
      gemm(true, false, t, d, t, attention_operand(*pd, narrowed), t, dY, ldo, dv + in, ld);  // dV = Pdᵀ dY
      const Eigen::Array<T, -1, 1> rowdot = (dp.array() * probs.array()).rowwise().sum();
      dp.array() = probs.array() * (dp.array().colwise() - rowdot);
      dp *= scale;
      const E* ds = attention_operand(dp, narrowed);
      gemm(false, false, t, d, t, ds, t, k + in, ld, dq + in, ld);  // dQ = dS K
      gemm(true, false, t, d, t, ds, t, q + in, ld, dk + in, ld);   // dK = dSᵀ Q
    }
  });
}

/// The tangents an attention's kernels read, each laid out as the tensor it belongs to (q, k, v as
/// the inputs; dy, backward's incoming gradient, as y), null where there is none.
template <class T>
struct AttentionTangentsIn {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const T* dy = nullptr;
};

/// The probabilities' tangent of one (batch, head) from q's and k's tangents (either may be null):
/// tS = (tq kᵀ + q tkᵀ) scale, then tP = P ⊙ (tS − rowsum(tS ⊙ P)) (the softmax's tangent,
/// softmax.hpp) in `tp`; masked places have P = 0, so their tS drops out. False (tp untouched) when
/// neither has a tangent.
template <class T>
bool attention_probs_tangent(const T* q, const T* k, const T* tq, const T* tk, std::int64_t ld, std::int64_t t,
                             std::int64_t d, T scale, const RowMajorMatrix<T>& probs, RowMajorMatrix<T>& tp) {
  if (!tq && !tk) return false;
  if (tq) gemm(false, true, t, t, d, tq, ld, k, ld, tp.data(), t);
  if (tk) gemm(false, true, t, t, d, q, ld, tk, ld, tp.data(), t, tq != nullptr);
  tp *= scale;
  const Eigen::Array<T, -1, 1> dot = (tp.array() * probs.array()).rowwise().sum();
  tp.array() = probs.array() * (tp.array().colwise() - dot);
  return true;
}

/// Zeros a (t, d) block whose rows are ld apart (a tangent no term reaches).
template <class T>
void zero_rows(T* base, std::int64_t t, std::int64_t d, std::int64_t ld) {
  for (std::int64_t i = 0; i < t; ++i) std::fill(base + i * ld, base + i * ld + d, T(0));
}

/// The output's tangent of every (batch, head) (forward mode), P rebuilt from the forward's
/// log-sum-exp as backward rebuilds it: ty = (M ⊙ tP) v + (M ⊙ P) tv, the same dropout draw; ty is
/// laid out as y and written whole.
template <class T>
void attention_forward_tangent(const AttentionLayout& L, const T* q, const T* k, const T* v, const T* lse,
                               const AttentionTangentsIn<T>& tangents, T* ty, T scale, float p, T keep_scale,
                               Generator::State rng) {
  const std::int64_t t = L.t, d = L.d;
  parallel_for(L.batch * L.heads, 1, [&](std::int64_t b0, std::int64_t b1) {
    RowMajorMatrix<T> probs(t, t), tp(t, t), mask;
    if (p > 0) mask.resize(t, t);
    for (std::int64_t bh = b0; bh < b1; ++bh) {
      const std::int64_t in = L.in_offset(bh), ld = L.ld_in;
      const auto at = [in](const T* base) { return base ? base + in : nullptr; };
      T* out = ty + L.out_offset(bh);
      attention_probs(q + in, k + in, ld, t, d, scale, probs, lse + bh * t, static_cast<T*>(nullptr));
      if (p > 0) attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
      const bool through_probs = attention_probs_tangent(q + in, k + in, at(tangents.q), at(tangents.k), ld, t, d,
                                                         scale, probs, tp);
      if (through_probs) {
        if (p > 0) tp.array() *= mask.array();
        gemm(false, false, t, d, t, tp.data(), t, v + in, ld, out, L.ld_out);
      }
      if (tangents.v) {
        if (p > 0) probs.array() *= mask.array();
        gemm(false, false, t, d, t, probs.data(), t, tangents.v + in, ld, out, L.ld_out, through_probs);
      } else if (!through_probs) {
        zero_rows(out, t, d, L.ld_out);
      }
    }
  });
}

/// Backward of every (batch, head) carrying tangents (forward-over-reverse): dq, dk, dv as
/// attention_backward computes them (the same operations in the same order: the same bits), and
/// their tangents tdq, tdk, tdv (laid out as q, k, v, written whole). With r = rowsum(dP ⊙ P):
///   t(dP) = M ⊙ (tdY Vᵀ + dY tVᵀ),  tdV = (M ⊙ tP)ᵀ dY + Pdᵀ tdY,
///   tdS = (tP ⊙ (dP − r) + P ⊙ (t(dP) − rowsum(t(dP) ⊙ P + dP ⊙ tP))) scale,
///   tdQ = tdS K + dS tK,  tdK = tdSᵀ Q + dSᵀ tQ.
/// One pass per (batch, head): P once, every (T, T) term in this thread's scratch, never a tensor.
template <class T>
void attention_backward_tangents(const AttentionLayout& L, const T* q, const T* k, const T* v, const T* lse,
                                 const T* dy, const AttentionTangentsIn<T>& tangents, T* dq, T* dk, T* dv, T* tdq,
                                 T* tdk, T* tdv, T scale, float p, T keep_scale, Generator::State rng) {
  const std::int64_t t = L.t, d = L.d;
  parallel_for(L.batch * L.heads, 1, [&](std::int64_t b0, std::int64_t b1) {
    RowMajorMatrix<T> probs(t, t), dp(t, t), tp(t, t), tdp(t, t), mask, pd;
    if (p > 0) mask.resize(t, t), pd.resize(t, t);
    for (std::int64_t bh = b0; bh < b1; ++bh) {
      const std::int64_t in = L.in_offset(bh), ld = L.ld_in, ldo = L.ld_out;
      const auto at = [in](const T* base) { return base ? base + in : nullptr; };
      const T *tq = at(tangents.q), *tk = at(tangents.k), *tv = at(tangents.v);
      const T* dY = dy + L.out_offset(bh);
      const T* tdY = tangents.dy ? tangents.dy + L.out_offset(bh) : nullptr;
      // First order, as attention_backward: dV now, dS once the tangents have read dP.
      attention_probs(q + in, k + in, ld, t, d, scale, probs, lse + bh * t, static_cast<T*>(nullptr));
      gemm(false, true, t, t, d, dY, ldo, v + in, ld, dp.data(), t);  // dY Vᵀ
      const RowMajorMatrix<T>* pdp = &probs;  // Pd
      if (p > 0) {
        attention_dropout_mask(rng, bh, t, p, keep_scale, mask);
        dp.array() *= mask.array();
        pd.array() = mask.array() * probs.array();
        pdp = &pd;
      }
      gemm(true, false, t, d, t, pdp->data(), t, dY, ldo, dv + in, ld);  // dV = Pdᵀ dY

      const bool has_tp = attention_probs_tangent(q + in, k + in, tq, tk, ld, t, d, scale, probs, tp);
      const bool has_tdp = tdY || tv;
      if (tdY) gemm(false, true, t, t, d, tdY, ldo, v + in, ld, tdp.data(), t);
      if (tv) gemm(false, true, t, t, d, dY, ldo, tv, ld, tdp.data(), t, tdY != nullptr);
      if (has_tdp && p > 0) tdp.array() *= mask.array();
      // tdV: Pd's term first, then pd's scratch takes M ⊙ tP.
      if (tdY) gemm(true, false, t, d, t, pdp->data(), t, tdY, ldo, tdv + in, ld);
      if (has_tp) {
        if (p > 0) pd.array() = mask.array() * tp.array();
        gemm(true, false, t, d, t, (p > 0 ? pd : tp).data(), t, dY, ldo, tdv + in, ld, tdY != nullptr);
      }
      if (!tdY && !has_tp) zero_rows(tdv + in, t, d, ld);

      const Eigen::Array<T, -1, 1> rowdot = (dp.array() * probs.array()).rowwise().sum();
      if (has_tp && has_tdp) {
        const Eigen::Array<T, -1, 1> trow = (tdp.array() * probs.array() + dp.array() * tp.array()).rowwise().sum();
        tdp.array() =
            (tp.array() * (dp.array().colwise() - rowdot) + probs.array() * (tdp.array().colwise() - trow)) * scale;
      } else if (has_tp) {
        const Eigen::Array<T, -1, 1> trow = (dp.array() * tp.array()).rowwise().sum();
        tdp.array() = (tp.array() * (dp.array().colwise() - rowdot) - probs.array().colwise() * trow) * scale;
      } else if (has_tdp) {
        const Eigen::Array<T, -1, 1> trow = (tdp.array() * probs.array()).rowwise().sum();
        tdp.array() = probs.array() * (tdp.array().colwise() - trow) * scale;
      }
      dp.array() = probs.array() * (dp.array().colwise() - rowdot);
      dp *= scale;  // dS
      gemm(false, false, t, d, t, dp.data(), t, k + in, ld, dq + in, ld);  // dQ = dS K
      gemm(true, false, t, d, t, dp.data(), t, q + in, ld, dk + in, ld);   // dK = dSᵀ Q

      const bool has_tds = has_tp || has_tdp;
      if (has_tds) gemm(false, false, t, d, t, tdp.data(), t, k + in, ld, tdq + in, ld);
      if (tk) gemm(false, false, t, d, t, dp.data(), t, tk, ld, tdq + in, ld, has_tds);
      if (!has_tds && !tk) zero_rows(tdq + in, t, d, ld);
      if (has_tds) gemm(true, false, t, d, t, tdp.data(), t, q + in, ld, tdk + in, ld);
      if (tq) gemm(true, false, t, d, t, dp.data(), t, tq, ld, tdk + in, ld, has_tds);
      if (!has_tds && !tq) zero_rows(tdk + in, t, d, ld);
    }
  });
}

/// The dropout draw of an attention call over its B·H·T² probabilities: none in evaluation or at p = 0.
template <class T>
DropoutDraw<T> attention_dropout(double dropout_p, bool training, std::int64_t elements, Generator& gen) {
  if (!training || dropout_p == 0.0) return DropoutDraw<T>();
  return DropoutDraw<T>(dropout_p, static_cast<std::uint64_t>(elements), gen);
}

}  // namespace detail

namespace detail {

/// dq, dk, dv of causal attention as recorded ops (create_graph), q, k, v and dy (B, H, T, D) with
/// their graphs: the formulas of the header, P computed again from q and k.
template <class T>
std::array<BasicTensor<T>, 3> attention_backward_recorded(const BasicTensor<T>& q, const BasicTensor<T>& k,
                                                          const BasicTensor<T>& v, const BasicTensor<T>& dy, T scale,
                                                          const DropoutDraw<T>& drop) {
  const BasicTensor<T> scores = masked_fill(matmul(q, k, false, true) * scale, causal_mask(q.size(2)),
                                            -std::numeric_limits<T>::infinity());
  const BasicTensor<T> p = softmax(scores);
  const bool dropping = drop.threshold > 0;
  BasicTensor<T> dp = matmul(dy, v, false, true);  // dY Vᵀ
  if (dropping) dp = apply_dropout(dp, drop);     // dP = M ⊙ dY Vᵀ
  const BasicTensor<T> dv = matmul(dropping ? apply_dropout(p, drop) : p, dy, true, false);  // Pdᵀ dY
  const BasicTensor<T> ds = p * (dp - remat::sum(dp * p, -1, true)) * scale;
  return {matmul(ds, k), matmul(ds, q, true, false), dv};  // dS K, dSᵀ Q
}

/// The tangent of causal attention (forward mode) in ops, for a forward under autocast (whose
/// products the fused tangent pass, attention_forward_tangent, does not reproduce); q, k, v
/// (B, H, T, D) and their tangents (undefined where none). With P = softmax(S), Pd = dropout(P),
/// S = mask(q kᵀ) scale:
///   tS = (tq kᵀ + q tkᵀ) scale,  tP = P ⊙ (tS − rowsum(tS ⊙ P)),  ty = dropout(tP) v + Pd tv,
/// the same draw; masked places have P = 0, so their tS drops out.
template <class T>
BasicTensor<T> attention_tangent(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                 const BasicTensor<T>& tq, const BasicTensor<T>& tk, const BasicTensor<T>& tv, T scale,
                                 const DropoutDraw<T>& drop) {
  const BasicTensor<T> p = softmax(masked_fill(matmul(q, k, false, true) * scale, causal_mask(q.size(2)),
                                               -std::numeric_limits<T>::infinity()));
  const bool dropping = drop.threshold > 0;
  BasicTensor<T> t;
  if (tq.defined() || tk.defined()) {
    const BasicTensor<T> ts = tangent_sum(tq.defined() ? matmul(tq, k, false, true) : BasicTensor<T>(),
                                          tk.defined() ? matmul(q, tk, false, true) : BasicTensor<T>()) * scale;
    BasicTensor<T> tp = p * (ts - remat::sum(ts * p, -1, true));
    if (dropping) tp = apply_dropout(tp, drop);
    t = matmul(tp, v);
  }
  if (tv.defined()) t = tangent_sum(t, matmul(dropping ? apply_dropout(p, drop) : p, tv));
  return t;
}

/// The refusal of a recorded backward through an attention whose forward ran under autocast (its
/// saved q, k, v are bfloat16 copies with no graph).
inline Error attention_autocast_refusal(const char* op) {
  return Error(fmt::format("{}: create_graph through an attention computed under autocast is not available; run the "
                           "forward outside autocast to differentiate it twice", op));
}

/// An attention's work: its two products' flops, and its B·H·t² scores (scaled, masked, softmaxed,
/// dropped out, then dropped), which cost it more than its products at a GPT's head sizes.
inline OpWork attention_work(std::int64_t B, std::int64_t H, std::int64_t t, std::int64_t d) {
  const double scores = static_cast<double>(B * H) * static_cast<double>(t * t);
  return {4.0 * scores * static_cast<double>(d), scores};
}

/// causal_attention over q, k, v as the products read them in element type E (themselves, or
/// their bfloat16 copies under autocast: what the node saves).
template <class T, class E>
BasicTensor<T> causal_attention_with(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                     const BasicTensor<E>& qe, const BasicTensor<E>& ke, const BasicTensor<E>& ve,
                                     const DropoutDraw<T>& drop) {
  const std::int64_t B = q.size(0), H = q.size(1), t = q.size(2), d = q.size(3);
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const auto layout = AttentionLayout::separate(B, H, t, d);

  // The log-sum-exp per row is an output too: whoever keeps y keeps what its backward needs.
  // The compute reads (and a memory budget's recompute keeps) q, k, v as the products take them.
  const Shape shape = q.shape();
  auto [y, lse] = produce_all<T, T>(op::causal_attention, {shape, Shape{B, H, t}}, attention_work(B, H, t, d),
                                    {qe, ke, ve}, [=] {
    BasicTensor<T> out_y(shape), out_lse(Shape{B, H, t});
    attention_forward(layout, qe.cdata(), ke.cdata(), ve.cdata(), out_y.data(), out_lse.data(), scale, drop.threshold,
                      drop.scale, drop.at_entry);
    if constexpr (std::is_same_v<E, bfloat16>) round_product_output(out_y);
    return std::make_tuple(out_y, out_lse);
  });

  if (grad_needed(q, k, v))
    record<T>(op::causal_attention, {q, k, v}, {&y}, {qe, ke, ve, lse}, [=](BackwardContext<T>& ctx) {
      const BasicTensor<E> qs = ctx.template saved<E>(0), ks = ctx.template saved<E>(1), vs = ctx.template saved<E>(2);
      if (ctx.create_graph()) {
        if constexpr (std::is_same_v<E, T>) {
          if (session().tangent_walk) {
            // Carrying tangents (hvp): the first-order kernel's gradients with their tangents, one pass.
            const BasicTensor<T> tq = tangent_of(ctx.as_input(0, qs)), tk = tangent_of(ctx.as_input(1, ks)),
                                 tv = tangent_of(ctx.as_input(2, vs));
            const BasicTensor<T>& dy = ctx.grad_output();
            const BasicTensor<T> tdy = tangent_of(dy);
            std::array<BasicTensor<T>, 3> grads{BasicTensor<T>(qs.shape()), BasicTensor<T>(qs.shape()),
                                                BasicTensor<T>(qs.shape())};
            if (!tq.defined() && !tk.defined() && !tv.defined() && !tdy.defined()) {
              attention_backward(layout, qs.cdata(), ks.cdata(), vs.cdata(), ctx.saved(3).cdata(), dy.cdata(),
                                 grads[0].data(), grads[1].data(), grads[2].data(), scale, drop.threshold, drop.scale,
                                 drop.at_entry);
            } else {
              std::array<BasicTensor<T>, 3> tgrads{BasicTensor<T>(qs.shape()), BasicTensor<T>(qs.shape()),
                                                   BasicTensor<T>(qs.shape())};
              const auto ptr = [](const BasicTensor<T>& x) { return x.defined() ? x.cdata() : nullptr; };
              attention_backward_tangents(layout, qs.cdata(), ks.cdata(), vs.cdata(), ctx.saved(3).cdata(), dy.cdata(),
                                          {ptr(tq), ptr(tk), ptr(tv), ptr(tdy)}, grads[0].data(), grads[1].data(),
                                          grads[2].data(), tgrads[0].data(), tgrads[1].data(), tgrads[2].data(), scale,
                                          drop.threshold, drop.scale, drop.at_entry);
              for (std::size_t i = 0; i < 3; ++i) set_tangent(grads[i], std::move(tgrads[i]));
            }
            for (std::size_t i = 0; i < 3; ++i)
              if (ctx.needs_grad(i)) ctx.accumulate(i, std::move(grads[i]));
            return;
          }
          const auto grads = attention_backward_recorded(ctx.as_input(0, qs), ctx.as_input(1, ks), ctx.as_input(2, vs),
                                                         ctx.grad_output(), scale, drop);
          for (std::size_t i = 0; i < 3; ++i)
            if (ctx.needs_grad(i)) ctx.accumulate(i, grads[i]);
          return;
        } else {
          throw attention_autocast_refusal("causal_attention");
        }
      }
      const BasicTensor<T> ls = ctx.saved(3);
      const BasicTensor<E> dy = as_operand<E>(ctx.grad_output());
      BasicTensor<T> dq(qs.shape()), dk(qs.shape()), dv(qs.shape());
      attention_backward(layout, qs.cdata(), ks.cdata(), vs.cdata(), ls.cdata(), dy.cdata(), dq.data(), dk.data(),
                         dv.data(), scale, drop.threshold, drop.scale, drop.at_entry);
      ctx.accumulate(0, std::move(dq));
      ctx.accumulate(1, std::move(dk));
      ctx.accumulate(2, std::move(dv));
    });
  // The tangent: one pass with the forward's log-sum-exp; under autocast, the composition in float32.
  const BasicTensor<T> row_lse = lse;
  push_tangent(y, [&](const BasicTensor<T>& tq, const BasicTensor<T>& tk, const BasicTensor<T>& tv) {
    if constexpr (std::is_same_v<E, T>) {
      BasicTensor<T> ty(shape);
      const auto ptr = [](const BasicTensor<T>& x) { return x.defined() ? x.cdata() : nullptr; };
      attention_forward_tangent(layout, q.cdata(), k.cdata(), v.cdata(), row_lse.cdata(), {ptr(tq), ptr(tk), ptr(tv)},
                                ty.data(), scale, drop.threshold, drop.scale, drop.at_entry);
      return ty;
    } else {
      return attention_tangent(q, k, v, tq, tk, tv, scale, drop);
    }
  }, q, k, v);
  return y;
}

/// causal_self_attention over the packed projection as the products read it in element type E.
template <class T, class E>
BasicTensor<T> causal_self_attention_with(const BasicTensor<T>& qkv, const BasicTensor<E>& qkve, std::int64_t n_head,
                                          const DropoutDraw<T>& drop) {
  const std::int64_t B = qkv.size(0), t = qkv.size(1), C = qkv.size(2) / 3, H = n_head, d = C / H;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const auto layout = AttentionLayout::packed(B, H, t, d);

  auto [y, lse] = produce_all<T, T>(op::causal_self_attention, {Shape{B, t, C}, Shape{B, H, t}}, attention_work(B, H, t, d),
                                    {qkve}, [=] {
    BasicTensor<T> out_y(Shape{B, t, C}), out_lse(Shape{B, H, t});
    const E* base = qkve.cdata();
    attention_forward(layout, base, base + C, base + 2 * C, out_y.data(), out_lse.data(), scale, drop.threshold,
                      drop.scale, drop.at_entry);
    if constexpr (std::is_same_v<E, bfloat16>) round_product_output(out_y);
    return std::make_tuple(out_y, out_lse);
  });

  if (grad_needed(qkv))
    record<T>(op::causal_self_attention, {qkv}, {&y}, {qkve, lse}, [=](BackwardContext<T>& ctx) {
      const BasicTensor<E> packed = ctx.template saved<E>(0);
      if (ctx.create_graph()) {
        if constexpr (std::is_same_v<E, T>) {
          if (session().tangent_walk) {
            // Carrying tangents (hvp): the first-order kernel's gradient with its tangent, one pass.
            const BasicTensor<T> tx = tangent_of(ctx.as_input(0, packed));
            const BasicTensor<T>& dy = ctx.grad_output();
            const BasicTensor<T> tdy = tangent_of(dy);
            BasicTensor<T> grad(packed.shape());
            const T* base = packed.cdata();
            T* g = grad.data();
            if (!tx.defined() && !tdy.defined()) {
              attention_backward(layout, base, base + C, base + 2 * C, ctx.saved(1).cdata(), dy.cdata(), g, g + C,
                                 g + 2 * C, scale, drop.threshold, drop.scale, drop.at_entry);
            } else {
              BasicTensor<T> tgrad(packed.shape());
              const T* tb = tx.defined() ? tx.cdata() : nullptr;
              T* tg = tgrad.data();
              attention_backward_tangents(layout, base, base + C, base + 2 * C, ctx.saved(1).cdata(), dy.cdata(),
                                          {tb, tb ? tb + C : nullptr, tb ? tb + 2 * C : nullptr,
                                           tdy.defined() ? tdy.cdata() : nullptr},
                                          g, g + C, g + 2 * C, tg, tg + C, tg + 2 * C, scale, drop.threshold,
                                          drop.scale, drop.at_entry);
              set_tangent(grad, std::move(tgrad));
            }
            return ctx.accumulate(0, std::move(grad));
          }
          // The packed layout by views and copies: q, k, v split, heads to (B, H, T, D), and back.
          const BasicTensor<T> x = ctx.as_input(0, packed);
          const auto heads = [&](const BasicTensor<T>& part) {
            return permute(reshape(part, {B, t, H, d}), {0, 2, 1, 3});
          };
          const auto merged = [&](const BasicTensor<T>& g) { return reshape(permute(g, {0, 2, 1, 3}), {B, t, C}); };
          const auto grads = attention_backward_recorded(heads(narrow(x, 2, 0, C)), heads(narrow(x, 2, C, C)),
                                                         heads(narrow(x, 2, 2 * C, C)), heads(ctx.grad_output()), scale,
                                                         drop);
          return ctx.accumulate(0, cat(std::vector<BasicTensor<T>>{merged(grads[0]), merged(grads[1]), merged(grads[2])}, 2));
        } else {
          throw attention_autocast_refusal("causal_self_attention");
        }
      }
      const BasicTensor<T> ls = ctx.saved(1);
      const BasicTensor<E> dy = as_operand<E>(ctx.grad_output());
      BasicTensor<T> grad(packed.shape());  // every element is written: q, k, v of every head
      const E* base = packed.cdata();
      T* g = grad.data();
      attention_backward(layout, base, base + C, base + 2 * C, ls.cdata(), dy.cdata(), g, g + C, g + 2 * C, scale,
                         drop.threshold, drop.scale, drop.at_entry);
      ctx.accumulate(0, std::move(grad));
    });
  // The tangent: one pass on the packed layout with the forward's log-sum-exp; under autocast, the
  // composition in float32 (q, k, v and their tangents split into heads, the heads merged back).
  const BasicTensor<T> row_lse = lse;
  push_tangent(y, [&](const BasicTensor<T>& tqkv) {
    if constexpr (std::is_same_v<E, T>) {
      BasicTensor<T> ty(Shape{B, t, C});
      const T *base = qkv.cdata(), *tb = tqkv.cdata();
      attention_forward_tangent(layout, base, base + C, base + 2 * C, row_lse.cdata(), {tb, tb + C, tb + 2 * C},
                                ty.data(), scale, drop.threshold, drop.scale, drop.at_entry);
      return ty;
    }
    const auto heads = [&](const BasicTensor<T>& x, std::int64_t part) {
      return permute(reshape(narrow(x, 2, part * C, C), {B, t, H, d}), {0, 2, 1, 3});
    };
    const BasicTensor<T> ty = attention_tangent(heads(qkv, 0), heads(qkv, 1), heads(qkv, 2), heads(tqkv, 0),
                                                heads(tqkv, 1), heads(tqkv, 2), scale, drop);
    return reshape(permute(ty, {0, 2, 1, 3}), {B, t, C});
  }, qkv);
  return y;
}

}  // namespace detail

/// y = dropout(softmax(mask(q kᵀ / √D))) v for q, k, v of shape (B, H, T, D), causal mask, dropout
/// probability p in training (drawn from `gen` exactly as dropout() on the (B, H, T, T) tensor).
/// Backward, with P the probabilities, M the dropout mask / (1-p), Pd = M ⊙ P:
///   dV = Pdᵀ dY,  dP = M ⊙ (dY Vᵀ),  dS = P ⊙ (dP − rowsum(dP ⊙ P)),  dQ = dS K / √D,  dK = dSᵀ Q / √D.
/// Saves: q, k, v and one log-sum-exp per query row (B, H, T); never a (T, T) tensor. Under
/// autocast (float32): the four products on bfloat16 operands with float32 sums, q, k, v saved as
/// their bfloat16 copies, the output rounded to bfloat16 values (as matmul's); the softmax and its
/// backward in float32.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> causal_attention(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                double dropout_p = 0.0, bool training = true, Generator& gen = default_generator()) {
  if constexpr (detail::routed<T>())
    return detail::route([&](const auto& a, const auto& b, const auto& c) {
      return remat::causal_attention(a, b, c, dropout_p, training, gen);
    }, q, k, v);
  else {
    REMAT_CHECK(q.dim() == 4 && k.shape() == q.shape() && v.shape() == q.shape(),
                "causal_attention: q, k, v must share one (B, H, T, D) shape, got {}, {}, {}", q.shape(), k.shape(), v.shape());
    REMAT_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "causal_attention: dropout must be in [0, 1), got {}", dropout_p);
    const std::int64_t elements = q.size(0) * q.size(1) * q.size(2) * q.size(2);
    const detail::DropoutDraw<T> drop = detail::attention_dropout<T>(dropout_p, training, elements, gen);
    if constexpr (detail::kAutocasts<T>) {
      if (is_autocast_enabled())
        return detail::causal_attention_with(q, k, v, detail::autocast_operand(q), detail::autocast_operand(k),
                                             detail::autocast_operand(v), drop);
    }
    return detail::causal_attention_with(q, k, v, q, k, v, drop);
  }
}

/// causal_attention on a Transformer's packed projection: qkv (B, T, 3C) holds q | k | v along its
/// last dim, head h of each at columns [h·D, (h+1)·D), D = C / n_head; returns (B, T, C) with the
/// heads side by side. Bitwise what splitting qkv, viewing each part as (B, H, T, D), calling
/// causal_attention and merging the heads back gives, without any of those copies.
/// Saves: qkv (the projection's own output, no copy) and one log-sum-exp per query row (B, H, T).
/// Under autocast (float32): as causal_attention, saving qkv's bfloat16 copy instead.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> causal_self_attention(const BasicTensor<T>& qkv, std::int64_t n_head, double dropout_p = 0.0,
                                     bool training = true, Generator& gen = default_generator()) {
  if constexpr (detail::routed<T>())
    return detail::route([&](const auto& a) { return remat::causal_self_attention(a, n_head, dropout_p, training, gen); },
                         qkv);
  else {
    REMAT_CHECK(qkv.dim() == 3 && n_head > 0 && qkv.size(2) % (3 * n_head) == 0,
                "causal_self_attention: expected qkv (B, T, 3C) with C a multiple of n_head {}, got {}", n_head,
                qkv.shape());
    REMAT_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "causal_self_attention: dropout must be in [0, 1), got {}",
                dropout_p);
    const std::int64_t elements = qkv.size(0) * n_head * qkv.size(1) * qkv.size(1);
    const detail::DropoutDraw<T> drop = detail::attention_dropout<T>(dropout_p, training, elements, gen);
    if constexpr (detail::kAutocasts<T>) {
      if (is_autocast_enabled()) return detail::causal_self_attention_with(qkv, detail::autocast_operand(qkv), n_head, drop);
    }
    return detail::causal_self_attention_with(qkv, qkv, n_head, drop);
  }
}

}  // namespace remat
