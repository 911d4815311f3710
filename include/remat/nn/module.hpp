#pragma once
// nn::Module: owns named parameters and child modules, knows train/eval mode. Modules hold their
// parameters as members and register pointers to them, so a module is neither copied nor moved.

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "remat/core/tensor.hpp"

/// Neural-network layers and models on remat tensors, as torch.nn: Module, Linear, LayerNorm, GPT and more.
namespace remat::nn {

/// The base of every layer and model, as torch.nn.Module: owns no tensors itself but names the
/// parameters and children its subclass registers, and carries the training/eval mode. Not
/// copyable or movable (children and parameters are held by address).
class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  Module(Module&&) = delete;
  Module& operator=(Module&&) = delete;

  /// Parameters of this module and its children, named by path ("h.0.attn.c_attn.weight"), each
  /// tensor once even when shared (weight tying), in registration order.
  std::vector<std::pair<std::string, Tensor*>> named_parameters() {
    std::vector<std::pair<std::string, Tensor*>> out;
    collect("", out);
    return out;
  }
  /// The same parameters as named_parameters(), without their names.
  std::vector<Tensor*> parameters() {
    std::vector<Tensor*> out;
    for (auto& [name, p] : named_parameters()) out.push_back(p);
    return out;
  }
  /// The number of scalars in all parameters (each shared tensor counted once).
  std::int64_t num_parameters() {
    std::int64_t n = 0;
    for (Tensor* p : parameters()) n += p->numel();
    return n;
  }
  /// Clears the gradient of every parameter.
  void zero_grad() {
    for (Tensor* p : parameters()) p->zero_grad();
  }

  /// Training mode switches dropout on; eval switches it off. Applies to every child.
  void train(bool on = true) {
    training_ = on;
    for (auto& [name, child] : children_) child->train(on);
  }
  /// Eval mode (dropout off): train(false).
  void eval() { train(false); }
  /// Whether this module is in training mode (the default).
  bool is_training() const { return training_; }

 protected:
  /// Registers a member tensor as a parameter (it is made to require grad, and its bytes count in
  /// the memory books as a parameter's, apart from activations).
  Tensor& register_parameter(std::string name, Tensor& t) {
    if (t.defined() && !t.requires_grad()) t.requires_grad_();
    if (t.defined()) t.storage()->mark_parameter();
    params_.emplace_back(std::move(name), &t);
    return t;
  }
  /// Registers a member module as a child named `name` (its parameters become "name.…"); returns it.
  template <class M>
  M& register_module(std::string name, M& child) {
    children_.emplace_back(std::move(name), &child);
    return child;
  }

 private:
  void collect(const std::string& prefix, std::vector<std::pair<std::string, Tensor*>>& out) {
    for (auto& [name, p] : params_) {
      if (!p->defined()) continue;
      p->storage()->mark_parameter();  // a parameter assigned anew since registration
      bool seen = false;
      for (auto& [n, q] : out) seen = seen || q->same_storage(*p);
      if (!seen) out.emplace_back(prefix + name, p);
    }
    for (auto& [name, child] : children_) child->collect(prefix + name + ".", out);
  }

  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<std::pair<std::string, Module*>> children_;
  bool training_ = true;
};

/// A module mapping one tensor to one tensor: what Sequential chains and checkpoint wraps.
class UnaryModule : public Module {
 public:
  /// The module's computation on x.
  virtual Tensor forward(const Tensor& x) = 0;
  /// Calls forward(x).
  Tensor operator()(const Tensor& x) { return forward(x); }
};

}  // namespace remat::nn
