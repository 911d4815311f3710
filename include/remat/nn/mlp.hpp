#pragma once
#include "remat/nn/dropout.hpp"
#include "remat/nn/linear.hpp"
#include "remat/ops/gelu.hpp"

namespace remat::nn {

/// The Transformer feed-forward: c_proj(gelu(c_fc(x))) with a 4× hidden width, then dropout.
class MLP : public UnaryModule {
 public:
  MLP(std::int64_t n_embd, double dropout = 0.0, bool bias = true, Generator& gen = default_generator(),
      GeluApproximation approximate = GeluApproximation::none)
      : c_fc(n_embd, 4 * n_embd, bias, gen), c_proj(4 * n_embd, n_embd, bias, gen), drop(dropout),
        approximate(approximate) {
    register_module("c_fc", c_fc);
    register_module("c_proj", c_proj);
    register_module("dropout", drop);
  }
  Tensor forward(const Tensor& x) override { return drop(c_proj(gelu(c_fc(x), approximate))); }

  Linear c_fc, c_proj;
  Dropout drop;
  GeluApproximation approximate;
};

}  // namespace remat::nn
