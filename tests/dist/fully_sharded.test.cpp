// Fully sharded data parallel (ZeRO-3), run by every rank (1, 2, 3 and 4 ranks in CTest): against
// one process accumulating the ranks' micro-batches in rank order, bitwise, under checkpointing
// policies; the all-gathers a step costs; a sharded parameter read outside its unit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <remat/remat.hpp>
#include <remat/dist/data_parallel.hpp>
#include <remat/dist/fully_sharded.hpp>
#include <remat/dist/fully_sharded_adamw.hpp>
#include <remat/dist/sharded_adamw.hpp>
#include <remat/nn/gpt.hpp>
#include <remat/nn/sequential.hpp>

#include "dist/support_dist.hpp"
#include "dist/trajectory.hpp"

namespace remat::test {
namespace {

/// What the all-gathers of a run were: per step, per unit, in forward and backward; per step, how
/// many of them were prefetched; prefetches dropped unused.
struct Gathers {
  std::vector<std::vector<std::int64_t>> per_unit;
  std::vector<std::int64_t> prefetched;
  std::int64_t unused = 0;
};

/// Prefetches started as soon as the order names a block, however much is here.
dist::FullyShardedOptions unbounded_prefetch() {
  dist::FullyShardedOptions o;
  o.prefetch_within_two_units = false;
  return o;
}

/// N ranks under ZeRO-3: rank r runs micro-batch r of each step under `policy`. `mixed`: each
/// forward under remat::autocast (backward outside it); `cfg`: the GPT (tiny_gpt() by default).
Trajectory fully_sharded(const std::string& policy, int steps, Gathers* gathers = nullptr, bool mixed = false,
                         dist::FullyShardedOptions options = {}, const nn::GPTConfig& cfg = tiny_gpt()) {
  dist::Context& ctx = world();
  Generator init(5);
  nn::GPT model(cfg, init);
  apply_checkpointing(model, policy::parse(policy));
  dist::FullyShardedDataParallel fsdp(ctx, model, options);
  dist::FullyShardedAdamW opt(fsdp, gpt_groups(model), kAdamW);
  Trajectory out;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int64_t> before;
    std::int64_t prefetched_before = 0;
    for (const dist::ShardedUnit& u : fsdp.units()) {
      before.push_back(u.gathers);
      prefetched_before += u.prefetched;
    }
    micro_batch_loss(model, step, ctx.rank(), mixed).backward();
    if (gathers) {
      gathers->per_unit.emplace_back();
      std::int64_t prefetched = 0;
      for (std::size_t u = 0; u < before.size(); ++u) {
        gathers->per_unit.back().push_back(fsdp.units()[u].gathers - before[u]);
        prefetched += fsdp.units()[u].prefetched;
      }
      gathers->prefetched.push_back(prefetched - prefetched_before);
      gathers->unused = fsdp.unused_prefetches();
    }
    fsdp.gather_gradients();
    out.grads.push_back(copies(model.parameters(), true));
    opt.step();
    opt.zero_grad();
  }
  auto whole = fsdp.full_parameters();
  out.weights = copies(model.parameters(), false);
  return out;
}

TEST_CASE("dist: ZeRO-3 gives the gradients and weights of one process accumulating the ranks' micro-batches, "
          "bitwise, under every checkpointing policy", "[dist][fsdp]") {
  const int steps = 3;
  const Trajectory expected = reference(world().world_size(), steps);
  for (const std::string policy : {"none", "blocks", "selective", "binomial:3", "uniform:2", "sqrt"}) {
    INFO("policy " << policy);
    check_same_trajectory(fully_sharded(policy, steps), expected, steps);
  }
  dist::FullyShardedOptions no_prefetch;
  no_prefetch.prefetch = false;
  for (const std::string policy : {"none", "blocks"}) {
    INFO("policy " << policy << ", without prefetching");
    check_same_trajectory(fully_sharded(policy, steps, nullptr, false, no_prefetch), expected, steps);
  }
  dist::FullyShardedOptions eager = unbounded_prefetch();
  eager.reductions_in_flight = 3;
  for (const std::string policy : {"none", "binomial:3"}) {
    INFO("policy " << policy << ", prefetching as soon as the order names a block, three reductions in flight");
    check_same_trajectory(fully_sharded(policy, steps, nullptr, false, eager), expected, steps);
  }
}

TEST_CASE("dist: under autocast, ZeRO-3 gives the gradients and weights of one process accumulating the ranks' "
          "micro-batches, bitwise", "[dist][fsdp][autocast]") {
  const int steps = 3;
  const Trajectory expected = reference(world().world_size(), steps, true);
  for (const std::string policy : {"none", "blocks", "binomial:3"}) {
    INFO("policy " << policy);
    check_same_trajectory(fully_sharded(policy, steps, nullptr, true), expected, steps);
  }
}

TEST_CASE("dist: ZeRO-3 gathers each block twice a step, with or without per-block checkpointing", "[dist][fsdp]") {
  for (const std::string policy : {"none", "blocks", "selective"}) {
    INFO("policy " << policy);
    Gathers gathers;
    fully_sharded(policy, 3, &gathers, false, unbounded_prefetch());
    const auto blocks = static_cast<std::int64_t>(tiny_gpt().n_layer);
    for (std::size_t s = 0; s < gathers.per_unit.size(); ++s) {
      const std::vector<std::int64_t>& step = gathers.per_unit[s];
      for (std::size_t u = 0; u + 1 < step.size(); ++u) CHECK(step[u] == 2);  // forward, and once in backward
      CHECK(step.back() == 0);  // the root stays whole: gathered by the optimizer's step only
      // Forward prefetches every block but the first; backward every block but the first it
      // gathers, from the first step on (the reverse order; nothing traced).
      CHECK(gathers.prefetched[s] == 2 * (blocks - 1));
    }
    CHECK(gathers.unused == 0);
  }
}

TEST_CASE("dist: under a chain schedule, ZeRO-3 prefetches in the plan's order from the first step", "[dist][fsdp]") {
  for (const std::string policy : {"binomial:2", "binomial:3", "uniform:2", "sqrt"}) {
    INFO("policy " << policy);
    Gathers gathers;
    fully_sharded(policy, 2, &gathers, false, unbounded_prefetch());
    for (std::size_t s = 0; s < gathers.per_unit.size(); ++s) {
      INFO("step " << s);
      std::int64_t total = 0;
      for (std::size_t u = 0; u + 1 < gathers.per_unit[s].size(); ++u) total += gathers.per_unit[s][u];
      // Every gather but the step's first, and the backward's first when the forward's last block is
      // also the first the backward needs (freed between them), was started ahead — by the plan, so
      // the first step too — and no prefetch was wasted.
      CHECK(gathers.prefetched[s] == total - 2);
    }
    CHECK(gathers.unused == 0);
  }
}

/// The most units gathered at once while ops run forward or backward.
struct GatheredAtOnce : Observer {
  explicit GatheredAtOnce(const dist::FullyShardedDataParallel& f) : fsdp(f) {}
  void op_begin(const OpOutput&) override { most = std::max(most, fsdp.gathered_units()); }
  void backward_op(const char*) override { most = std::max(most, fsdp.gathered_units()); }
  const dist::FullyShardedDataParallel& fsdp;
  std::size_t most = 0;
};

TEST_CASE("dist: ZeRO-3 holds one block's parameters at a time, and 1/N of the rest; within two blocks, the model "
          "state stays within 16 Psi / N + two blocks + the root beyond its shard", "[dist][fsdp]") {
  for (const std::string policy : {"none", "blocks"})
    for (const bool within_two_units : {true, false}) {
      INFO("policy " << policy << (within_two_units ? "" : ", prefetching as soon as the order names a block"));
      Generator init(5);
      nn::GPT model(tiny_gpt(), init);
      apply_checkpointing(model, policy::parse(policy));
      dist::FullyShardedDataParallel fsdp(world(), model, within_two_units ? dist::FullyShardedOptions{} : unbounded_prefetch());
      dist::FullyShardedAdamW opt(fsdp, gpt_groups(model), kAdamW);
      const int n = world().world_size();
      std::size_t shard_bytes = 0, grad_shard_bytes = 0, root_bytes = 0, block_bytes = 0;
      for (const dist::ShardedUnit& u : fsdp.units()) {
        CHECK(u.params.defined() == !u.root);  // the root's shard is its slice of its whole parameters
        if (!u.root) CHECK(u.params.numel() == u.shard_numel(world().rank()));
        CHECK(u.grads.numel() == u.shard_numel(world().rank()));
        CHECK(u.grads.numel() <= u.numel / n + 1);
        for (const dist::ShardedUnit::Entry& e : u.entries)
          CHECK(fsdp.parameters()[e.param]->storage()->resident() == u.root);
        if (!u.root) shard_bytes += u.params.nbytes();
        grad_shard_bytes += u.grads.nbytes();
        (u.root ? root_bytes : block_bytes) = static_cast<std::size_t>(u.numel) * sizeof(float);
      }
      // The most one parameter's reduction holds on this rank: its local gradient, and N - 1 copies
      // of this rank's piece of it.
      std::size_t one_reduction = 0, largest = 0;
      for (const dist::ShardedUnit& u : fsdp.units())
        for (const dist::ShardedUnit::Entry& e : u.entries) {
          largest = std::max(largest, fsdp.parameters()[e.param]->nbytes());
          const std::int64_t lo = u.shard_offset(world().rank());
          const auto [from, to] = dist::detail::overlap(e, lo, lo + u.shard_numel(world().rank()));
          one_reduction = std::max(one_reduction, sizeof(float) * static_cast<std::size_t>(e.numel + (n - 1) * (to - from)));
        }
      for (int step = 0; step < 3; ++step) {
        fsdp.reset_peak_memory();
        GatheredAtOnce watch(fsdp);
        micro_batch_loss(model, step, world().rank(), false).backward();
        opt.step();
        opt.zero_grad();
        CHECK(fsdp.gathered_units() == 0);
        INFO("step " << step);
        CHECK(watch.most == 1);  // the first step too: a node before each block's ops frees it in backward
        // At the peak: this rank's shards and the root whole; a block gathered and the next arriving.
        const dist::ShardedMemory& peak = fsdp.peak_memory();
        CHECK(peak.parameters == shard_bytes + root_bytes);
        CHECK(peak.gathered <= 2 * block_bytes);
        CHECK(peak.live >= peak.parameters + peak.gradients + peak.gathered + peak.activations);
        // The model state at its own peak: the shards, the root, two blocks, and one parameter's
        // gradient on its way (its local copy and the other ranks' copies of this rank's piece of
        // it) — never a whole block's gradients waiting for their last one, but in the first step,
        // which learns when each is final and reduces a block's at its backward's end.
        const dist::ShardedMemory& state = fsdp.peak_model_state();
        INFO("at the model state's peak: parameters " << state.parameters << ", gradients " << state.gradients
             << ", gathered " << state.gathered << "; shards " << shard_bytes << ", root " << root_bytes << ", block "
             << block_bytes << ", one reduction at most " << one_reduction);
        CHECK(state.model_state() >= peak.model_state());
        // The moments: allocated in the first update (the root's gather then may be the peak).
        CHECK((state.optimizer == opt.state_bytes() || (step == 0 && state.optimizer == 0)));
        CHECK(state.parameters == shard_bytes + root_bytes);
        CHECK(state.gathered <= 2 * block_bytes);
        // (and the next parameter's gradient arriving while it is on its way)
        CHECK(state.gradients <= grad_shard_bytes + one_reduction + largest + (step == 0 ? block_bytes : 0));
        // Within two units, what is beyond the shards and the root (blocks here or arriving, their
        // gradients not yet in the shards) is within two blocks once the counts are known — unless a
        // block's own backward holds more (so tiny a model on 4 ranks: a reduction outweighs a block).
        const std::size_t two_units = std::max(2 * block_bytes, block_bytes + one_reduction + largest);
        if (within_two_units && step > 0)
          CHECK(state.gathered + state.gradients - state.root_gradients - grad_shard_bytes <= two_units);
        if (n <= 3) CHECK(one_reduction < block_bytes);  // (4 ranks of so tiny a model: a shard is under a weight)
      }
    }
}

/// Backward ops at which a gathered block had parameters freed one by one.
struct FreedEarly : Observer {
  explicit FreedEarly(const dist::FullyShardedDataParallel& f) : fsdp(f) {}
  void backward_op(const char*) override {
    for (const dist::ShardedUnit& u : fsdp.units())
      if (u.gathered && u.partly) {
        ++count;
        return;
      }
  }
  const dist::FullyShardedDataParallel& fsdp;
  std::int64_t count = 0;
};

/// A stack of blocks h + g * tanh(h), g the block's own parameter and mul's first operand (the way
/// a hand-written RMSNorm or LayerScale is written: mul's backward hands g its gradient, the
/// block's last, before it reads g for h's), or h + tanh(h) * g (`gate_first` false). The root's
/// parameter scales the input; the loss is the mean square of the output minus a target.
struct GatedStack : nn::Module {
  static constexpr std::int64_t kWidth = 6;
  struct Block : nn::UnaryModule {
    Block(bool first, Generator& gen) : gate_first(first), g(randn(Shape{kWidth}, gen)) { register_parameter("g", g); }
    Tensor forward(const Tensor& h) override { return h + (gate_first ? g * tanh(h) : tanh(h) * g); }
    bool gate_first;
    Tensor g;
  };
  GatedStack(int blocks, bool gate_first, Generator& gen) : scale(randn(Shape{kWidth}, gen)) {
    register_parameter("scale", scale);
    for (int b = 0; b < blocks; ++b) body.emplace_back<Block>(gate_first, gen);
    register_module("body", body);
  }
  std::vector<nn::Module*> block_modules() {
    std::vector<nn::Module*> out;
    for (std::size_t b = 0; b < body.size(); ++b) out.push_back(&body[b]);
    return out;
  }
  /// Micro-batch `rank` of `step`: 3 rows and their targets.
  Tensor loss(int step, int rank) {
    Generator gen(static_cast<std::uint64_t>(500 * step + rank + 1));
    const Tensor x = randn(Shape{3, kWidth}, gen), y = randn(Shape{3, kWidth}, gen);
    const Tensor d = body(x * scale) - y;
    return mean(d * d);
  }
  Tensor scale;
  nn::Sequential body;
};

/// The gated stack trained `steps` steps: under ZeRO-3 (rank r runs micro-batch r), or in one
/// process accumulating the ranks' micro-batches in rank order (`ranks` > 0). `most`: the most
/// blocks gathered at once while ops run forward or backward.
Trajectory gated(bool gate_first, const std::string& policy, int steps, int ranks = 0, std::size_t* most = nullptr) {
  Generator init(3);
  GatedStack model(9, gate_first, init);
  apply_checkpointing(model.body, policy::parse(policy));
  const optim::AdamWOptions adamw{1e-2, 0.9, 0.95, 1e-8, 0.0};
  Trajectory out;
  if (ranks > 0) {
    optim::AdamW opt(model.parameters(), adamw);
    for (int step = 0; step < steps; ++step) {
      for (int r = 0; r < ranks; ++r) model.loss(step, r).backward();
      for (Tensor* p : model.parameters()) {
        Tensor g = p->grad();
        detail::flat(g) /= static_cast<float>(ranks);
      }
      out.grads.push_back(copies(model.parameters(), true));
      opt.step();
      opt.zero_grad();
    }
    out.weights = copies(model.parameters(), false);
    return out;
  }
  dist::FullyShardedDataParallel fsdp(world(), model, model.body, model.block_modules());
  dist::FullyShardedAdamW opt(fsdp, model.parameters(), adamw);
  for (int step = 0; step < steps; ++step) {
    GatheredAtOnce watch(fsdp);
    model.loss(step, world().rank()).backward();
    if (most) *most = std::max(*most, watch.most);
    fsdp.gather_gradients();
    out.grads.push_back(copies(model.parameters(), true));
    opt.step();
    opt.zero_grad();
  }
  auto whole = fsdp.full_parameters();
  out.weights = copies(model.parameters(), false);
  return out;
}

TEST_CASE("dist: ZeRO-3 keeps a block gathered while a backward node still reads its parameter (a gate that is mul's "
          "first operand, whose gradient is the block's last), bitwise one process, under every policy",
          "[dist][fsdp][gate]") {
  const int steps = 3;
  for (const bool gate_first : {true, false}) {
    const Trajectory expected = gated(gate_first, "none", steps, world().world_size());
    for (const std::string policy : {"none", "blocks", "binomial:3", "uniform:2", "uniform:3", "sqrt"}) {
      INFO((gate_first ? "g * tanh(h)" : "tanh(h) * g") << ", policy " << policy);
      std::size_t most = 0;
      check_same_trajectory(gated(gate_first, policy, steps, 0, &most), expected, steps);
      CHECK(most <= 2);
    }
  }
}

TEST_CASE("dist: ZeRO-3 holds at most two blocks' parameters under every schedule, a replayed segment of three "
          "blocks too (gathered again in its backward), bitwise one process", "[dist][fsdp][segments]") {
  nn::GPTConfig cfg = tiny_gpt();
  cfg.n_layer = 9;  // sqrt: segments of three
  const int steps = 2;
  const Trajectory expected = reference(world().world_size(), steps, false, cfg);
  // Per policy: the most blocks gathered at once, and the gathers a step costs — two a block, one
  // more for each block of a replayed segment but its last two (sqrt and uniform:3 replay two
  // segments of three, uniform:4 two of four; uniform:2's segments reverse without one), and under
  // binomial:3 one more for each replay that only advances the chain.
  struct Expected {
    std::string policy;
    std::size_t most;
    std::int64_t gathers;
  };
  for (const Expected& e : {Expected{"none", 1, 18}, Expected{"blocks", 1, 18}, Expected{"selective", 1, 18},
                            Expected{"binomial:3", 1, 23}, Expected{"uniform:2", 2, 18}, Expected{"uniform:3", 2, 20},
                            Expected{"sqrt", 2, 20}, Expected{"uniform:4", 2, 22}})
    for (const bool within_two_units : {true, false}) {
      const std::string& policy = e.policy;
      INFO("policy " << policy << (within_two_units ? "" : ", prefetching as soon as the order names a block"));
      dist::FullyShardedOptions options = within_two_units ? dist::FullyShardedOptions{} : unbounded_prefetch();
      Generator init(5);
      nn::GPT model(cfg, init);
      apply_checkpointing(model, policy::parse(policy));
      dist::FullyShardedDataParallel fsdp(world(), model, options);
      dist::FullyShardedAdamW opt(fsdp, gpt_groups(model), kAdamW);
      const std::size_t block_bytes = static_cast<std::size_t>(fsdp.units()[0].numel) * sizeof(float);
      Trajectory got;
      for (int step = 0; step < steps; ++step) {
        INFO("step " << step);
        fsdp.reset_peak_memory();
        const std::int64_t gathers = fsdp.gathers();
        std::int64_t prefetched = 0;
        for (const dist::ShardedUnit& u : fsdp.units()) prefetched -= u.prefetched;
        GatheredAtOnce watch(fsdp);
        micro_batch_loss(model, step, world().rank(), false).backward();
        const std::int64_t per_step = fsdp.gathers() - gathers;
        for (const dist::ShardedUnit& u : fsdp.units()) prefetched += u.prefetched;
        UNSCOPED_INFO("gathers " << per_step << " (prefetched " << prefetched << "), most gathered at once "
                      << watch.most);
        CHECK(watch.most == e.most);
        CHECK(per_step == e.gathers);
        // Gathered and arriving: two blocks at most, whether or not prefetches wait for room.
        CHECK(fsdp.peak_memory().gathered <= 2 * block_bytes);
        CHECK(fsdp.peak_model_state().gathered <= 2 * block_bytes);
        fsdp.gather_gradients();
        got.grads.push_back(copies(model.parameters(), true));
        opt.step();
        opt.zero_grad();
      }
      CHECK(fsdp.unused_prefetches() == 0);
      auto whole = fsdp.full_parameters();
      got.weights = copies(model.parameters(), false);
      check_same_trajectory(got, expected, steps);
    }
}

TEST_CASE("dist: a ZeRO-3 backward that retains the graph frees each block as its gradients are final, and the next "
          "backward through the same graph gathers them again and adds the same gradients", "[dist][fsdp][retain]") {
  for (const std::string policy : {"none", "blocks", "binomial:3", "sqrt"}) {
    INFO("policy " << policy);
    nn::GPTConfig cfg = tiny_gpt();
    cfg.n_layer = 9;
    // The gradients of one backward, and of two through a retained graph (the second adds to the
    // shards: twice the first, exactly).
    std::vector<std::vector<Tensor>> grads;
    for (const int walks : {1, 2}) {
      Generator init(5);
      nn::GPT model(cfg, init);
      apply_checkpointing(model, policy::parse(policy));
      dist::FullyShardedDataParallel fsdp(world(), model);
      const Tensor loss = micro_batch_loss(model, 0, world().rank(), false);
      for (int w = 0; w < walks; ++w) {
        GatheredAtOnce watch(fsdp);
        loss.backward(w + 1 < walks);
        CHECK(watch.most <= 2);
        CHECK(fsdp.gathered_units() == 0);
      }
      fsdp.gather_gradients();
      grads.push_back(copies(model.parameters(), true));
    }
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      INFO("parameter " << i);
      detail::flat(grads[0][i]) *= 2.0f;
      CHECK(bitwise_equal(grads[1][i], grads[0][i]));
    }
  }
}

