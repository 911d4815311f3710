#pragma once
#include <unordered_map>

#include "remat/core/factory.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/threads.hpp"
#include "remat/optim/optimizer.hpp"

namespace remat::optim {

/// SGD's hyper-parameters, with PyTorch's meanings.
struct SGDOptions {
  /// The learning rate.
  double lr = 0.01;
  /// μ: the momentum (0: plain SGD).
  double momentum = 0.0;
  double weight_decay = 0.0;  ///< L2, added to the gradient (PyTorch's SGD semantics)
  /// Nesterov momentum (needs momentum > 0).
  bool nesterov = false;
};

/// PyTorch's SGD: g = ∇ + wd·p;  b = μ b + g (b = g on the first step);  p -= lr · (nesterov ? g + μ b : b).
class SGD : public Optimizer {
 public:
  /// One group of all params.
  SGD(std::vector<Tensor*> params, SGDOptions opt = {})
      : Optimizer({ParamGroup{std::move(params), opt.weight_decay}}, opt.lr), opt_(opt) {
    REMAT_CHECK(opt.momentum >= 0, "SGD: momentum must be non-negative, got {}", opt.momentum);
    REMAT_CHECK(!opt.nesterov || opt.momentum > 0, "SGD: nesterov needs a positive momentum");
  }

  void step() override {
    no_grad guard;
    const auto lr = static_cast<float>(lr_), mu = static_cast<float>(opt_.momentum);
    for (ParamGroup& group : groups_) {
      const auto wd = static_cast<float>(group.weight_decay);
      for (Tensor* p : group.params) {
        const Tensor grad = p->grad();
        if (!grad.defined()) continue;
        // The gradient itself unless this step writes to it (PyTorch's SGD reads it in place too):
        // a copy per parameter per step was 0.6% of the small GPT's bf16 step.
        const bool writes = wd != 0 || (mu != 0 && opt_.nesterov);
        Tensor written = writes ? Tensor(grad.shape()) : Tensor();
        Tensor* buffer = nullptr;
        bool fresh = false;
        if (mu != 0) {
          auto [it, inserted] = momentum_.try_emplace(p, Tensor());
          if (inserted) it->second = Tensor(grad.shape());
          buffer = &it->second;
          fresh = inserted;
        }
        float* w = p->data();
        const float* d = grad.cdata();
        float* gw = writes ? written.data() : nullptr;
        float* b = buffer ? buffer->data() : nullptr;
        // On threads, in pieces on 64-byte lines: each element's arithmetic is the whole
        // expression's, so the bits do not depend on the team (parallel_for_lines).
        parallel_for_lines(p->numel(), kElementGrain, {w, d, gw, b}, [&](std::int64_t i0, std::int64_t i1) {
          const std::int64_t n = i1 - i0;
          using detail::ArrayMap;
          using detail::ConstArrayMap;
          if (writes) ArrayMap<float>(gw + i0, n) = ConstArrayMap<float>(d + i0, n);
          const float* g = writes ? gw : d;
          if (wd != 0) ArrayMap<float>(gw + i0, n) += wd * ConstArrayMap<float>(w + i0, n);
          if (b) {
            if (fresh) ArrayMap<float>(b + i0, n) = ConstArrayMap<float>(g + i0, n);
            else ArrayMap<float>(b + i0, n) = mu * ArrayMap<float>(b + i0, n) + ConstArrayMap<float>(g + i0, n);
            if (opt_.nesterov) ArrayMap<float>(gw + i0, n) += mu * ConstArrayMap<float>(b + i0, n);
            else g = b;
          }
          ArrayMap<float>(w + i0, n) -= lr * ConstArrayMap<float>(g + i0, n);
        });
      }
    }
  }

  const char* kind() const override { return "SGD"; }

 private:
  void save_extra(OptimizerState& s) const override {
    for_each_param([&](std::size_t g, std::size_t i, const Tensor* p) {
      if (auto it = momentum_.find(p); it != momentum_.end()) s.tensors[key(g, i, "momentum_buffer")] = detail::copy_of(it->second);
    });
  }
  void check_extra(const OptimizerState&) const override {}
  bool known_buffer(const std::string& buffer) const override { return buffer == "momentum_buffer"; }
  void load_extra(const OptimizerState& s) override {
    momentum_.clear();
    for (const auto& [k, t] : s.tensors) momentum_[parameter_of(k).first] = detail::copy_of(t);
  }

  SGDOptions opt_;
  std::unordered_map<const Tensor*, Tensor> momentum_;
};

}  // namespace remat::optim
