#pragma once
#include "remat/nn/module.hpp"
#include "remat/ops/dropout.hpp"

namespace remat::nn {

/// Dropout active in training mode only, drawing from the thread's default generator (which
/// checkpoint replays restore).
class Dropout : public UnaryModule {
 public:
  explicit Dropout(double p = 0.5) : p(p) {
    REMAT_CHECK(p >= 0.0 && p <= 1.0, "nn::Dropout: probability must be in [0, 1], got {}", p);
  }
  Tensor forward(const Tensor& x) override { return dropout(x, p, is_training()); }

  double p;
};

}  // namespace remat::nn
