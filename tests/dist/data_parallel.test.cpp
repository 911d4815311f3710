// Data parallelism over MPI, run by every rank (1, 2, 3 and 4 ranks in CTest): the deterministic
// collectives, DataParallel and ShardedAdamW against one process accumulating the same
// micro-batches in rank order, bitwise; overlap from the recorded event order; divergent ranks.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <remat/remat.hpp>
#include <remat/dist/data_parallel.hpp>
#include <remat/dist/sharded_adamw.hpp>
#include <remat/nn/gpt.hpp>
#include <remat/nn/init.hpp>
#include <remat/nn/linear.hpp>
#include <remat/optim/adamw.hpp>

#include "dist/support_dist.hpp"
#include "dist/trajectory.hpp"

namespace remat::test {
namespace {

/// Rank r's values, the same on every rank that asks.
Tensor values_of(int rank, const Shape& shape) {
  Generator gen(static_cast<std::uint64_t>(100 + rank));
  return randn(shape, gen);
}

TEST_CASE("dist: all_reduce adds in rank order, the bits one process gets", "[dist]") {
  dist::Context& ctx = world();
  for (const std::int64_t n : {1, 3, 1000, 4099}) {  // fewer elements than ranks, and uneven shards
    Tensor t = values_of(ctx.rank(), Shape{n});
    dist::all_reduce(ctx, t);
    Tensor expected = values_of(0, Shape{n});
    for (int q = 1; q < ctx.world_size(); ++q) detail::flat(expected) += detail::flat(values_of(q, Shape{n}));
    CHECK(bitwise_equal(t, expected));

    const Tensor shard = dist::reduce_scatter(ctx, values_of(ctx.rank(), Shape{n}));
    const dist::ShardLayout layout(n, ctx.world_size());
    REQUIRE(shard.numel() == layout.counts[static_cast<std::size_t>(ctx.rank())]);
    CHECK(std::memcmp(shard.data(), expected.data() + layout.offsets[static_cast<std::size_t>(ctx.rank())],
                      shard.nbytes()) == 0);
    CHECK(bitwise_equal(dist::all_gather(ctx, shard, Shape{n}), expected));
  }
  Tensor b = values_of(ctx.rank(), Shape{2, 3});
  dist::broadcast(ctx, b, 0);
  CHECK(bitwise_equal(b, values_of(0, Shape{2, 3})));
  CHECK_THROWS_WITH(dist::all_gather(ctx, Tensor(Shape{2}), Shape{2 * ctx.world_size() + 1}),
                    Catch::Contains("dist::all_gather") && Catch::Contains("shape"));
}

/// N ranks: rank r runs micro-batch r of each step under `policy` (`mixed`: the forward under
/// remat::autocast, backward and the float32 gradient reduction outside it).
Trajectory distributed(const std::string& policy, bool sharded, int steps, dist::DataParallelOptions options = {},
                       bool mixed = false) {
  dist::Context& ctx = world();
  Generator init(5);
  nn::GPT model(tiny_gpt(), init);
  apply_checkpointing(model, policy::parse(policy));
  options.shard_gradients = sharded;
  dist::DataParallel ddp(ctx, model, options);
  std::unique_ptr<optim::Optimizer> opt;
  if (sharded)
    opt = std::make_unique<dist::ShardedAdamW>(ddp, gpt_groups(model), kAdamW);
  else
    opt = std::make_unique<optim::AdamW>(gpt_groups(model), kAdamW);
  Trajectory out;
  for (int step = 0; step < steps; ++step) {
    micro_batch_loss(model, step, ctx.rank(), mixed).backward();
    if (sharded) ddp.gather_gradients();
    out.grads.push_back(copies(model.parameters(), true));
    opt->step();
    opt->zero_grad();
  }
  out.weights = copies(model.parameters(), false);
  return out;
}

TEST_CASE("dist: DataParallel (and ZeRO-1) give the gradients and weights of one process accumulating the "
          "ranks' micro-batches, bitwise, under every checkpointing policy", "[dist]") {
  const int steps = 3;
  const Trajectory expected = reference(world().world_size(), steps);
  dist::DataParallelOptions small_buckets;  // several buckets even for this small model
  small_buckets.first_bucket_bytes = 2048;
  small_buckets.bucket_bytes = 8192;
  // The three, and the other chain schedules and selective saving: gradients become final
  // during replays in each.
  for (const std::string policy : {"none", "blocks", "binomial:3", "selective", "uniform:2", "sqrt", "budget:1"})
    for (const bool sharded : {false, true}) {
      INFO("policy " << policy << (sharded ? ", sharded optimizer state" : ", whole optimizer state"));
      check_same_trajectory(distributed(policy, sharded, steps, small_buckets), expected, steps);
    }
}

TEST_CASE("dist: under autocast, DataParallel (and ZeRO-1) give the gradients and weights of one process "
          "accumulating the ranks' micro-batches, bitwise, gradients reduced in float32", "[dist][autocast]") {
  const int steps = 3;
  const Trajectory expected = reference(world().world_size(), steps, true);
  // bfloat16 was in force: the float32 trajectory ends elsewhere.
  const Trajectory fp32 = reference(world().world_size(), steps, false);
  bool all_equal = true;
  for (std::size_t i = 0; i < expected.weights.size(); ++i) all_equal = all_equal && bitwise_equal(fp32.weights[i], expected.weights[i]);
  CHECK_FALSE(all_equal);
  dist::DataParallelOptions small_buckets;
  small_buckets.first_bucket_bytes = 2048;
  small_buckets.bucket_bytes = 8192;
  for (const std::string policy : {"none", "blocks", "binomial:3", "selective", "budget:1"})
    for (const bool sharded : {false, true}) {
      INFO("policy " << policy << (sharded ? ", sharded optimizer state" : ", whole optimizer state"));
      // float32 gradients (Tensor), reduced in float32: the one-process sums' bits
      check_same_trajectory(distributed(policy, sharded, steps, small_buckets, true), expected, steps);
    }
}

/// Parameters of prime sizes (7·13, 13, 13·11, 11, 3): whatever the rank count, shards start at
/// offsets that are not multiples of any vector width, and some shards are shorter than a vector.
struct PrimeMlp : nn::Module {
  explicit PrimeMlp(Generator& gen) : a(7, 13, true, gen), b(13, 11, true, gen), gain(nn::init::uniform({3}, 1.0f, gen)) {
    register_module("a", a);
    register_module("b", b);
    register_parameter("gain", gain);
  }
  Tensor loss(const Tensor& x) { return sum(tanh(b.forward(tanh(a.forward(x))))) + sum(gain * gain); }
  nn::Linear a, b;
  Tensor gain;
};

Tensor prime_batch(int step, int rank) {
  Generator gen(static_cast<std::uint64_t>(300 + 10 * step + rank));
  return randn(Shape{5, 7}, gen);
}

TEST_CASE("dist: ZeRO-1 is AdamW bitwise when shards split prime-sized parameters at any offset", "[dist]") {
  dist::Context& ctx = world();
  const int steps = 3;
  Generator init_ref(9);
  PrimeMlp ref(init_ref);
  optim::AdamW adamw(ref.parameters(), kAdamW);
  for (int step = 0; step < steps; ++step) {
    for (int r = 0; r < ctx.world_size(); ++r) ref.loss(prime_batch(step, r)).backward();
    for (Tensor* p : ref.parameters()) {
      Tensor g = p->grad();
      detail::flat(g) /= static_cast<float>(ctx.world_size());
    }
    adamw.step();
    adamw.zero_grad();
  }
  // One bucket for everything, and buckets smaller than a parameter: shards cut parameters both ways.
  for (const std::size_t bucket_bytes : {std::size_t{1} << 20, std::size_t{64}}) {
    INFO("bucket bytes " << bucket_bytes);
    Generator init(9);
    PrimeMlp model(init);
    dist::DataParallelOptions options;
    options.shard_gradients = true;
    options.first_bucket_bytes = options.bucket_bytes = bucket_bytes;
    dist::DataParallel ddp(ctx, model, options);
    dist::ShardedAdamW opt(ddp, model.parameters(), kAdamW);
    for (int step = 0; step < steps; ++step) {
      model.loss(prime_batch(step, ctx.rank())).backward();
      opt.step();
      opt.zero_grad();
    }
    for (std::size_t i = 0; i < ref.parameters().size(); ++i) {
      INFO("parameter " << i << " after " << steps << " steps");
      CHECK(bitwise_equal(*model.parameters()[i], *ref.parameters()[i]));
    }
  }
}

TEST_CASE("dist: a sharded optimizer holds about 1/N of AdamW's state", "[dist]") {
  dist::Context& ctx = world();
  Generator init(5);
  nn::GPT model(tiny_gpt(), init);
  dist::DataParallelOptions options;
  options.shard_gradients = true;
  dist::DataParallel ddp(ctx, model, options);
  dist::ShardedAdamW opt(ddp, gpt_groups(model), kAdamW);
  const MicroBatch mb = micro_batch(0, ctx.rank());
  model.loss(mb.x, mb.y).backward();
  opt.step();
  const auto full = static_cast<std::size_t>(model.num_parameters()) * 2 * sizeof(float);
  const auto n = static_cast<std::size_t>(ctx.world_size());
  // Each bucket's shards differ by at most one element.
  CHECK(opt.state_bytes() <= full / n + ddp.buckets().size() * 2 * sizeof(float));
  CHECK(opt.state_bytes() + ddp.buckets().size() * 2 * sizeof(float) >= full / n);

  // Its state is AdamW's (gathered): loadable into a whole AdamW, bitwise the same moments.
  const optim::OptimizerState state = opt.state();
  optim::AdamW whole(gpt_groups(model), kAdamW);
  whole.load_state(state);
  CHECK(whole.steps() == 1);
  CHECK(state.tensors.size() == 2 * model.parameters().size());
}

TEST_CASE("dist: a tied embedding is one gradient and one optimizer state, sharded or whole", "[dist]") {
  nn::GPTConfig cfg = tiny_gpt();
  cfg.tie_weights = true;
  auto run = [&](bool sharded) {
    Generator init(5);
    nn::GPT model(cfg, init);
    dist::DataParallelOptions options;
    options.shard_gradients = sharded;
    options.first_bucket_bytes = 2048;
    options.bucket_bytes = 8192;
    dist::DataParallel ddp(world(), model, options);
    CHECK(ddp.parameters().size() == model.parameters().size());
    std::unique_ptr<optim::Optimizer> opt;
    if (sharded)
      opt = std::make_unique<dist::ShardedAdamW>(ddp, gpt_groups(model), kAdamW);
    else
      opt = std::make_unique<optim::AdamW>(gpt_groups(model), kAdamW);
    for (int step = 0; step < 2; ++step) {
      const MicroBatch mb = micro_batch(step, world().rank());
      manual_seed(mb.seed);
      model.loss(mb.x, mb.y).backward();
      opt->step();
      opt->zero_grad();
    }
    REQUIRE(model.lm_head.weight.cdata() == model.wte.weight.cdata());  // still one tensor
    return copies(model.parameters(), false);
  };
  const std::vector<Tensor> whole = run(false), sharded = run(true);
  for (std::size_t i = 0; i < whole.size(); ++i) {
    INFO("parameter " << i);
    CHECK(bitwise_equal(whole[i], sharded[i]));
  }
}

TEST_CASE("dist: reductions start while backward still runs (event order)", "[dist]") {
  dist::Context& ctx = world();
  for (const std::string policy : {"none", "blocks", "binomial:3"}) {
    INFO("policy " << policy);
    Generator init(5);
    nn::GPT model(tiny_gpt(), init);
    apply_checkpointing(model, policy::parse(policy));
    dist::DataParallelOptions options;
    options.first_bucket_bytes = 2048;
    options.bucket_bytes = 8192;
    dist::DataParallel ddp(ctx, model, options);
    for (int step = 0; step < 2; ++step) {
      const MicroBatch mb = micro_batch(step, ctx.rank());
      model.loss(mb.x, mb.y).backward();
      model.zero_grad();
    }
    REQUIRE(ddp.buckets().size() >= 3);
    const std::vector<dist::SyncEvent>& events = ddp.last_events();
    std::size_t first_sent = events.size(), end = events.size(), sent_before_end = 0;
    for (std::size_t i = 0; i < events.size(); ++i) {
      if (events[i].kind == dist::SyncEvent::Kind::bucket_sent && first_sent == events.size()) first_sent = i;
      if (events[i].kind == dist::SyncEvent::Kind::backward_end) end = i;
      if (events[i].kind == dist::SyncEvent::Kind::bucket_sent && end == events.size()) ++sent_before_end;
    }
    REQUIRE(end < events.size());
    CHECK(first_sent < end);
    CHECK(events[first_sent].bucket == 0);
    // Every bucket but the one holding the embeddings (final only at the very end) went early.
    CHECK(sent_before_end + 1 >= ddp.buckets().size());

    // Without overlap nothing is sent before the end.
    options.overlap = false;
    Generator init2(5);
    nn::GPT model2(tiny_gpt(), init2);
    dist::DataParallel late(ctx, model2, options);
    for (int step = 0; step < 2; ++step) {
      const MicroBatch mb = micro_batch(step, ctx.rank());
      model2.loss(mb.x, mb.y).backward();
      model2.zero_grad();
    }
    CHECK(late.last_events().front().kind == dist::SyncEvent::Kind::backward_end);
  }
}

TEST_CASE("dist: no_sync accumulates locally; the next backward averages the sums", "[dist]") {
  dist::Context& ctx = world();
  const int n = ctx.world_size();
  // Expected: rank r's two micro-batches accumulated, then those sums added in rank order, / N.
  std::vector<Tensor> expected;
  {
    Generator init(5);
    nn::GPT model(tiny_gpt(), init);
    std::vector<std::vector<Tensor>> per_rank;
    for (int r = 0; r < n; ++r) {
      for (int k = 0; k < 2; ++k) {
        const MicroBatch mb = micro_batch(k, r);
        manual_seed(mb.seed);
        model.loss(mb.x, mb.y).backward();
      }
      per_rank.push_back(copies(model.parameters(), true));
      model.zero_grad();
    }
    expected = per_rank[0];
    for (int r = 1; r < n; ++r)
      for (std::size_t i = 0; i < expected.size(); ++i) detail::flat(expected[i]) += detail::flat(per_rank[static_cast<std::size_t>(r)][i]);
    for (Tensor& g : expected) detail::flat(g) /= static_cast<float>(n);
  }
  Generator init(5);
  nn::GPT model(tiny_gpt(), init);
  apply_checkpointing(model, policy::parse("blocks"));
  dist::DataParallel ddp(ctx, model);
  {
    auto local = ddp.no_sync();
    const MicroBatch mb = micro_batch(0, ctx.rank());
    manual_seed(mb.seed);
    model.loss(mb.x, mb.y).backward();
  }
  CHECK(ddp.buckets().empty());  // nothing was communicated
  const MicroBatch mb = micro_batch(1, ctx.rank());
  manual_seed(mb.seed);
  model.loss(mb.x, mb.y).backward();
  const std::vector<Tensor> got = copies(model.parameters(), true);
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << i);
    CHECK(bitwise_equal(got[i], expected[i]));
  }

