#pragma once
#include <memory>
#include <string>
#include <vector>

#include "remat/nn/blocks.hpp"
#include "remat/nn/module.hpp"

namespace remat::nn {

/// Runs its modules in order; children are named "0", "1", ... as in torch.nn.Sequential. Its
/// modules are its blocks: remat::apply_checkpointing(seq, ...) checkpoints them.
class Sequential : public UnaryModule, public BlockStack {
 public:
  Sequential() = default;

  /// Constructs a module in place at the end and returns it.
  template <class M, class... Args>
  M& emplace_back(Args&&... args) {
    auto m = std::make_unique<M>(std::forward<Args>(args)...);
    M& ref = *m;
    push_back(std::move(m));
    return ref;
  }
  /// Appends a module (not null); it becomes the child named by its index.
  void push_back(std::unique_ptr<UnaryModule> m) {
    REMAT_CHECK(m != nullptr, "nn::Sequential: cannot add a null module");
    register_module(std::to_string(modules_.size()), *m);
    modules_.push_back(std::move(m));
  }

  /// The modules in order on x, through run_blocks (so an installed runner applies).
  Tensor forward(const Tensor& x) override { return run_blocks(x); }

  std::vector<Block> blocks() override {
    std::vector<Block> out;
    for (auto& m : modules_) out.push_back([module = m.get()](const Tensor& x) { return module->forward(x); });
    return out;
  }

  /// The number of modules.
  std::size_t size() const { return modules_.size(); }
  /// The i-th module; throws remat::Error when i is out of range.
  UnaryModule& operator[](std::size_t i) {
    REMAT_CHECK(i < modules_.size(), "nn::Sequential: index {} is out of range for {} modules", i, modules_.size());
    return *modules_[i];
  }

 private:
  std::vector<std::unique_ptr<UnaryModule>> modules_;
};

}  // namespace remat::nn
