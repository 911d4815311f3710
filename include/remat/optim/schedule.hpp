#pragma once
#include <cmath>
#include <cstdint>

#include "remat/core/error.hpp"

namespace remat::optim {

/// Linear warmup from 0 to max_lr over `warmup` steps, then a cosine decay to min_lr at
/// `total` steps, constant after (the schedule of GPT-2/3 and nanoGPT).
class WarmupCosine {
 public:
  /// Learning rates from 0 up to max_lr over `warmup` steps, down to min_lr at step `total`.
  WarmupCosine(double max_lr, double min_lr, std::int64_t warmup, std::int64_t total)
      : max_lr_(max_lr), min_lr_(min_lr), warmup_(warmup), total_(total) {
    REMAT_CHECK(warmup >= 0 && total > warmup, "WarmupCosine: needs 0 <= warmup < total, got warmup {} total {}",
                warmup, total);
    REMAT_CHECK(max_lr >= min_lr && min_lr >= 0, "WarmupCosine: needs max_lr >= min_lr >= 0, got {} and {}",
                max_lr, min_lr);
  }

  /// The learning rate for step t (0-based).
  double operator()(std::int64_t t) const {
    if (t < warmup_) return max_lr_ * static_cast<double>(t + 1) / static_cast<double>(warmup_);
    if (t >= total_) return min_lr_;
    const double progress = static_cast<double>(t - warmup_) / static_cast<double>(total_ - warmup_);
    return min_lr_ + 0.5 * (max_lr_ - min_lr_) * (1 + std::cos(M_PI * progress));
  }

 private:
  double max_lr_, min_lr_;
  std::int64_t warmup_, total_;
};

}  // namespace remat::optim
