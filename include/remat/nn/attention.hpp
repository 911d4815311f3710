#pragma once
#include <cmath>
#include <limits>

#include "remat/nn/dropout.hpp"
#include "remat/nn/linear.hpp"
#include "remat/ops/masked_fill.hpp"
#include "remat/ops/matmul.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/permute.hpp"
#include "remat/ops/reshape.hpp"
#include "remat/ops/softmax.hpp"
#include "remat/ops/attention.hpp"
#include "remat/ops/cat.hpp"
#include "remat/ops/dropout_add.hpp"

namespace remat::nn {

/// Multi-head causal self-attention, as in GPT-2:
///   q, k, v = split(c_attn(x)),  att = softmax(mask(q kᵀ / √d)),  y = c_proj(dropout(att) v).
class CausalSelfAttention : public UnaryModule {
 public:
  /// n_embd: the width C, split into n_head heads of C / n_head; dropout on the probabilities and the output; bias on both Linears.
  CausalSelfAttention(std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0, bool bias = true,
                      Generator& gen = default_generator())
      : n_embd(n_embd), n_head(n_head), c_attn(n_embd, 3 * n_embd, bias, gen), c_proj(n_embd, n_embd, bias, gen),
        attn_dropout(dropout), resid_dropout(dropout) {
    REMAT_CHECK(n_head > 0 && n_embd % n_head == 0,
                "nn::CausalSelfAttention: n_embd {} must be a positive multiple of n_head {}", n_embd, n_head);
    register_module("c_attn", c_attn);
    register_module("c_proj", c_proj);
    register_module("attn_dropout", attn_dropout);
    register_module("resid_dropout", resid_dropout);
  }

  /// x (B, T, C) to (B, T, C).
  Tensor forward(const Tensor& x) override { return resid_dropout(project(x)); }  // x (B, T, C)

  /// residual + forward(x), with the dropout and the add in one pass (dropout_add): what a
  /// Transformer block computes, bitwise.
  Tensor forward_residual(const Tensor& x, const Tensor& residual) {
    return dropout_add(project(x), residual, resid_dropout.p, resid_dropout.is_training());
  }

  ///@{
  /// The width C and the number of heads.
  std::int64_t n_embd, n_head;
  ///@}
  /// One fused attention op on the packed projection (causal_self_attention: saves the projection
  /// and row statistics, never the (T, T) probabilities, and copies no heads); false runs the
  /// explicit ops (split, permute, matmul, masked_fill, softmax, dropout, matmul), which selective
  /// checkpointing can keep individually. Both draw the same dropout masks.
  bool fused = true;
  ///@{
  /// c_attn: C to 3C (q, k, v packed); c_proj: C to C on the merged heads.
  Linear c_attn, c_proj;
  ///@}
  ///@{
  /// On the attention probabilities and on the output.
  Dropout attn_dropout, resid_dropout;
  ///@}

 private:
  /// c_proj(attention(x)): everything but the residual dropout.
  Tensor project(const Tensor& x) {
    REMAT_CHECK(x.dim() == 3 && x.size(2) == n_embd,
                "nn::CausalSelfAttention: expected input (B, T, {}), got {}", n_embd, x.shape());
    const std::int64_t B = x.size(0), T = x.size(1), C = n_embd, H = n_head, D = C / H;
    const Tensor packed = c_attn(x);  // (B, T, 3C): q | k | v
    // Fused, the heads are read from the packed projection in place and written out merged.
    if (fused) return c_proj(causal_self_attention(packed, H, attn_dropout.p, attn_dropout.is_training()));
    const auto qkv = split(packed, C, -1);  // 3 × (B, T, C)
    auto heads = [&](const Tensor& t) { return permute(reshape(t, {B, T, H, D}), {0, 2, 1, 3}); };  // (B, H, T, D)
    const Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    // q kᵀ with k read transposed by the GEMM, as PyTorch's q @ k.transpose(-2, -1) on a view.
    Tensor att = matmul(q, k, false, true) * (1.0 / std::sqrt(static_cast<double>(D)));  // (B, H, T, T)
    att = masked_fill(att, causal_mask(T), -std::numeric_limits<float>::infinity());
    const Tensor out = matmul(attn_dropout(softmax(att)), v);  // (B, H, T, D)
    return c_proj(reshape(permute(out, {0, 2, 1, 3}), {B, T, C}));
  }
};

}  // namespace remat::nn
