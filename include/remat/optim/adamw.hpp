#pragma once
#include <cmath>
#include <unordered_map>

#include "remat/core/factory.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/threads.hpp"
#include "remat/optim/optimizer.hpp"

namespace remat::optim {

/// AdamW's hyper-parameters, with torch.optim.AdamW's defaults.
struct AdamWOptions {
  /// The learning rate.
  double lr = 1e-3;
  /// β1: the decay of the first-moment (mean) estimate, in [0, 1).
  double beta1 = 0.9;
  /// β2: the decay of the second-moment estimate, in [0, 1).
  double beta2 = 0.999;
  /// Added to the denominator √v̂ so that it is never zero.
  double eps = 1e-8;
  double weight_decay = 0.01;  ///< used when parameters are given as a plain list
};

/// One AdamW step's coefficients and its element-wise update, shared by AdamW and the sharded
/// AdamW of remat::dist, which must give the same bits on any slice of a parameter.
struct AdamWStep {
  /// The coefficients of step t (counted from 1) at learning rate lr.
  AdamWStep(const AdamWOptions& opt, double lr, std::int64_t t) : lr(lr) {
    const double bc1 = 1 - std::pow(opt.beta1, t), bc2 = 1 - std::pow(opt.beta2, t);
    b1 = static_cast<float>(opt.beta1);
    b2 = static_cast<float>(opt.beta2);
    step_size = static_cast<float>(lr / bc1);
    inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
    eps = static_cast<float>(opt.eps);
  }
  /// The decoupled weight-decay factor 1 - lr·wd applied to the parameter before the update.
  float decay(double weight_decay) const { return static_cast<float>(1 - lr * weight_decay); }

  /// w, m, v updated in place from g, n elements. Each element's new bits depend on its own
  /// values only, never on where the slice starts or how long it is: ShardedAdamW updates
  /// shards that begin anywhere, and AdamW the whole parameter, and they must agree. So this is a
  /// plain loop of IEEE-exact operations (std::sqrt is correctly rounded whether the compiler
  /// vectorises it or not), not an Eigen expression: Eigen's vectorised float sqrt under its
  /// default fast math is a reciprocal-sqrt estimate refined by one Newton step, its scalar tail
  /// std::sqrt, so a slice's packet/tail split changed the last bit.
  void update(float* w, float* m, float* v, const float* g, std::int64_t n, float decay) const {
    for (std::int64_t i = 0; i < n; ++i) {
      const float wd = w[i] * decay;
      const float mi = b1 * m[i] + (1 - b1) * g[i];
      const float vi = b2 * v[i] + (1 - b2) * (g[i] * g[i]);
      m[i] = mi;
      v[i] = vi;
      w[i] = wd - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
    }
  }

  /// The learning rate of this step.
  double lr;
  ///@{
  /// β1, β2, lr / (1-β1ᵗ), 1 / √(1-β2ᵗ) and eps, as floats.
  float b1, b2, step_size, inv_sqrt_bc2, eps;
  ///@}
};

/// Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW:
///   p -= lr·wd·p;  m = β1 m + (1-β1) g;  v = β2 v + (1-β2) g²;
///   p -= lr · (m / (1-β1ᵗ)) / (√(v / (1-β2ᵗ)) + eps).
class AdamW : public Optimizer {
 public:
  /// One group of all params, with opt.weight_decay.
  AdamW(std::vector<Tensor*> params, AdamWOptions opt = {})
      : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), opt.weight_decay}}, opt) {}
  /// Parameter groups, each with its own weight decay; opt.weight_decay is not used.
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opt) : Optimizer(std::move(groups), opt.lr), opt_(opt) {
    REMAT_CHECK(opt.beta1 >= 0 && opt.beta1 < 1 && opt.beta2 >= 0 && opt.beta2 < 1,
                "AdamW: betas must be in [0, 1), got ({}, {})", opt.beta1, opt.beta2);
    REMAT_CHECK(opt.eps > 0, "AdamW: eps must be positive, got {}", opt.eps);
  }

  void step() override {
    no_grad guard;
    const AdamWStep c(opt_, lr_, ++t_);
    for (ParamGroup& group : groups_) {
      const float decay = c.decay(group.weight_decay);
      for (Tensor* p : group.params) {
        const Tensor grad = p->grad();
        if (!grad.defined()) continue;
        State& s = state_[p];
        if (!s.m.defined()) {
          s.m = zeros(p->shape());
          s.v = zeros(p->shape());
        }
        // On threads: update() is exact per element wherever a piece begins (see there).
        float* w = p->data();
        float* m = s.m.data();
        float* v = s.v.data();
        const float* g = grad.cdata();
        parallel_for(p->numel(), kElementGrain, [&](std::int64_t i0, std::int64_t i1) {
          c.update(w + i0, m + i0, v + i0, g + i0, i1 - i0, decay);
        });
      }
    }
  }

  /// The number of steps taken (t in the bias corrections).
  std::int64_t steps() const { return t_; }
  /// The hyper-parameters it was built with.
  const AdamWOptions& options() const { return opt_; }
  const char* kind() const override { return "AdamW"; }

 private:
  void save_extra(OptimizerState& s) const override {
    s.scalars["step"] = static_cast<double>(t_);
    for_each_param([&](std::size_t g, std::size_t i, const Tensor* p) {
      if (auto it = state_.find(p); it != state_.end()) {
        s.tensors[key(g, i, "exp_avg")] = detail::copy_of(it->second.m);
        s.tensors[key(g, i, "exp_avg_sq")] = detail::copy_of(it->second.v);
      }
    });
  }
  void check_extra(const OptimizerState& s) const override {
    REMAT_CHECK(s.scalars.count("step"), "AdamW: the state has no step count ('step')");
    const double t = s.scalars.at("step");
    REMAT_CHECK(t >= 0 && t <= 9007199254740992.0 && t == std::floor(t),
                "AdamW: the state's step count {} is not a whole number in [0, 2^53]", t);
    // Each parameter has both moments or neither.
    for (const auto& [k, tensor] : s.tensors) {
      const std::string buffer = parameter_of(k).second;
      const std::string other = k.substr(0, k.size() - buffer.size()) + (buffer == "exp_avg" ? "exp_avg_sq" : "exp_avg");
      REMAT_CHECK(s.tensors.count(other), "AdamW: the state has {} but not {}", k, other);
    }
  }
  bool known_buffer(const std::string& buffer) const override { return buffer == "exp_avg" || buffer == "exp_avg_sq"; }
  void load_extra(const OptimizerState& s) override {
    t_ = static_cast<std::int64_t>(s.scalars.at("step"));
    state_.clear();
    for (const auto& [k, t] : s.tensors) {
      const auto [p, buffer] = parameter_of(k);
      (buffer == "exp_avg" ? state_[p].m : state_[p].v) = detail::copy_of(t);
    }
  }

  struct State {
    Tensor m, v;
  };
  AdamWOptions opt_;
  std::unordered_map<const Tensor*, State> state_;
  std::int64_t t_ = 0;
};

}  // namespace remat::optim