  // Clipping the averaged gradients: the same norm and the same clipped bits as one process.
  std::vector<Tensor> holders;
  for (Tensor& g : expected) {
    Tensor h = detail::copy_of(g);
    h.requires_grad_();
    h.meta()->grad = detail::copy_of(g);
    holders.push_back(h);
  }
  std::vector<Tensor*> holder_ptrs;
  for (Tensor& h : holders) holder_ptrs.push_back(&h);
  const double expected_norm = optim::clip_grad_norm(holder_ptrs, 0.05);
  const double norm = ddp.clip_grad_norm(0.05);
  CHECK(norm == expected_norm);
  for (std::size_t i = 0; i < holders.size(); ++i) CHECK(bitwise_equal(model.parameters()[i]->grad(), holders[i].grad()));
}

TEST_CASE("dist: ranks whose models differ are told so, every rank, before any step", "[dist]") {
  dist::Context& ctx = world();
  nn::Linear a(4, 3), b(3, 2);
  std::vector<std::pair<std::string, Tensor*>> named = {{"a.weight", &a.weight}, {"a.bias", &a.bias},
                                                       {"b.weight", &b.weight}};
  Tensor extra = zeros(Shape{5});
  extra.requires_grad_();
  if (ctx.rank() == ctx.world_size() - 1) named.push_back({"extra", &extra});
  if (ctx.world_size() == 1) return;
  const std::string last = std::to_string(ctx.world_size() - 1);
  CHECK_THROWS_WITH(dist::DataParallel(ctx, named),
                    Catch::Contains("parameters differ") && Catch::Contains("rank " + last + " has parameter 3 'extra'"));

  // Same names, another shape on the last rank.
  nn::Linear wide(4, ctx.rank() == ctx.world_size() - 1 ? 4 : 3);
  std::vector<std::pair<std::string, Tensor*>> shaped = {{"a.weight", &wide.weight}};
  CHECK_THROWS_WITH(dist::DataParallel(ctx, shaped), Catch::Contains("of shape (3, 4)") &&
                                                        Catch::Contains("rank " + last + " has parameter 0 'a.weight' of shape (4, 4)"));
}

