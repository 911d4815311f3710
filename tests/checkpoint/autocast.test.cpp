// remat::autocast through checkpointing: a segment and a chain step replay under the autocast
// state their forward ran under, so with backward outside the autocast scope (PyTorch's pattern)
// the gradients are bitwise those of the run without checkpointing, dropout on.

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("autocast: a checkpointed GPT's gradients equal the plain run's bitwise, for every policy",
          "[checkpoint][autocast]") {
  test::GptStep step(nullptr);
  // The forward under autocast, the backward (run by the comparison) outside it.
  auto loss = [&] {
    autocast on;
    return step.loss();
  };
  for (const char* how : {"blocks", "selective", "sqrt", "binomial:2", "uniform:2"}) {
    INFO(how);
    const testing::GradientComparison r = testing::compare_checkpointing(step.gpt, policy::parse(how), loss, 7);
    INFO(r.message);
    CHECK(r.equal);
  }
  // And the runs were in bfloat16: the float32 run's loss differs.
  manual_seed(7);
  const float mixed = loss().item();
  manual_seed(7);
  const float fp32 = step.loss().item();
  CHECK(mixed != fp32);
}

TEST_CASE("autocast: a chain step under binomial replays in bfloat16 when backward runs in float32",
          "[chain][autocast]") {
  Generator init(41);
  nn::Linear lin(8, 8, true, init);
  const Tensor data = randn({3, 8}, init);
  std::vector<ChainStep> steps;
  for (int i = 0; i < 9; ++i) steps.push_back([&](const Tensor& x) { return tanh(dropout(lin(x), 0.2, true)); });
  auto run = [&](const std::optional<Policy>& p) {
    lin.zero_grad();
    Tensor x = data.detach().requires_grad_();
    Tensor y = x;
    {
      autocast on;
      if (p) y = checkpoint_sequential(steps, x, *p);
      else for (const ChainStep& s : steps) y = s(y);
    }
    sum(y * y).backward();
    return testing::RunRecord().grads(lin).grad("x", x);
  };
  for (const char* how : {"binomial:2", "sqrt", "uniform:3"}) {
    const Policy p = *policy::parse(how).schedule;
    INFO(how);
    CHECK_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(p); }, 5);
  }
}

TEST_CASE("autocast: a parameter is cast once per scope, and replays reuse the forward's copy", "[chain][autocast]") {
  Generator init(42);
  nn::Linear lin(8, 8, true, init);
  const Tensor data = randn({3, 8}, init);
  std::vector<ChainStep> steps;
  for (int i = 0; i < 9; ++i) steps.push_back([&](const Tensor& x) { return tanh(lin(x)); });
  const Policy binomial = *policy::parse("binomial:2").schedule;
  autocast on;
  Tensor y = checkpoint_sequential(steps, data, binomial);
  // One weight, nine products: narrowed once. (The inputs are not parameters: narrowed each time.)
  CHECK(autocast_cache_stats().casts == 1);
  CHECK(autocast_cache_stats().reuses == 8);
  CHECK(autocast_cache_stats().bytes == 8 * 8 * 2);
  sum(y).backward();
  // Binomial with 2 snapshots replays steps; every replay read the cached copy.
  CHECK(autocast_cache_stats().casts == 1);
  CHECK(autocast_cache_stats().reuses > 8);
}

TEST_CASE("autocast: a checkpointed segment's replay casts nothing again, the casts go with the step",
          "[checkpoint][autocast]") {
  auto casts = [](const char* how) {
    test::GptStep step(how);
    const std::size_t before = memory_stats().live_bytes;
    detail::AutocastCache::Stats stats;
    std::size_t during = 0;
    {
      autocast on;
      Tensor loss = step.loss();
      during = autocast_cache_stats().bytes;
      loss.backward();
      stats = autocast_cache_stats();
    }
    // The copies were in the books while the scope lived, and are gone with it (the gradients
    // of the parameters stay).
    CHECK(during > 0);
    std::size_t grads = 0;
    for (Tensor* p : step.gpt.parameters()) grads += p->grad().nbytes();
    CHECK(memory_stats().live_bytes == before + grads);
    return stats;
  };
  const detail::AutocastCache::Stats none = casts(nullptr), blocks = casts("blocks");
  CHECK(none.casts > 0);
  CHECK(blocks.casts == none.casts);    // the replays reused the forward's copies
  CHECK(blocks.reuses > none.reuses);   // and read them
  CHECK(blocks.bytes == none.bytes);
}

