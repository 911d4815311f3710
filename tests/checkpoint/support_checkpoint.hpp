#pragma once
// Helpers for comparing a model's gradients with and without checkpointing, bit for bit.

#include "support.hpp"

namespace remat::test {

/// Every parameter's gradient, in named_parameters order, copied out.
inline std::vector<std::vector<float>> gradients(nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (auto& [name, p] : m.named_parameters()) out.push_back(p->grad().defined() ? p->grad().to_vector() : std::vector<float>{});
  return out;
}

inline nn::GPTConfig small_gpt(std::int64_t layers = 4, double dropout = 0.1) {
  nn::GPTConfig c;
  c.vocab_size = 23;
  c.block_size = 12;
  c.n_layer = layers;
  c.n_head = 2;
  c.n_embd = 16;
  c.dropout = dropout;
  return c;
}

}  // namespace remat::test