TEST_CASE("dist: within two blocks, ZeRO-3 frees a block's parameters as their gradients are final and still "
          "prefetches in backward, whatever the vocabulary", "[dist][fsdp]") {
  for (const std::int64_t vocab : {std::int64_t{13}, std::int64_t{4096}})  // the root from under a block to 10 blocks
    for (const std::string policy : {"none", "blocks"}) {
      INFO("vocabulary " << vocab << ", policy " << policy);
      nn::GPTConfig cfg = tiny_gpt();
      cfg.vocab_size = vocab;
      Generator init(5);
      nn::GPT model(cfg, init);
      apply_checkpointing(model, policy::parse(policy));
      dist::FullyShardedDataParallel fsdp(world(), model);
      dist::FullyShardedAdamW opt(fsdp, gpt_groups(model), kAdamW);
      const std::int64_t blocks = cfg.n_layer;
      for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        const std::int64_t gathers = fsdp.gathers();
        std::int64_t prefetched = 0;
        for (const dist::ShardedUnit& u : fsdp.units()) prefetched -= u.prefetched;
        FreedEarly freed(fsdp);
        micro_batch_loss(model, step, world().rank(), false).backward();
        for (const dist::ShardedUnit& u : fsdp.units()) prefetched += u.prefetched;
        CHECK(fsdp.gathers() - gathers == 2 * blocks);  // waiting for room never costs a gather
        opt.step();
        opt.zero_grad();
        if (step == 0) continue;  // the first step reduces a block's gradients at its end
        CHECK(freed.count > 0);
        CHECK(prefetched > blocks - 1);  // the forward's, and some in backward
      }
      CHECK(fsdp.unused_prefetches() == 0);
    }
}

