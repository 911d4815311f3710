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

/// CHECKs that `how` changes neither the loss nor any parameter gradient of `model`, bit for bit
/// (testing::compare_checkpointing from generator seed `seed`); a failure names the first
/// difference and the checkpointing.
template <class Stack>
void check_checkpointing(Stack& model, const Checkpointing& how, const std::function<Tensor()>& loss_fn,
                         std::uint64_t seed = 0) {
  const testing::GradientComparison r = testing::compare_checkpointing(model, how, loss_fn, seed);
  INFO(how.name << ": " << r.message);
  CHECK(r.equal);
}

}  // namespace remat::test
