#pragma once
// What every optimizer shares: parameter groups, a learning rate that schedules can set, and
// zero_grad.

#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/tensor.hpp"

namespace remat::optim {

/// Parameters that share hyper-parameters (e.g. no weight decay for biases and norms).
struct ParamGroup {
  std::vector<Tensor*> params;
  double weight_decay = 0.0;
};

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups, double lr) : groups_(std::move(groups)), lr_(lr) {
    REMAT_CHECK(lr >= 0, "optimizer: learning rate must be non-negative, got {}", lr);
    for (const ParamGroup& g : groups_)
      for (const Tensor* p : g.params)
        REMAT_CHECK(p != nullptr && p->defined() && p->requires_grad(),
                    "optimizer: every parameter must be a defined tensor that requires grad");
  }
  virtual ~Optimizer() = default;

  /// Applies one update from the current gradients; parameters without a gradient are skipped.
  virtual void step() = 0;

  void zero_grad() {
    for (ParamGroup& g : groups_)
      for (Tensor* p : g.params) p->zero_grad();
  }
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }

 protected:
  std::vector<ParamGroup> groups_;
  double lr_;
};

}  // namespace remat::optim
