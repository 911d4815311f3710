// SaveInBFloat16 (core/save_bfloat16.hpp): float32 activations saved for backward kept in
// bfloat16, parameters and inputs left alone (the pack declines them), and what that costs in
// gradient accuracy and saves in bytes.

#include <cmath>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("SaveInBFloat16: backward reads the bfloat16 rounding of what the forward saved", "[hooks][bf16]") {
  Generator g(51);
  Tensor x = randn({64}, g).requires_grad_();
  Tensor y;
  SaveInBFloat16::Stats stats;
  {
    SaveInBFloat16 scope;
    y = tanh(x * 1.5f);  // mul by a number saves nothing; tanh saves its output, made in the scope
    stats = scope.stats();
  }
  CHECK(stats.packed == 1);
  CHECK(stats.float32_bytes == 64 * 4);
  y.backward(ones_like(y));
  // dx = 1.5 (1 − r(y)²), r the rounding to bfloat16: in double from the rounded outputs.
  const std::vector<float> yv = y.to_vector(), gx = x.grad().to_vector();
  int moved = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) {
    const double r = detail::to_float(detail::to_bfloat16(yv[i]));
    const double want = 1.5 * (1.0 - r * r), exact = 1.5 * (1.0 - double(yv[i]) * yv[i]);
    INFO("element " << i);
    REQUIRE(std::abs(gx[i] - want) <= 1e-6 * std::abs(want) + 1e-7);
    moved += std::abs(want - exact) > 1e-6 * std::abs(exact);
  }
  CHECK(moved > 0);  // and the rounding did move some of them
}

TEST_CASE("SaveInBFloat16: parameters and inputs stay with their nodes, in the books", "[hooks][bf16]") {
  Generator g(52);
  Tensor x = randn({16, 8}, g), w = randn({8, 4}, g).requires_grad_();
  const std::size_t before = memory_stats().saved_bytes;
  SaveInBFloat16 scope;
  Tensor y = matmul(x, w);  // saves x (made before the scope): declined
  CHECK(scope.stats().packed == 0);
  CHECK(scope.stats().kept == 1);
  CHECK(memory_stats().saved_bytes - before == 16 * 8 * 4);
  Tensor z = tanh(y);  // its output is made inside: rounded, out of the books (live bytes hold it)
  CHECK(scope.stats().packed == 1);
  CHECK(memory_stats().saved_bytes - before == 16 * 8 * 4);
  sum(z).backward();
  CHECK(memory_stats().saved_bytes == before);
}

TEST_CASE("SaveInBFloat16: a checkpointed GPT keeps its boundaries in half the bytes, gradients near float32's",
          "[hooks][bf16][checkpoint]") {
  auto step = [](bool rounded) {
    test::GptStep s("blocks");
    manual_seed(9);
    const std::size_t base = memory_stats().live_bytes;
    reset_peak_memory_stats();
    Tensor loss;
    {
      std::optional<SaveInBFloat16> scope;
      if (rounded) scope.emplace();
      loss = s.loss();
    }
    const std::size_t held = memory_stats().live_bytes - base;  // what the graph keeps for backward
    loss.backward();
    std::vector<std::vector<float>> grads;
    for (Tensor* p : s.gpt.parameters()) grads.push_back(p->grad().to_vector());
    return std::make_pair(held, grads);
  };
  const auto [plain_held, plain] = step(false);
  const auto [held, rounded] = step(true);
  CHECK(held < plain_held);
  // Every parameter's gradient within a few bfloat16 roundings of float32's, norm-wise.
  double worst = 0;
  for (std::size_t i = 0; i < plain.size(); ++i) {
    double diff = 0, norm = 0;
    for (std::size_t j = 0; j < plain[i].size(); ++j) {
      diff += std::pow(double(rounded[i][j]) - plain[i][j], 2);
      norm += std::pow(double(plain[i][j]), 2);
    }
    if (norm > 0) worst = std::max(worst, std::sqrt(diff / norm));
  }
  INFO("worst relative gradient error " << worst);
  CHECK(worst > 0);
  CHECK(worst < 0.02);
}