TEST_CASE("dist: ranks whose gradients become ready in another order are told so at the first step", "[dist]") {
  dist::Context& ctx = world();
  if (ctx.world_size() == 1) return;
  nn::Linear a(4, 4), b(4, 4);
  dist::DataParallelOptions options;
  options.first_bucket_bytes = options.bucket_bytes = 16;  // one parameter per bucket
  dist::DataParallel ddp(ctx, {{"a.weight", &a.weight}, {"b.weight", &b.weight}}, options);
  const Tensor x = ones(Shape{2, 4});
  // Rank 0 runs a then b; the others b then a: backward makes the gradients final in other orders.
  const Tensor y = ctx.rank() == 0 ? b(a(x)) : a(b(x));
  CHECK_THROWS_WITH(sum(y).backward(), Catch::Contains("bucket layouts differ") && Catch::Contains("bucket 0"));
}

TEST_CASE("dist: create_graph and hvp under DataParallel are an error naming it, before the walk starts", "[dist]") {
  dist::Context& ctx = world();
  nn::Linear a(4, 4);
  dist::DataParallel ddp(ctx, {{"a.weight", &a.weight}, {"a.bias", &a.bias}});
  const Tensor x = ones(Shape{2, 4});
  const Tensor loss = sum(tanh(a(x)));
  GradOptions recorded;
  recorded.create_graph = true;
  CHECK_THROWS_WITH(grad(loss, {a.weight}, recorded),
                    Catch::Contains("create_graph is not available here") &&
                        Catch::Contains("DataParallel averages first-order gradients across ranks"));
  CHECK_THROWS_WITH(hvp([&](const Tensor& w) { return sum(tanh(matmul(x, w, false, true))); }, a.weight,
                        ones(a.weight.shape())),
                    Catch::Contains("carrying tangents") && Catch::Contains("DataParallel averages"));
  // Nothing was sent: the first-order step still averages.
  sum(tanh(a(x))).backward();
  CHECK(a.weight.grad().defined());
}

}  // namespace
}  // namespace remat::test
