#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("selective checkpointing: keeping matmul outputs gives bitwise-identical gradients", "[checkpoint][selective]") {
  Generator init(11);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  const SavePolicy linears = [](const OpOutput& out) { return out.op == op::linear; };
  for (const Checkpointing& how : {Checkpointing::each_block(save_policy::matmuls(), "matmuls"),
                                   Checkpointing::each_block(save_policy::ops({"softmax", "gelu"}), "softmax, gelu"),
                                   Checkpointing::each_block(linears, "linear")})
    test::check_checkpointing(gpt, how, [&] { return gpt.loss(idx, targets); }, 3);
}

TEST_CASE("selective checkpointing: kept outputs are exactly what is saved on top of the boundary", "[checkpoint][selective]") {
  test::FreshTape fresh;
  Generator init(12);
  const std::int64_t B = 2, T = 6, C = 16, H = 2;
  nn::TransformerBlock block(C, H, 0.0, true, init);
  const Tensor x = randn({B, T, C}, init);
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y = checkpoint(CheckpointOptions{"block", false, save_policy::matmuls()}, block, x);
  // Kept: c_attn (B,T,3C), attn c_proj (B,T,C), c_fc (B,T,4C), mlp c_proj (B,T,C); the fused
  // attention core is no matmul and is recomputed.
  const std::size_t kept = sizeof(float) * static_cast<std::size_t>(B * T * (3 * C + C + 4 * C + C));
  CHECK(memory_stats().saved_bytes - before == x.nbytes() + kept);
  sum(y).backward();
  CHECK(memory_stats().saved_bytes == before);

  // With the explicit attention ops, q kᵀ (B,H,T,T) and att v (B,H,T,C/H) are matmuls and kept too.
  block.attn.fused = false;
  Tensor z = checkpoint(CheckpointOptions{"block", false, save_policy::matmuls()}, block, x);
  CHECK(memory_stats().saved_bytes - before == x.nbytes() + kept + sizeof(float) * static_cast<std::size_t>(B * H * T * T + B * T * C));
  sum(z).backward();
}

TEST_CASE("selective checkpointing: a replay that asks for other kept ops throws", "[checkpoint][selective][misuse]") {
  int call = 0;
  auto fn = [&](const Tensor& x) { return ++call == 1 ? exp(x) : exp(narrow(x, 0, 0, 1)); };
  Tensor x = randn({2, 2}).requires_grad_();
  Tensor y = checkpoint(CheckpointOptions{"sel", false, save_policy::ops({"exp"})}, fn, x);
  REQUIRE_ERROR(sum(y).backward(), "sel", "exp", "(1, 2)", "(2, 2)");
}
