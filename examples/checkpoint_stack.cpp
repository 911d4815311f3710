// The mission in one file, and README's first example: a stack of Transformer blocks, each block
// in a checkpoint scope, dropout on; the same step with and without checkpointing gives bitwise
// the same loss and gradients, and checkpointing keeps a fraction of the activations.
#include <remat/remat.hpp>
#include <remat/testing/compare.hpp>

using namespace remat;

struct Stack : nn::Module {
  Stack(int layers, std::int64_t width, std::int64_t heads) {
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(std::make_unique<nn::TransformerBlock>(width, heads, /*dropout=*/0.1));
      register_module(std::to_string(i), *blocks.back());
    }
  }
  Tensor loss(const Tensor& x, bool checkpointed) {
    Tensor h = x;                                                    // (B, T, C)
    for (auto& block : blocks) h = checkpointed ? checkpoint(*block, h) : (*block)(h);
    return mean(h * h);
  }
  std::vector<std::unique_ptr<nn::TransformerBlock>> blocks;
};

int main() {
  manual_seed(0);
  Stack model(/*layers=*/6, /*width=*/64, /*heads=*/4);
  const Tensor x = randn({8, 32, 64});                               // (B, T, C)
  std::size_t saved[2] = {0, 0};
  auto step = [&](bool checkpointed) {
    MemoryScope scope;
    Tensor loss = model.loss(x, checkpointed);
    saved[checkpointed] = memory_stats().saved_bytes - scope.start_saved_bytes();
    return loss;
  };
  const testing::GradientComparison r =
      testing::compare_gradients(model, [&] { return step(false); }, [&] { return step(true); });
  fmt::print("{}\nsaved for backward after forward: {} bytes without checkpointing, {} with\n", r.message, saved[0],
             saved[1]);
  return r.equal ? 0 : 1;
}
