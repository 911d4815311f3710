#pragma once
// What every optimizer shares: parameter groups, a learning rate that schedules can set, and
// zero_grad.

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/tensor.hpp"

/// Optimizers (SGD, AdamW), learning-rate schedules (WarmupCosine) and gradient clipping, as torch.optim.
namespace remat::optim {

/// What an optimizer carries from one step to the next, by name, for saving a run and resuming it
/// (PyTorch's optimizer state_dict): per-parameter buffers keyed "g<group>.p<index>.<buffer>"
/// (the parameter's position in the groups) and scalars ("lr", "step", the groups' sizes and
/// weight decays "g<group>.params", "g<group>.weight_decay", ...).
struct OptimizerState {
  /// Per-parameter buffers, keyed "g<group>.p<index>.<buffer>".
  std::map<std::string, Tensor> tensors;
  /// Scalars such as "lr" and "step", by name.
  std::map<std::string, double> scalars;
};

/// Parameters that share hyper-parameters (e.g. no weight decay for biases and norms).
struct ParamGroup {
  /// The parameters (not owned; they belong to the model).
  std::vector<Tensor*> params;
  /// The group's weight decay (its meaning is the optimizer's: decoupled for AdamW, L2 for SGD).
  double weight_decay = 0.0;
};

/// The base of the optimizers: parameter groups, a learning rate, step(), zero_grad(), and a state
/// that can be saved and loaded to resume a run.
class Optimizer {
 public:
  /// Over `groups` at learning rate lr (non-negative).
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

  /// Clears the gradient of every parameter in every group.
  void zero_grad() {
    for (ParamGroup& g : groups_)
      for (Tensor* p : g.params) p->zero_grad();
  }
  /// The learning rate the next step uses.
  double lr() const { return lr_; }
  /// Sets the learning rate (what a schedule such as WarmupCosine drives each step).
  void set_lr(double lr) { lr_ = lr; }
  /// The parameter groups, in the order they were given.
  const std::vector<ParamGroup>& param_groups() const { return groups_; }

  /// The optimizer's state: its buffers (copies) and scalars.
  OptimizerState state() const {
    OptimizerState s;
    s.scalars["lr"] = lr_;
    s.scalars["groups"] = static_cast<double>(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      s.scalars["g" + std::to_string(g) + ".params"] = static_cast<double>(groups_[g].params.size());
      s.scalars["g" + std::to_string(g) + ".weight_decay"] = groups_[g].weight_decay;
    }
    save_extra(s);
    return s;
  }
  /// Replaces the state with `s`, as state() made it for an optimizer over parameters of the same
  /// shapes in the same groups. Everything is checked first: on a remat::Error nothing changed.
  void load_state(const OptimizerState& s) {
    REMAT_CHECK(s.scalars.count("lr"), "{}: the state has no learning rate ('lr')", kind());
    REMAT_CHECK(std::isfinite(s.scalars.at("lr")) && s.scalars.at("lr") >= 0, "{}: the state's learning rate {} is "
                "not a non-negative number", kind(), s.scalars.at("lr"));
    // The same parameter groups: as many, each as long (the parameters are matched by position).
    auto scalar = [&](const std::string& key) {
      auto it = s.scalars.find(key);
      REMAT_CHECK(it != s.scalars.end(), "{}: the state has no '{}'", kind(), key);
      return it->second;
    };
    REMAT_CHECK(scalar("groups") == static_cast<double>(groups_.size()), "{}: the state has {} parameter group(s), the "
                "optimizer {}", kind(), scalar("groups"), groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      REMAT_CHECK(scalar("g" + std::to_string(g) + ".params") == static_cast<double>(groups_[g].params.size()),
                  "{}: group {} of the state has {} parameters, the optimizer's has {}", kind(), g,
                  scalar("g" + std::to_string(g) + ".params"), groups_[g].params.size());
      REMAT_CHECK(std::isfinite(scalar("g" + std::to_string(g) + ".weight_decay")),
                  "{}: group {} of the state has weight decay {}", kind(), g, scalar("g" + std::to_string(g) + ".weight_decay"));
    }
    check_extra(s);
    for (const auto& [key, t] : s.tensors) {
      const auto [p, buffer] = parameter_of(key);
      REMAT_CHECK(known_buffer(buffer), "{}: the state has buffer '{}' ({}), which this optimizer does not keep", kind(),
                  buffer, key);
      REMAT_CHECK(t.shape() == p->shape(), "{}: buffer {} has shape {}, its parameter has shape {}", kind(), key,
                  t.shape(), p->shape());
    }
    lr_ = s.scalars.at("lr");
    for (std::size_t g = 0; g < groups_.size(); ++g)
      if (auto it = s.scalars.find("g" + std::to_string(g) + ".weight_decay"); it != s.scalars.end())
        groups_[g].weight_decay = it->second;
    load_extra(s);
  }

