#pragma once
#include "remat/nn/module.hpp"
#include "remat/ops/dropout.hpp"

namespace remat::nn {

/// Dropout active in training mode only, drawing from the thread's default generator (which
/// checkpoint replays restore).
class Dropout : public UnaryModule {
 public:
  /// p: the probability of zeroing an element, in [0, 1].
  explicit Dropout(double p = 0.5) : p(p) {
    REMAT_CHECK(p >= 0.0 && p <= 1.0, "nn::Dropout: probability must be in [0, 1], got {}", p);
  }
  /// dropout(x, p) in training mode, x itself in eval mode.
  Tensor forward(const Tensor& x) override { return dropout(x, p, is_training()); }

  /// The probability of zeroing an element (kept ones are scaled by 1/(1-p)).
  double p;
};

}  // namespace remat::nn
