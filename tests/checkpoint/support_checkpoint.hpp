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

}  // namespace remat::test
