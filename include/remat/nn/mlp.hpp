#pragma once
#include "remat/nn/dropout.hpp"
#include "remat/nn/linear.hpp"
#include "remat/ops/bias_gelu.hpp"
#include "remat/ops/dropout_add.hpp"
#include "remat/ops/gelu.hpp"

namespace remat::nn {

/// The Transformer feed-forward: c_proj(gelu(c_fc(x))) with a 4× hidden width, then dropout.
class MLP : public UnaryModule {
 public:
  /// Width n_embd in and out, 4 * n_embd hidden; dropout after c_proj; approximate selects the GELU form.
  MLP(std::int64_t n_embd, double dropout = 0.0, bool bias = true, Generator& gen = default_generator(),
      GeluApproximation approximate = GeluApproximation::none)
      : c_fc(n_embd, 4 * n_embd, bias, gen), c_proj(4 * n_embd, n_embd, bias, gen), drop(dropout),
        approximate(approximate) {
    register_module("c_fc", c_fc);
    register_module("c_proj", c_proj);
    register_module("dropout", drop);
  }
  /// x (..., C) to (..., C).
  Tensor forward(const Tensor& x) override { return drop(c_proj(hidden(x))); }

  /// residual + forward(x), with the dropout and the add in one pass (dropout_add): what a
  /// Transformer block computes, bitwise.
  Tensor forward_residual(const Tensor& x, const Tensor& residual) {
    return dropout_add(c_proj(hidden(x)), residual, drop.p, drop.is_training());
  }

  ///@{
  /// c_fc: C to 4C; c_proj: 4C back to C.
  Linear c_fc, c_proj;
  ///@}
  /// Applied to c_proj's output.
  Dropout drop;
  /// Which GELU the hidden layer uses (exact erf or tanh).
  GeluApproximation approximate;

 private:
  /// gelu(c_fc(x)): the GEMM alone, then the bias and the activation in one pass (bias_gelu).
  Tensor hidden(const Tensor& x) {
    if (!c_fc.bias.defined()) return gelu(c_fc(x), approximate);
    return bias_gelu(linear(x, c_fc.weight), c_fc.bias, approximate);
  }
};

}  // namespace remat::nn
