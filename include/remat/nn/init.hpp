#pragma once
// Parameter initialisers, drawing from a Generator so a seed fixes a model.

#include <cmath>

#include "remat/core/factory.hpp"

/// Parameter initialisers that fill tensors from a Generator, as torch.nn.init.
namespace remat::nn::init {

/// N(mean, std²).
inline Tensor normal(const Shape& shape, float std, Generator& gen, float mean = 0.0f) {
  Tensor t = randn(shape, gen);
  detail::flat(t) = detail::flat(t) * std + mean;
  return t;
}

/// U(-bound, bound): PyTorch's default for Linear, with bound = 1/√fan_in.
inline Tensor uniform(const Shape& shape, float bound, Generator& gen) {
  Tensor t = rand(shape, gen);
  detail::flat(t) = (detail::flat(t) * 2.0f - 1.0f) * bound;
  return t;
}

}  // namespace remat::nn::init