TEST_CASE("dist: in ZeRO-3's first step, a model run twice before one backward, and remat::grad(), are exact",
          "[dist][fsdp]") {
  const int n = world().world_size();
  // One process: each rank's gradient of its loss of two micro-batches (each parameter takes two
  // contributions), the ranks' added in rank order, divided by N.
  Generator init(5);
  nn::GPT plain(tiny_gpt(), init);
  std::vector<Tensor> expected;
  for (int r = 0; r < n; ++r) {
    for (Tensor* p : plain.parameters()) p->zero_grad();
    (micro_batch_loss(plain, 0, r, false) + micro_batch_loss(plain, 1, r, false)).backward();
    const std::vector<Tensor> mine = copies(plain.parameters(), true);
    if (r == 0) expected = mine;
    else
      for (std::size_t i = 0; i < mine.size(); ++i) detail::flat(expected[i]) += detail::flat(mine[i]);
  }
  for (Tensor& g : expected) detail::flat(g) /= static_cast<float>(n);
  for (const std::string policy : {"none", "blocks", "binomial:3"}) {
    INFO("policy " << policy);
    Generator again(5);
    nn::GPT model(tiny_gpt(), again);
    apply_checkpointing(model, policy::parse(policy));
    dist::FullyShardedDataParallel fsdp(world(), model);
    // grad() first: it takes the gradients itself, and must leave the shards and the counts alone.
    const Tensor probe = micro_batch_loss(model, 0, world().rank(), false);
    const std::vector<Tensor> through_grad = grad(probe, {*fsdp.parameters()[0]});
    CHECK(through_grad[0].defined());
    // Every block runs twice before the step's one backward: each is reduced once both are done.
    (micro_batch_loss(model, 0, world().rank(), false) + micro_batch_loss(model, 1, world().rank(), false)).backward();
    fsdp.gather_gradients();
    const std::vector<Tensor> got = copies(model.parameters(), true);
    for (std::size_t i = 0; i < expected.size(); ++i) {
      INFO("parameter " << i);
      CHECK(bitwise_equal(got[i], expected[i]));
    }
    CHECK(fsdp.gathered_units() == 0);
  }
}

