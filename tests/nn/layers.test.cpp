#include <cmath>

#include "support.hpp"

using namespace remat;

namespace {
/// Central differences in float for a few entries of one parameter; modules are float32, so the
/// tolerance is loose (a step of 1e-2 on O(1) values); every op inside is gradchecked in double.
void check_module_grad(const std::function<Tensor()>& loss_fn, Tensor& param, std::int64_t entries = 5) {
  param.zero_grad();
  loss_fn().backward();
  const Tensor analytic = param.grad().detach();
  for (std::int64_t j = 0; j < std::min(entries, param.numel()); ++j) {
    const std::int64_t i = (j * 7919) % param.numel();
    float* p = param.data() + i;
    const float saved = *p;
    const float eps = 1e-2f;
    float plus, minus;
    {
      no_grad guard;
      *p = saved + eps;
      plus = loss_fn().item();
      *p = saved - eps;
      minus = loss_fn().item();
      *p = saved;
    }
    const float numeric = (plus - minus) / (2 * eps);
    INFO("element " << i << " analytic " << analytic.data()[i] << " numeric " << numeric);
    CHECK(analytic.data()[i] == Approx(numeric).margin(2e-3).epsilon(2e-2));
  }
}
}  // namespace

TEST_CASE("nn layers: Linear, LayerNorm and Embedding compute their ops", "[nn][layers]") {
  Generator g(2);
  nn::Linear lin(4, 3, true, g);
  const Tensor x = randn({2, 4}, g);
  CHECK(test::all_close(lin(x), linear(x, lin.weight, lin.bias)));
  CHECK(lin.weight.shape() == Shape{3, 4});
  CHECK(detail::flat(lin.weight).abs().maxCoeff() <= 0.5f);  // U(-1/√4, 1/√4)
  nn::LayerNorm ln(4);
  CHECK(test::all_close(ln(x), layer_norm(x, ones({4}), zeros({4}))));
  nn::Embedding emb(5, 3, g);
  CHECK(emb(tensor<std::int64_t>({4, 0})).shape() == Shape{2, 3});
  REQUIRE_ERROR(nn::Linear(0, 3), "Linear", "positive");
}

TEST_CASE("nn layers: Dropout is the identity in eval mode", "[nn][layers]") {
  nn::Dropout drop(0.5);
  const Tensor x = ones({100});
  drop.eval();
  CHECK(drop(x).same_storage(x));
  drop.train();
  CHECK(detail::flat(drop(x)).minCoeff() == 0.f);
  REQUIRE_ERROR(nn::Dropout(2.0), "Dropout", "2");
}

TEST_CASE("attention: an output never depends on later positions", "[nn][attention]") {
  Generator g(3);
  nn::CausalSelfAttention attn(8, 2, 0.0, true, g);
  Tensor x = randn({1, 5, 8}, g);
  const Tensor before = attn(x).detach();
  for (std::int64_t c = 0; c < 8; ++c) x.at({0, 4, c}) += 10.f;  // change only the last position
  const Tensor after = attn(x).detach();
  for (std::int64_t t = 0; t < 4; ++t)
    for (std::int64_t c = 0; c < 8; ++c) CHECK(after.at({0, t, c}) == before.at({0, t, c}));
  CHECK(after.at({0, 4, 0}) != before.at({0, 4, 0}));
  REQUIRE_ERROR(attn(zeros({1, 5, 6})), "CausalSelfAttention", "(1, 5, 6)");
  REQUIRE_ERROR(nn::CausalSelfAttention(8, 3), "multiple");
}

TEST_CASE("transformer block: gradients of its parameters match finite differences", "[nn][block]") {
  Generator g(4);
  nn::TransformerBlock block(8, 2, 0.0, true, g);
  const Tensor x = randn({2, 4, 8}, g);
  const Tensor w = randn({2, 4, 8}, g);
  auto loss = [&] { return sum(block(x) * w); };
  check_module_grad(loss, block.attn.c_attn.weight);
  check_module_grad(loss, block.mlp.c_fc.bias);
  check_module_grad(loss, block.ln_1.weight);
  check_module_grad(loss, block.attn.c_proj.weight);
}

TEST_CASE("gpt: logits have shape (B, T, V) and the initial loss is about ln V", "[nn][gpt]") {
  Generator g(5);
  const nn::GPTConfig c = test::gpt_config(32, 16, 2, 2, 16);
  nn::GPT gpt(c, g);
  const LongTensor idx = randint(0, 32, {3, 16}, g), targets = randint(0, 32, {3, 16}, g);
  CHECK(gpt(idx).shape() == Shape{3, 16, 32});
  CHECK(gpt.loss(idx, targets).item() == Approx(std::log(32.0)).margin(0.1));
  REQUIRE_ERROR(gpt(randint(0, 32, {1, 17}, g)), "GPT", "17", "block_size 16");
  REQUIRE_ERROR(gpt(randint(0, 32, {16}, g)), "GPT", "(B, T)");
}

TEST_CASE("gpt: gradients reach every parameter and match finite differences", "[nn][gpt]") {
  Generator g(6);
  const nn::GPTConfig c = test::gpt_config(13, 6, 2, 2, 8, 0.0, /*tie_weights=*/true);
  nn::GPT gpt(c, g);
  const LongTensor idx = randint(0, 13, {2, 6}, g), targets = randint(0, 13, {2, 6}, g);
  gpt.loss(idx, targets).backward();
  for (auto& [name, p] : gpt.named_parameters()) {
    INFO(name);
    CHECK(p->grad().defined());
  }
  auto loss = [&] { return gpt.loss(idx, targets); };
  check_module_grad(loss, gpt.wte.weight, 8);  // tied: gets both the embedding and the head gradient
  check_module_grad(loss, gpt.wpe.weight);
  check_module_grad(loss, gpt.h[0]->attn.c_attn.weight);
}

TEST_CASE("gpt: generate appends sampled tokens, reproducibly for a seed", "[nn][gpt]") {
  Generator g(7);
  const nn::GPTConfig c = test::gpt_config(10, 4, 1, 1, 8);
  nn::GPT gpt(c, g);
  const LongTensor start = tensor<std::int64_t>({1, 2}, {1, 2});
  Generator s1(1), s2(1);
  const LongTensor a = gpt.generate(start, 6, 0.8, 3, s1);
  const LongTensor b = gpt.generate(start, 6, 0.8, 3, s2);
  CHECK(a.shape() == Shape{1, 8});
  CHECK(test::values(a) == test::values(b));
  for (std::int64_t v : a.to_vector()) CHECK((v >= 0 && v < 10));
  CHECK(gpt.is_training());
  REQUIRE_ERROR(gpt.generate(start, 1, 0.0), "temperature");
}