TEST_CASE("autocast: a parameter written in place inside a long scope is cast again", "[checkpoint][autocast]") {
  // Two SGD steps under one guard equal two steps each under its own: the second step's products
  // read the updated weights, not the first step's copies.
  auto train = [](bool one_scope) {
    test::GptStep step("blocks");
    optim::SGD opt(step.gpt.parameters(), {0.1});
    std::optional<autocast> outer;
    if (one_scope) outer.emplace();
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      Tensor loss;
      {
        autocast on;
        loss = step.loss();
      }
      loss.backward();
      opt.step();
    }
    testing::RunRecord r;
    for (auto& [name, p] : step.gpt.named_parameters()) r.tensor(name, *p);
    return r.grads(step.gpt);
  };
  CHECK_SAME_RUNS([&] { return train(false); }, [&] { return train(true); }, 7);
}

TEST_CASE("autocast: a parameter written in place between a checkpointed forward and its backward is an error",
          "[checkpoint][autocast][version]") {
  // The segment saves the weight's cached bfloat16 copy, not the weight; a replay would cast the
  // changed weight again and differ from the forward, so the weight's version is checked as in
  // float32. (Without checkpointing the node holds the copy and backward uses it, as PyTorch's.)
  Generator g(4);
  nn::Linear lin(4, 4, true, g);
  const Tensor x = randn({2, 4}, g).requires_grad_();
  for (const bool bump : {true, false}) {
    for (int mode = 1; mode < 3; ++mode) {
      INFO((mode == 1 ? "checkpoint" : "chain") << (bump ? ", weight written" : ", untouched"));
      Tensor y;
      {
        autocast on;
        if (mode == 1) y = checkpoint(lin, x);
        else y = checkpoint_sequential(std::vector<ChainStep>(3, [&](const Tensor& h) { return lin(h); }), x, policy::binomial(1));
      }
      if (bump) {
        lin.weight.data()[0] += 0.5f;
        REQUIRE_ERROR(sum(y).backward(), "modified in place", "(4, 4)");
      } else {
        sum(y).backward();
        CHECK(lin.weight.grad().defined());
      }
    }
  }
}

TEST_CASE("autocast: with the cast cache off, nothing is kept between a segment's forward and its replay",
          "[checkpoint][autocast]") {
  auto held = [](bool cache) {
    test::GptStep step("blocks");
    const std::size_t before = memory_stats().live_bytes;
    Tensor loss;
    std::size_t casts = 0;
    {
      autocast on(true, cache);
      loss = step.loss();
      casts = autocast_cache_stats().casts;
    }
    const std::size_t kept = memory_stats().live_bytes - before;
    loss.backward();
    return std::make_pair(kept, casts);
  };
  const auto [cached, cached_casts] = held(true);
  const auto [uncached, uncached_casts] = held(false);
  CHECK(cached_casts > 0);
  CHECK(uncached_casts == 0);  // no cache to count in
  // The cache keeps one bfloat16 copy of each parameter a product read, until the replays ran.
  CHECK(uncached < cached);
  // And the gradients are the same bits either way: a cast is a cast.
  auto grads = [](bool cache) {
    return [cache] {
      test::GptStep step("blocks");
      Tensor loss;
      {
        autocast on(true, cache);
        loss = step.loss();
      }
      loss.backward();
      return testing::RunRecord().grads(step.gpt);
    };
  };
  CHECK_SAME_RUNS(grads(true), grads(false), 3);
}