TEST_CASE("dist: a tied embedding is one parameter under ZeRO-3, trained bitwise as under ZeRO-1", "[dist][fsdp]") {
  nn::GPTConfig cfg = tiny_gpt();
  cfg.tie_weights = true;
  auto run = [&](bool zero3) {
    Generator init(5);
    nn::GPT model(cfg, init);
    std::optional<dist::DataParallel> ddp;
    std::optional<dist::FullyShardedDataParallel> fsdp;
    std::unique_ptr<optim::Optimizer> opt;
    if (zero3) {
      fsdp.emplace(world(), model);
      CHECK(fsdp->parameters().size() == model.parameters().size());
      opt = std::make_unique<dist::FullyShardedAdamW>(*fsdp, gpt_groups(model), kAdamW);
    } else {
      dist::DataParallelOptions options;
      options.shard_gradients = true;
      ddp.emplace(world(), model, options);
      opt = std::make_unique<dist::ShardedAdamW>(*ddp, gpt_groups(model), kAdamW);
    }
    for (int step = 0; step < 2; ++step) {
      const MicroBatch mb = micro_batch(step, world().rank());
      manual_seed(mb.seed);
      model.loss(mb.x, mb.y).backward();
      opt->step();
      opt->zero_grad();
    }
    opt.reset();
    fsdp.reset();  // the model whole again
    REQUIRE(model.lm_head.weight.cdata() == model.wte.weight.cdata());  // still one tensor
    return copies(model.parameters(), false);
  };
  const std::vector<Tensor> zero1 = run(false), zero3 = run(true);
  for (std::size_t i = 0; i < zero1.size(); ++i) {
    INFO("parameter " << i);
    CHECK(bitwise_equal(zero1[i], zero3[i]));
  }
}

