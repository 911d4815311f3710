// Every generator a segment draws from is restored on replay, not only the thread's default one:
// a user's own Generator inside checkpoint(), inside a chain step and under a MemoryBudget gives
// the gradients of the plain run, bit for bit, and leaves the generator where the plain run does.

#include "checkpoint/support_checkpoint.hpp"

namespace remat {
namespace {

Tensor weights(std::int64_t n) {
  Tensor w = randn({n, n}) * 0.5f;
  w.requires_grad_();
  return w;
}

/// `segment(x)` when plain, `checkpoint(segment, x)` when checkpointed (held by reference: the
/// segment must outlive the backward).
template <class Segment>
Tensor maybe_checkpointed(bool checkpointed, Segment& segment, const Tensor& x) {
  return checkpointed ? checkpoint(segment, x) : segment(x);
}

/// REQUIREs that `run(false)` (plain) and `run(true)` (checkpointed), each from default generator
/// seed `seed`, record the same: the gradients bitwise (each must have arrived), the generator
/// states exactly.
template <class Run>
void require_replays_like_plain(std::uint64_t seed, Run run) {
  REQUIRE_SAME_RUNS([&] { return run(false); }, [&] { return run(true); }, seed);
}

TEST_CASE("generators: a user generator drawn from inside checkpoint() is restored for the replay",
          "[checkpoint][generators]") {
  // The repro: a user generator drawn from inside the segment and again after it.
  require_replays_like_plain(3, [](bool checkpointed) {
    Tensor w = weights(16);
    Generator mine(42);
    auto segment = [&](const Tensor& a) { return tanh(dropout(a * 2.0f, 0.5, true, mine)); };
    Tensor h = maybe_checkpointed(checkpointed, segment, w);
    sum(h * dropout(ones({16, 16}), 0.5, true, mine)).backward();
    // The replay put the generator back: what the caller draws after backward is unchanged.
    return testing::RunRecord().grad("w", w).state("mine", mine.state());
  });
}

TEST_CASE("generators: nested segments and the fused ops restore every generator they draw from",
          "[checkpoint][generators]") {
  require_replays_like_plain(5, [](bool checkpointed) {
    Tensor w = weights(12);
    Generator a(7), b(8);
    auto inner = [&](const Tensor& x) { return dropout_add(tanh(x), x, 0.25, true, b); };
    auto outer = [&](const Tensor& x) {
      Tensor y = dropout(x, 0.5, true, a);
      y = maybe_checkpointed(checkpointed, inner, y);
      return sigmoid(dropout(y, 0.3) * 1.5f);  // and the default generator
    };
    Tensor h = maybe_checkpointed(checkpointed, outer, w);
    sum(h * dropout(ones({12, 12}), 0.5, true, b)).backward();
    return testing::RunRecord().grad("w", w).state("a", a.state()).state("b", b.state())
        .state("the default generator", default_generator().state());
  });
}

TEST_CASE("generators: the attention's dropout draws from a user generator and replays it",
          "[checkpoint][generators]") {
  require_replays_like_plain(11, [](bool checkpointed) {
    Tensor qkv = randn({2, 8, 3 * 8}) * 0.5f;
    qkv.requires_grad_();
    Generator mine(99);
    auto attend = [&](const Tensor& x) { return causal_self_attention(x, 2, 0.2, true, mine); };
    Tensor y = maybe_checkpointed(checkpointed, attend, qkv);
    sum(y * y).backward();
    return testing::RunRecord().grad("qkv", qkv).state("mine", mine.state());
  });
}

TEST_CASE("generators: a chain step drawing from a user generator replays it under every policy",
          "[checkpoint][generators][chain]") {
  constexpr std::int64_t kSteps = 24;
  auto run = [](const std::optional<Policy>& policy) {
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
    return testing::RunRecord().grad("w", w).state("mine", mine.state());
  };
  // budget measures every step before planning: measuring must not move the generator either.
  for (const Policy& p : {policy::none(), policy::uniform(4), policy::sqrt_segments(), policy::binomial(3),
                          policy::budget(std::size_t{4096})}) {
    INFO(p.name);
    REQUIRE_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(p); }, 13);
  }
}

TEST_CASE("generators: a MemoryBudget's recomputation of a dropout draws the mask of the first run",
          "[checkpoint][generators][memory_budget]") {
  auto run = [](std::optional<std::size_t> budget) {
    test::FreshTape fresh;
    Tensor w = weights(32);
    Tensor x = randn({16, 32});
    Generator mine(5);
    std::optional<MemoryBudget> guard;
    if (budget) guard.emplace(*budget);
    Tensor h = x;
    for (int layer = 0; layer < 6; ++layer) h = tanh(dropout(matmul(h, w), 0.25, true, mine));
    sum(h).backward();
    if (guard) REQUIRE(guard->last_log().recomputes > 0);  // the budget did recompute
    return testing::RunRecord().grad("w", w).state("mine", mine.state());
  };
  REQUIRE_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(std::size_t{6 * 16 * 32 * sizeof(float)}); },
                    17);
}

TEST_CASE("generators: a generator the segment owns, or makes, replays, one gone before backward is skipped",
          "[checkpoint][generators]") {
  require_replays_like_plain(19, [](bool checkpointed) {
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
    Tensor h = maybe_checkpointed(checkpointed, owning, w) + maybe_checkpointed(checkpointed, making, w) +
               maybe_checkpointed(checkpointed, dead_later, w);
    first.reset();
    current = &second;
    sum(h * h).backward();
    return testing::RunRecord().grad("w", w);
  });
}

TEST_CASE("generators: a copy draws on its own, assignment copies the state, not the identity",
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
