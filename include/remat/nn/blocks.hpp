#pragma once
// A stack of blocks, run one after another — unless the caller installs another way to run them.
// Models carry no memory policy: a model that runs blocks exposes them as a BlockStack, and
// checkpointing (remat::apply_checkpointing) or anything else that wants to run the stack
// differently installs a BlockRunner from outside.

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/tensor.hpp"

namespace remat::nn {

/// One block as a function of the stream it transforms, x -> f(x).
using Block = std::function<Tensor(const Tensor&)>;
/// Runs `blocks` on x and returns the result.
using BlockRunner = std::function<Tensor(const std::vector<Block>& blocks, const Tensor& x)>;

/// The default runner: each block on the previous one's output.
inline Tensor run_in_order(const std::vector<Block>& blocks, const Tensor& x) {
  Tensor h = x;
  for (const Block& f : blocks) h = f(h);
  return h;
}

/// Wraps block `index` before any runner sees it: what must surround a block wherever a runner
/// calls it (a sharded data-parallel wrapper gathers the block's parameters around it, inside a
/// checkpoint's segment and its replay alike).
using BlockWrapper = std::function<Block(std::size_t index, Block block)>;

/// Implemented by models whose core is a stack of blocks (GPT, Sequential).
class BlockStack {
 public:
  virtual ~BlockStack() = default;
  /// The blocks in order, as callables that refer to the model's own modules.
  virtual std::vector<Block> blocks() = 0;
  /// How run_blocks runs them from now on; an empty runner restores run_in_order.
  void set_block_runner(BlockRunner runner) { runner_ = std::move(runner); }
  /// The runner installed by set_block_runner (empty: run_in_order).
  const BlockRunner& block_runner() const { return runner_; }

  /// Wraps every block run_blocks runs from now on; an empty wrapper removes it. One at a time: a
  /// second wrapper while one is installed is an error.
  void set_block_wrapper(BlockWrapper wrapper) {
    REMAT_CHECK(!wrapper || !wrapper_, "BlockStack::set_block_wrapper: a wrapper is already installed (one wrapper "
                                       "per model: remove it with an empty one first)");
    wrapper_ = std::move(wrapper);
  }

  /// Whether a wrapper is installed.
  bool has_block_wrapper() const { return static_cast<bool>(wrapper_); }

  /// Runs blocks() on x through the installed runner, or in order when there is none.
  Tensor run_blocks(const Tensor& x) {
    std::vector<Block> stack = blocks();
    if (wrapper_)
      for (std::size_t i = 0; i < stack.size(); ++i) stack[i] = wrapper_(i, std::move(stack[i]));
    return runner_ ? runner_(stack, x) : run_in_order(stack, x);
  }

 private:
  BlockRunner runner_;
  BlockWrapper wrapper_;
};

}  // namespace remat::nn