  /// The optimizer's name, in errors ("SGD", "AdamW").
  virtual const char* kind() const = 0;

 protected:
  /// Buffer names of parameter `p` at group g, index i.
  static std::string key(std::size_t g, std::size_t i, const char* buffer) {
    return "g" + std::to_string(g) + ".p" + std::to_string(i) + "." + buffer;
  }
  /// Calls f(key prefix "g<g>.p<i>.", parameter) for every parameter.
  template <class F>
  void for_each_param(F&& f) const {
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (std::size_t i = 0; i < groups_[g].params.size(); ++i) f(g, i, groups_[g].params[i]);
  }
  /// The parameter a buffer key names, and the buffer's name; a remat::Error when it names none.
  std::pair<Tensor*, std::string> parameter_of(const std::string& key) const {
    std::size_t at = 0, g = 0, i = 0;
    // "g", digits, ".p", digits, ".", a name.
    auto number = [&](std::size_t& v) {
      const std::size_t start = at;
      while (at < key.size() && at - start < 9 && key[at] >= '0' && key[at] <= '9') v = v * 10 + static_cast<std::size_t>(key[at++] - '0');
      return at > start;
    };
    auto literal = [&](const char* text) {
      const std::size_t n = std::strlen(text);
      if (key.compare(at, n, text) != 0) return false;
      at += n;
      return true;
    };
    const bool ok = literal("g") && number(g) && literal(".p") && number(i) && literal(".") && at < key.size();
    REMAT_CHECK(ok, "{}: '{}' is not a buffer key (g<group>.p<index>.<buffer>)", kind(), key);
    const std::size_t used = at;
    REMAT_CHECK(g < groups_.size() && i < groups_[g].params.size(),
                "{}: the state has buffer {} for parameter {} of group {}, but the optimizer has {} group(s){}", kind(), key,
                i, g, groups_.size(), g < groups_.size() ? fmt::format(" and {} parameter(s) in that one", groups_[g].params.size()) : "");
    return {groups_[g].params[i], key.substr(used)};
  }
  /// Per-optimizer parts of state() and load_state(): add buffers and scalars; check a state
  /// before anything changes (required scalars; tensors are checked by load_state); take it.
  virtual void save_extra(OptimizerState& s) const = 0;
  /// Checks this optimizer's scalars in `s` before load_state changes anything.
  virtual void check_extra(const OptimizerState& s) const = 0;
  /// Whether `buffer` names one of this optimizer's per-parameter buffers ("exp_avg", "momentum_buffer", ...).
  virtual bool known_buffer(const std::string& buffer) const = 0;
  /// Takes this optimizer's buffers and scalars from a state that passed the checks.
  virtual void load_extra(const OptimizerState& s) = 0;

 protected:
  /// The parameter groups.
  std::vector<ParamGroup> groups_;
  /// The current learning rate.
  double lr_;
};

}  // namespace remat::optim
