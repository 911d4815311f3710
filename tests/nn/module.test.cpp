#include "support.hpp"

using namespace remat;

namespace {
nn::GPTConfig tiny_gpt(bool tie = false) {
  return test::gpt_config(11, 8, 2, 2, 8, 0.0, tie);
}
}  // namespace

TEST_CASE("module: parameters are named by path, as PyTorch names them", "[nn][module]") {
  Generator g(0);
  nn::GPT gpt(tiny_gpt(), g);
  std::vector<std::string> names;
  for (auto& [name, p] : gpt.named_parameters()) names.push_back(name);
  CHECK(names.front() == "transformer.wte.weight");
  CHECK(std::find(names.begin(), names.end(), "transformer.h.1.attn.c_attn.weight") != names.end());
  CHECK(std::find(names.begin(), names.end(), "transformer.h.0.mlp.c_proj.bias") != names.end());
  CHECK(names.back() == "lm_head.weight");
  // 2 embeddings, per block (2 LN × 2 + 4 linear × 2), final LN × 2, head.
  CHECK(names.size() == 2 + 2 * (4 + 8) + 2 + 1);
  const std::int64_t C = 8, V = 11, T = 8;
  const std::int64_t per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C);
  CHECK(gpt.num_parameters() == V * C + T * C + 2 * per_block + 2 * C + V * C);
}

TEST_CASE("module: tied weights are one parameter listed once", "[nn][module]") {
  Generator g(0);
  nn::GPT gpt(tiny_gpt(true), g);
  CHECK(gpt.lm_head.weight.same_storage(gpt.wte.weight));
  std::size_t heads = 0;
  for (auto& [name, p] : gpt.named_parameters()) heads += name == "lm_head.weight";
  CHECK(heads == 0);
}

TEST_CASE("module: train and eval reach every child", "[nn][module]") {
  Generator g(0);
  nn::GPT gpt(tiny_gpt(), g);
  gpt.eval();
  CHECK_FALSE(gpt.h[1]->attn.attn_dropout.is_training());
  gpt.train();
  CHECK(gpt.h[1]->mlp.drop.is_training());
}

TEST_CASE("sequential: runs its modules in order, named by index", "[nn][sequential]") {
  Generator g(1);
  nn::Sequential seq;
  auto& first = seq.emplace_back<nn::Linear>(3, 4, true, g);
  seq.emplace_back<nn::Linear>(4, 2, false, g);
  const Tensor x = randn({5, 3}, g);
  const Tensor y = seq(x);
  CHECK(test::all_close(y, linear(linear(x, first.weight, first.bias), seq.named_parameters()[2].second->detach())));
  CHECK(seq.named_parameters()[0].first == "0.weight");
  CHECK(seq.named_parameters()[2].first == "1.weight");
  REQUIRE_ERROR(seq[2], "Sequential", "index 2");
}
