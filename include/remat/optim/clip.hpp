#pragma once
#include <cmath>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/tensor.hpp"

namespace remat::optim {

/// Scales all gradients by min(1, max_norm / ‖g‖) where ‖g‖ is the global L2 norm over every
/// parameter's gradient (torch.nn.utils.clip_grad_norm_). Returns ‖g‖ before clipping.
inline double clip_grad_norm(const std::vector<Tensor*>& params, double max_norm) {
  REMAT_CHECK(max_norm > 0, "clip_grad_norm: max_norm must be positive, got {}", max_norm);
  double sq = 0;
  for (const Tensor* p : params) {
    const Tensor g = p->grad();
    if (g.defined()) sq += detail::flat(g).template cast<double>().square().sum();
  }
  const double norm = std::sqrt(sq);
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    for (Tensor* p : params) {
      Tensor g = p->grad();
      if (g.defined()) detail::flat(g) *= static_cast<float>(scale);
    }
  }
  return norm;
}

}  // namespace remat::optim