TEST_CASE("dist: a sharded parameter read outside its unit is an error naming it; full_parameters() makes the model "
          "whole", "[dist][fsdp]") {
  Generator init(5);
  nn::GPT model(tiny_gpt(), init);
  std::vector<Tensor> whole;
  for (Tensor* p : model.parameters()) whole.push_back(detail::copy_of(*p));
  {
    dist::FullyShardedDataParallel fsdp(world(), model);
    Tensor& w = model.h[1]->mlp.c_fc.weight;
    CHECK_THROWS_WITH(w.data(), Catch::Contains("transformer.h.1.mlp.c_fc.weight") && Catch::Contains("block 1") &&
                                    Catch::Contains("full_parameters"));
    CHECK(model.wte.weight.data() != nullptr);  // the root stays whole
    // One wrapper per model: a second is refused before it shards anything.
    CHECK_THROWS_WITH(dist::FullyShardedDataParallel(world(), model), Catch::Contains("already wrapped"));
    {
      auto full = fsdp.full_parameters();
      const std::vector<Tensor*> ps = model.parameters();
      for (std::size_t i = 0; i < ps.size(); ++i) CHECK(bitwise_equal(*ps[i], whole[i]));
    }
    CHECK_THROWS_AS(w.data(), Error);
  }
  // The wrapper gone, the model is whole again and runs alone.
  const std::vector<Tensor*> ps = model.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) CHECK(bitwise_equal(*ps[i], whole[i]));
  const MicroBatch mb = micro_batch(0, 0);
  CHECK_NOTHROW(model.loss(mb.x, mb.y).backward());
}

}  // namespace
}  // namespace remat::test
