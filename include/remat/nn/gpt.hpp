#pragma once
// A GPT-2 style decoder: token and learned position embeddings, L pre-LN blocks, a final
// LayerNorm and an LM head (optionally tied to the token embedding). Parameter names follow
// nanoGPT/Hugging Face ("transformer.h.0.attn.c_attn.weight"), so weights exchange with PyTorch.

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "remat/core/factory.hpp"
#include "remat/nn/blocks.hpp"
#include "remat/nn/embedding.hpp"
#include "remat/nn/transformer_block.hpp"
#include "remat/ops/cross_entropy.hpp"
#include "remat/ops/narrow.hpp"

namespace remat::nn {

/// The GPT's hyperparameters (GPT-2's names); the defaults are a small character-level model.
struct GPTConfig {
  /// The number of token ids V.
  std::int64_t vocab_size = 256;
  std::int64_t block_size = 64;  ///< the longest context
  /// The number of Transformer blocks L.
  std::int64_t n_layer = 4;
  /// Attention heads per block.
  std::int64_t n_head = 4;
  /// The width C of the residual stream.
  std::int64_t n_embd = 128;
  /// Dropout probability on embeddings, attention and residuals (0: none).
  double dropout = 0.0;
  /// Biases in every Linear (but lm_head) and LayerNorm.
  bool bias = true;
  bool tie_weights = false;  ///< lm_head.weight is transformer.wte.weight
};

/// Runs its blocks through BlockStack::run_blocks, so a caller chooses how (checkpointing each
/// block, a chain schedule) with remat::apply_checkpointing; the model itself has no such switch.
class GPT : public Module, public BlockStack {
 public:
  /// Builds every module from gen and applies GPT-2's initialisation.
  explicit GPT(const GPTConfig& cfg, Generator& gen = default_generator())
      : config(cfg), wte(cfg.vocab_size, cfg.n_embd, gen, 0.02f), wpe(cfg.block_size, cfg.n_embd, gen, 0.02f),
        drop(cfg.dropout), ln_f(cfg.n_embd, 1e-5, cfg.bias), lm_head(cfg.n_embd, cfg.vocab_size, false, gen) {
    REMAT_CHECK(cfg.vocab_size > 0 && cfg.block_size > 0 && cfg.n_layer > 0,
                "nn::GPT: vocab_size, block_size and n_layer must be positive, got {}, {}, {}", cfg.vocab_size,
                cfg.block_size, cfg.n_layer);
    register_module("transformer.wte", wte);
    register_module("transformer.wpe", wpe);
    register_module("transformer.drop", drop);
    for (std::int64_t i = 0; i < cfg.n_layer; ++i) {
      h.push_back(std::make_unique<TransformerBlock>(cfg.n_embd, cfg.n_head, cfg.dropout, cfg.bias, gen));
      register_module("transformer.h." + std::to_string(i), *h.back());
    }
    register_module("transformer.ln_f", ln_f);
    register_module("lm_head", lm_head);
    // GPT-2 initialisation: N(0, 0.02) weights, zero biases, and residual projections scaled by
    // 1/√(2L) so the residual stream's variance does not grow with depth.
    for (auto& [name, p] : named_parameters()) {
      const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
      if (name.find(".ln_") != std::string::npos || name.find("ln_f") != std::string::npos) continue;
      no_grad guard;
      if (is_bias) {
        detail::flat(*p).setZero();
      } else if (name.find("wte") == std::string::npos && name.find("wpe") == std::string::npos) {
        const bool residual = name.find("c_proj.weight") != std::string::npos;
        const float std = residual ? 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.n_layer)) : 0.02f;
        detail::flat(*p) = detail::flat(init::normal(p->shape(), std, gen));
      }
    }
    if (cfg.tie_weights) lm_head.weight = wte.weight;
  }

  /// The Transformer blocks, (B, T, C) -> (B, T, C) each.
  std::vector<Block> blocks() override {
    std::vector<Block> out;
    for (const auto& b : h) out.push_back([block = b.get()](const Tensor& x) { return (*block)(x); });
    return out;
  }

  /// idx (B, T) token ids  ->  logits (B, T, vocab_size).
  Tensor forward(const LongTensor& idx) {
    REMAT_CHECK(idx.dim() == 2, "nn::GPT: expected token ids (B, T), got shape {}", idx.shape());
    const std::int64_t T = idx.size(1);
    REMAT_CHECK(T <= config.block_size, "nn::GPT: sequence of length {} is longer than block_size {}", T,
                config.block_size);
    const LongTensor pos = arange<std::int64_t>(0, T);
    const Tensor x = drop(wte(idx) + wpe(pos));  // (B, T, C)
    return lm_head(ln_f(run_blocks(x)));         // (B, T, V)
  }
  /// Calls forward(idx).
  Tensor operator()(const LongTensor& idx) { return forward(idx); }

  /// Mean cross-entropy of next-token targets (B, T).
  Tensor loss(const LongTensor& idx, const LongTensor& targets) { return cross_entropy(forward(idx), targets); }

  /// Appends `max_new_tokens` sampled tokens to each row of idx (B, T0). temperature scales the
  /// logits; top_k > 0 keeps only the k most likely tokens. Runs without recording.
  LongTensor generate(const LongTensor& idx, std::int64_t max_new_tokens, double temperature = 1.0,
                      std::int64_t top_k = 0, Generator& gen = default_generator()) {
    REMAT_CHECK(temperature > 0, "nn::GPT::generate: temperature must be positive, got {}", temperature);
    no_grad guard;
    const bool was_training = is_training();
    eval();
    const std::int64_t B = idx.size(0), V = config.vocab_size;
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(B));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < idx.size(1); ++t) rows[static_cast<std::size_t>(b)].push_back(idx.at({b, t}));
    for (std::int64_t step = 0; step < max_new_tokens; ++step) {
      const std::int64_t T = std::min<std::int64_t>(static_cast<std::int64_t>(rows[0].size()), config.block_size);
      LongTensor context(Shape{B, T});
      for (std::int64_t b = 0; b < B; ++b)
        std::copy(rows[static_cast<std::size_t>(b)].end() - T, rows[static_cast<std::size_t>(b)].end(),
                  context.data() + b * T);
      const Tensor logits = forward(context);  // (B, T, V)
      for (std::int64_t b = 0; b < B; ++b) {
        std::vector<double> p(static_cast<std::size_t>(V));
        const float* last = logits.data() + (b * T + T - 1) * V;
        for (std::int64_t v = 0; v < V; ++v) p[static_cast<std::size_t>(v)] = last[v] / temperature;
        if (top_k > 0 && top_k < V) {
          std::vector<double> sorted = p;
          std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
          const double kth = sorted[static_cast<std::size_t>(top_k - 1)];
          for (double& x : p)
            if (x < kth) x = -std::numeric_limits<double>::infinity();
        }
        const double top = *std::max_element(p.begin(), p.end());
        double total = 0;
        for (double& x : p) total += (x = std::exp(x - top));
        double u = 0;
        gen.uniform(&u, 1);
        u *= total;
        std::int64_t pick = V - 1;
        for (std::int64_t v = 0; v < V; ++v) {
          if ((u -= p[static_cast<std::size_t>(v)]) < 0) {
            pick = v;
            break;
          }
        }
        rows[static_cast<std::size_t>(b)].push_back(pick);
      }
    }
    train(was_training);
    LongTensor out(Shape{B, static_cast<std::int64_t>(rows[0].size())});
    for (std::int64_t b = 0; b < B; ++b)
      std::copy(rows[static_cast<std::size_t>(b)].begin(), rows[static_cast<std::size_t>(b)].end(),
                out.data() + b * out.size(1));
    return out;
  }

  /// The configuration it was built with.
  GPTConfig config;
  ///@{
  /// Token (V, C) and position (block_size, C) embeddings.
  Embedding wte, wpe;
  ///@}
  /// On the summed embeddings.
  Dropout drop;
  /// The L blocks.
  std::vector<std::unique_ptr<TransformerBlock>> h;
  /// The final norm.
  LayerNorm ln_f;
  /// C to V logits, without a bias.
  Linear lm_head;
};

}  // namespace remat::nn
