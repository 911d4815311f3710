#pragma once
#include <cmath>

#include "remat/nn/init.hpp"
#include "remat/nn/module.hpp"
#include "remat/ops/linear.hpp"

namespace remat::nn {

/// y = x Wᵀ + b with W (out, in) as PyTorch stores it; W and b start U(-1/√in, 1/√in).
class Linear : public UnaryModule {
 public:
  /// A (out_features, in_features) weight and, when bias is true, an (out_features) bias, drawn from gen.
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true,
         Generator& gen = default_generator()) {
    REMAT_CHECK(in_features > 0 && out_features > 0, "nn::Linear: sizes must be positive, got {} -> {}",
                in_features, out_features);
    const float bound = 1.0f / std::sqrt(static_cast<float>(in_features));
    weight = init::uniform({out_features, in_features}, bound, gen);
    register_parameter("weight", weight);
    if (bias) {
      this->bias = init::uniform({out_features}, bound, gen);
      register_parameter("bias", this->bias);
    }
  }
  /// x (..., in) to (..., out).
  Tensor forward(const Tensor& x) override { return linear(x, weight, bias); }

  Tensor weight;  ///< (out_features, in_features)
  Tensor bias;    ///< (out_features,), undefined without bias
};

}  // namespace remat::nn
