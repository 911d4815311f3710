// Every generator a segment draws from is restored on replay, not only the thread's default one:
// a user's own Generator inside checkpoint(), inside a chain step and under a MemoryBudget gives
// the gradients of the plain run, bit for bit, and leaves the generator where the plain run does.

#include "checkpoint/support_checkpoint.hpp"

#include <cstring>

namespace remat {
namespace {

Tensor weights(std::int64_t n) {
  Tensor w = randn({n, n}) * 0.5f;
  w.requires_grad_();
  return w;
}

/// Bitwise equality of two gradients (flat index of the first difference in the failure message).
void require_bitwise(const Tensor& a, const Tensor& b) {
  REQUIRE(a.defined());
  REQUIRE(b.defined());
  REQUIRE(a.shape() == b.shape());
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) differ += std::memcmp(a.data() + i, b.data() + i, sizeof(float)) != 0;
  INFO(differ << " of " << a.numel() << " elements differ");
  REQUIRE(differ == 0);
}

/// What a run leaves: the weight's gradient and the user generator's state after backward.
struct Run {
  Tensor grad;
  Generator::State after;
};

/// The repro: a user generator drawn from inside the segment and again after it.
Run segment_with_user_generator(bool checkpointed) {
  manual_seed(3);
  Tensor w = weights(16);
  Generator mine(42);
  auto segment = [&](const Tensor& a) { return tanh(dropout(a * 2.0f, 0.5, true, mine)); };
  Tensor h = checkpointed ? checkpoint(segment, w) : segment(w);
  Tensor loss = sum(h * dropout(ones({16, 16}), 0.5, true, mine));
  loss.backward();
  return {detail::copy_of(w.grad()), mine.state()};
}

TEST_CASE("generators: a user generator drawn from inside checkpoint() is restored for the replay",
          "[checkpoint][generators]") {
  const Run plain = segment_with_user_generator(false);
  const Run ckpt = segment_with_user_generator(true);
  require_bitwise(plain.grad, ckpt.grad);
  // The replay put the generator back: what the caller draws after backward is unchanged.
  REQUIRE(plain.after == ckpt.after);
}

TEST_CASE("generators: nested segments and the fused ops restore every generator they draw from",
          "[checkpoint][generators]") {
  auto run = [](bool checkpointed) {
    manual_seed(5);
    Tensor w = weights(12);
    Generator a(7), b(8);
    auto inner = [&](const Tensor& x) { return dropout_add(tanh(x), x, 0.25, true, b); };
    auto outer = [&](const Tensor& x) {
      Tensor y = dropout(x, 0.5, true, a);
      y = checkpointed ? checkpoint(inner, y) : inner(y);
      return sigmoid(dropout(y, 0.3) * 1.5f);  // and the default generator
    };
    Tensor h = checkpointed ? checkpoint(outer, w) : outer(w);
    sum(h * dropout(ones({12, 12}), 0.5, true, b)).backward();
    return std::make_tuple(detail::copy_of(w.grad()), a.state(), b.state(), default_generator().state());
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  require_bitwise(std::get<0>(plain), std::get<0>(ckpt));
  REQUIRE(std::get<1>(plain) == std::get<1>(ckpt));
  REQUIRE(std::get<2>(plain) == std::get<2>(ckpt));
  REQUIRE(std::get<3>(plain) == std::get<3>(ckpt));
}

TEST_CASE("generators: the attention's dropout draws from a user generator and replays it",
          "[checkpoint][generators]") {
  auto run = [](bool checkpointed) {
    manual_seed(11);
    Tensor qkv = randn({2, 8, 3 * 8}) * 0.5f;
    qkv.requires_grad_();
    Generator mine(99);
    auto attend = [&](const Tensor& x) { return causal_self_attention(x, 2, 0.2, true, mine); };
    Tensor y = checkpointed ? checkpoint(attend, qkv) : attend(qkv);
    sum(y * y).backward();
    return std::make_pair(detail::copy_of(qkv.grad()), mine.state());
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  require_bitwise(plain.first, ckpt.first);
  REQUIRE(plain.second == ckpt.second);
}

TEST_CASE("generators: a chain step drawing from a user generator replays it under every policy",
          "[checkpoint][generators][chain]") {
  constexpr std::int64_t kSteps = 24;
  auto run = [](const std::optional<Policy>& policy) {
    manual_seed(13);
    Tensor w = weights(8);
    Tensor x0 = randn({4, 8});
    Generator mine(2024);
    std::vector<ChainStep> steps(kSteps, [&](const Tensor& h) { return tanh(dropout(matmul(h, w), 0.2, true, mine)); });
    Tensor h = x0;
    if (policy) {
      h = checkpoint_sequential(steps, x0, *policy);
    } else {
      for (const ChainStep& s : steps) h = s(h);
    }
    sum(h).backward();
    return std::make_pair(detail::copy_of(w.grad()), mine.state());
  };
  const auto plain = run(std::nullopt);
  // budget measures every step before planning: measuring must not move the generator either.
  for (const Policy& p : {policy::none(), policy::uniform(4), policy::sqrt_segments(), policy::binomial(3),
                          policy::budget(std::size_t{4096})}) {
    INFO(p.name);
    const auto chained = run(p);
    require_bitwise(plain.first, chained.first);
    REQUIRE(plain.second == chained.second);
  }
}

TEST_CASE("generators: a MemoryBudget's recomputation of a dropout draws the mask of the first run",
          "[checkpoint][generators][memory_budget]") {
  auto run = [](std::optional<std::size_t> budget) {
    test::FreshTape fresh;
    manual_seed(17);
    Tensor w = weights(32);
    Tensor x = randn({16, 32});
    Generator mine(5);
    std::optional<MemoryBudget> guard;
    if (budget) guard.emplace(*budget);
    Tensor h = x;
    for (int layer = 0; layer < 6; ++layer) h = tanh(dropout(matmul(h, w), 0.25, true, mine));
    sum(h).backward();
    const std::size_t recomputes = guard ? guard->last_log().recomputes : 0;
    return std::make_tuple(detail::copy_of(w.grad()), mine.state(), recomputes);
  };
  const auto plain = run(std::nullopt);
  const auto budgeted = run(std::size_t{10 * 16 * 32 * sizeof(float)});
  REQUIRE(std::get<2>(budgeted) > 0);  // the budget did recompute
  require_bitwise(std::get<0>(plain), std::get<0>(budgeted));
  REQUIRE(std::get<1>(plain) == std::get<1>(budgeted));
}

TEST_CASE("generators: a generator the segment owns, or makes, replays; one gone before backward is skipped",
          "[checkpoint][generators]") {
  auto run = [](bool checkpointed) {
    manual_seed(19);
    Tensor w = weights(8);
    // Held by the segment's function (a copy of it, so a generator of its own): restored.
    auto owning = [g = Generator(123)](const Tensor& a) mutable { return tanh(dropout(a, 0.5, true, g)); };
    // Made by each run afresh, at the same state: nothing to restore.
    auto making = [](const Tensor& a) {
      Generator local(321);
      return sigmoid(dropout(a, 0.5, true, local));
    };
    // Drawn from in forward, destroyed before backward; the replay draws from another generator at
    // the same start. Restoring must skip the dead one (AddressSanitizer watches).
    auto first = std::make_unique<Generator>(77);
    Generator second(77);
    Generator* current = first.get();
    auto dead_later = [&current](const Tensor& a) { return dropout(a, 0.5, true, *current) * 3.0f; };
    Tensor h = checkpointed ? checkpoint(owning, w) + checkpoint(making, w) + checkpoint(dead_later, w)
                            : owning(w) + making(w) + dead_later(w);
    first.reset();
    current = &second;
    sum(h * h).backward();
    return detail::copy_of(w.grad());
  };
  require_bitwise(run(false), run(true));
}

TEST_CASE("generators: a copy draws on its own; assignment copies the state, not the identity",
          "[core][generators]") {
  Generator a(1);
  Generator b = a;
  const auto first = a.next_block();
  REQUIRE(b.next_block() == first);  // same state, separate streams
  REQUIRE(a.state() == b.state());
  a.next_block();
  REQUIRE(a.state() != b.state());
  b = a;
  REQUIRE(a.state() == b.state());
  b.next_block();
  REQUIRE(a.state() != b.state());
}

}  // namespace
}  // namespace remat
