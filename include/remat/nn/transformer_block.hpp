#pragma once
#include "remat/nn/attention.hpp"
#include "remat/nn/layer_norm.hpp"
#include "remat/nn/mlp.hpp"
#include "remat/ops/add.hpp"

namespace remat::nn {

/// Pre-LN block: x + attn(ln_1(x)), then + mlp(ln_2(·)). Maps (B, T, C) to (B, T, C).
class TransformerBlock : public UnaryModule {
 public:
  /// n_embd: the width C; n_head heads of C / n_head; dropout on attention and residuals; bias on every Linear and LayerNorm.
  TransformerBlock(std::int64_t n_embd, std::int64_t n_head, double dropout = 0.0, bool bias = true,
                   Generator& gen = default_generator())
      : ln_1(n_embd, 1e-5, bias), attn(n_embd, n_head, dropout, bias, gen), ln_2(n_embd, 1e-5, bias),
        mlp(n_embd, dropout, bias, gen) {
    register_module("ln_1", ln_1);
    register_module("attn", attn);
    register_module("ln_2", ln_2);
    register_module("mlp", mlp);
  }
  /// x (B, T, C) to (B, T, C).
  Tensor forward(const Tensor& x) override {
    const Tensor h = attn.forward_residual(ln_1(x), x);  // x + attn(ln_1(x))
    return mlp.forward_residual(ln_2(h), h);            // h + mlp(ln_2(h))
  }

  /// The norm before attention.
  LayerNorm ln_1;
  /// The attention sub-layer.
  CausalSelfAttention attn;
  /// The norm before the MLP.
  LayerNorm ln_2;
  /// The feed-forward sub-layer.
  MLP mlp;
};

}  // namespace remat::nn
