#pragma once
#include <cmath>
#include <unordered_map>

#include "remat/core/factory.hpp"
#include "remat/core/autograd.hpp"
#include "remat/optim/optimizer.hpp"

namespace remat::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  ///< used when parameters are given as a plain list
};

/// Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW:
///   p -= lr·wd·p;  m = β1 m + (1-β1) g;  v = β2 v + (1-β2) g²;
///   p -= lr · (m / (1-β1ᵗ)) / (√(v / (1-β2ᵗ)) + eps).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor*> params, AdamWOptions opt = {})
      : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), opt.weight_decay}}, opt) {}
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opt) : Optimizer(std::move(groups), opt.lr), opt_(opt) {
    REMAT_CHECK(opt.beta1 >= 0 && opt.beta1 < 1 && opt.beta2 >= 0 && opt.beta2 < 1,
                "AdamW: betas must be in [0, 1), got ({}, {})", opt.beta1, opt.beta2);
    REMAT_CHECK(opt.eps > 0, "AdamW: eps must be positive, got {}", opt.eps);
  }

  void step() override {
    no_grad guard;
    ++t_;
    const double bc1 = 1 - std::pow(opt_.beta1, t_), bc2 = 1 - std::pow(opt_.beta2, t_);
    const auto b1 = static_cast<float>(opt_.beta1), b2 = static_cast<float>(opt_.beta2);
    const auto step_size = static_cast<float>(lr_ / bc1);
    const auto inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
    const auto eps = static_cast<float>(opt_.eps);
    for (ParamGroup& group : groups_) {
      const auto decay = static_cast<float>(1 - lr_ * group.weight_decay);
      for (Tensor* p : group.params) {
        const Tensor grad = p->grad();
        if (!grad.defined()) continue;
        State& s = state_[p];
        if (!s.m.defined()) {
          s.m = zeros(p->shape());
          s.v = zeros(p->shape());
        }
        auto g = detail::flat(grad);
        auto m = detail::flat(s.m);
        auto v = detail::flat(s.v);
        auto w = detail::flat(*p);
        w *= decay;
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g.square();
        w -= step_size * m / (v.sqrt() * inv_sqrt_bc2 + eps);
      }
    }
  }

  std::int64_t steps() const { return t_; }
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
