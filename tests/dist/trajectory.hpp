#pragma once
// The distributed tests' yardstick: one process accumulating the ranks' micro-batches of a tiny GPT
// in rank order (gradients each step, weights after AdamW), and the bitwise comparison with it.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include <remat/remat.hpp>
#include <remat/nn/gpt.hpp>
#include <remat/optim/adamw.hpp>

namespace remat::test {

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

inline nn::GPTConfig tiny_gpt() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 13;
  cfg.block_size = 8;
  cfg.n_layer = 4;
  cfg.n_head = 2;
  cfg.n_embd = 16;
  cfg.dropout = 0.1;  // replays must draw what the forward drew
  return cfg;
}

/// Micro-batch `rank` of `step`: 2 sequences of 8 tokens, and the dropout seed its forward uses.
struct MicroBatch {
  LongTensor x, y;
  std::uint64_t seed;
};
inline MicroBatch micro_batch(int step, int rank) {
  Generator gen(static_cast<std::uint64_t>(1000 * step + rank));
  LongTensor x = randint(0, 13, Shape{2, 8}, gen), y = randint(0, 13, Shape{2, 8}, gen);
  return {x, y, static_cast<std::uint64_t>(7000 + 1000 * step + rank)};
}

inline std::vector<optim::ParamGroup> gpt_groups(nn::GPT& model) {
  optim::ParamGroup decay{{}, 0.1}, no_decay{{}, 0.0};
  for (auto& [name, p] : model.named_parameters()) (p->dim() >= 2 ? decay : no_decay).params.push_back(p);
  return {decay, no_decay};
}
inline const optim::AdamWOptions kAdamW{1e-2, 0.9, 0.95, 1e-8, 0.0};

struct Trajectory {
  std::vector<std::vector<Tensor>> grads;  ///< per step, per parameter (the averaged gradient)
  std::vector<Tensor> weights;             ///< after the last step
};

inline std::vector<Tensor> copies(const std::vector<Tensor*>& ps, bool grads) {
  std::vector<Tensor> out;
  for (Tensor* p : ps) out.push_back(detail::copy_of(grads ? p->grad() : *p));
  return out;
}

/// The loss of micro-batch `rank` of `step` (its dropout seed set first), the forward under
/// remat::autocast when `mixed` (backward is the caller's, outside it).
inline Tensor micro_batch_loss(nn::GPT& model, int step, int rank, bool mixed) {
  const MicroBatch mb = micro_batch(step, rank);
  manual_seed(mb.seed);
  autocast on(mixed);
  return model.loss(mb.x, mb.y);
}

/// One process: each step accumulates the N micro-batches in rank order, divides by N, AdamW.
/// `mixed`: each forward under remat::autocast (backward outside it); `cfg`: the GPT (tiny_gpt()
/// with other sizes: micro_batch()'s tokens fit it).
inline Trajectory reference(int ranks, int steps, bool mixed = false, const nn::GPTConfig& cfg = tiny_gpt()) {
  Generator init(5);
  nn::GPT model(cfg, init);
  optim::AdamW adamw(gpt_groups(model), kAdamW);
  Trajectory out;
  for (int step = 0; step < steps; ++step) {
    for (int r = 0; r < ranks; ++r) {
      micro_batch_loss(model, step, r, mixed).backward();
    }
    for (Tensor* p : model.parameters()) {
      Tensor g = p->grad();
      detail::flat(g) /= static_cast<float>(ranks);
    }
    out.grads.push_back(copies(model.parameters(), true));
    adamw.step();
    adamw.zero_grad();
  }
  out.weights = copies(model.parameters(), false);
  return out;
}

/// Every step's gradients and the final weights of `got` bitwise those of `expected`.
inline void check_same_trajectory(const Trajectory& got, const Trajectory& expected, int steps) {
  for (int step = 0; step < steps; ++step)
    for (std::size_t i = 0; i < expected.grads[0].size(); ++i) {
      INFO("step " << step << ", parameter " << i);
      CHECK(bitwise_equal(got.grads[static_cast<std::size_t>(step)][i], expected.grads[static_cast<std::size_t>(step)][i]));
    }
  for (std::size_t i = 0; i < expected.weights.size(); ++i) {
    INFO("weights after " << steps << " steps, parameter " << i);
    CHECK(bitwise_equal(got.weights[i], expected.weights[i]));
  }
}

}  // namespace remat::test
