#pragma once
#include "remat/core/factory.hpp"
#include "remat/nn/module.hpp"
#include "remat/ops/layer_norm.hpp"

namespace remat::nn {

/// Normalises the last dim of size `normalized_shape`; weight starts at 1, bias at 0.
class LayerNorm : public UnaryModule {
 public:
  /// Over a last dim of size normalized_shape; eps is added to the variance; bias=false has none.
  explicit LayerNorm(std::int64_t normalized_shape, double eps = 1e-5, bool bias = true) : eps(eps) {
    weight = ones({normalized_shape});
    register_parameter("weight", weight);
    if (bias) {
      this->bias = zeros({normalized_shape});
      register_parameter("bias", this->bias);
    }
  }
  /// layer_norm(x, weight, bias, eps) over x's last dim.
  Tensor forward(const Tensor& x) override { return layer_norm(x, weight, bias, eps); }

  ///@{
  /// The scale and shift, (normalized_shape); bias is undefined when built without one.
  Tensor weight, bias;
  ///@}
  /// Added to the variance before the square root.
  double eps;
};

}  // namespace remat::nn
