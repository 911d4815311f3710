#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("checkpoint memory: a GPT with every block checkpointed saves exactly the predicted bytes", "[checkpoint][memory]") {
  test::FreshTape fresh;
  const std::int64_t B = 2, T = 12, C = 16, V = 23, L = 4;
  Generator init(13);
  nn::GPT gpt(test::small_gpt(L, 0.1), init);
  const LongTensor idx = randint(0, V, {B, T}, init), targets = randint(0, V, {B, T}, init);
  const std::size_t f = sizeof(float), i64 = sizeof(std::int64_t);

  // One block's activations, recorded normally: the most a replay adds during backward.
  std::size_t block_bytes = 0;
  {
    test::FreshTape probe_tape;  // dropped with its nodes at the end of the scope
    const std::size_t before = memory_stats().saved_bytes;
    const Tensor probe = gpt.h[0]->forward(randn({B, T, C}, init).requires_grad_());
    block_bytes = memory_stats().saved_bytes - before;
  }

  apply_checkpointing(gpt, Checkpointing::each_block());
  const std::size_t start = memory_stats().saved_bytes;
  MemoryScope scope;
  Tensor loss = gpt.loss(idx, targets);
  const std::size_t at_forward_end = memory_stats().saved_bytes - start;
  const std::size_t boundary = static_cast<std::size_t>(L * B * T * C) * f;  // each block's input
  const std::size_t rest = static_cast<std::size_t>(B * T) * i64 + static_cast<std::size_t>(T) * i64  // wte, wpe ids
                           + static_cast<std::size_t>(B * T * C) * f + static_cast<std::size_t>(2 * B * T + C) * f  // ln_f: x, mean, rstd, weight
                           + static_cast<std::size_t>(V * C + B * T * C) * f  // lm_head: weight and its input
                           + static_cast<std::size_t>(B * T * V) * f + static_cast<std::size_t>(B * T) * i64;  // cross_entropy
  CHECK(at_forward_end == boundary + rest);
  CHECK(saved_tensors(fresh.tape).total_bytes == at_forward_end);

  loss.backward();
  const std::size_t peak_during_backward = scope.peak_saved_bytes() - start;
  CHECK(peak_during_backward > at_forward_end);  // a replay did hold activations
  CHECK(peak_during_backward <= at_forward_end + block_bytes);
  CHECK(memory_stats().saved_bytes == start);

  // Without checkpointing the tape holds every block's activations.
  apply_checkpointing(gpt, Checkpointing::none());
  gpt.zero_grad();
  Tensor full = gpt.loss(idx, targets);
  const std::size_t plain = memory_stats().saved_bytes - start;
  CHECK(plain > at_forward_end + (L - 1) * block_bytes / 2);
}
