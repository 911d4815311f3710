#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// A two-layer MLP as a plain function of its parameters.
struct Mlp {
  Tensor w1, b1, w2, b2;
  explicit Mlp(Generator& g)
      : w1(randn({16, 8}, g).requires_grad_()), b1(randn({16}, g).requires_grad_()),
        w2(randn({4, 16}, g).requires_grad_()), b2(randn({4}, g).requires_grad_()) {}
  Tensor operator()(const Tensor& x) const { return linear(gelu(linear(x, w1, b1)), w2, b2); }
  void zero_grad() {
    for (Tensor* p : {&w1, &b1, &w2, &b2}) p->zero_grad();
  }
};

}  // namespace

TEST_CASE("checkpoint: an MLP's gradients are bitwise identical with and without it", "[checkpoint]") {
  Generator g(1);
  Mlp mlp(g);
  Tensor x = randn({5, 8}, g).requires_grad_();
  auto run = [&](bool checkpointed) {
    mlp.zero_grad();
    x.zero_grad();
    const Tensor y = checkpointed ? checkpoint(mlp, x) : mlp(x);
    sum(y * y).backward();
    return testing::RunRecord()
        .tensor("output", y)
        .grad("w1", mlp.w1)
        .grad("b1", mlp.b1)
        .grad("w2", mlp.w2)
        .grad("b2", mlp.b2)
        .grad("x", x);
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
}

TEST_CASE("checkpoint: the tape holds one node and only the boundary until backward", "[checkpoint]") {
  test::FreshTape fresh;
  Generator g(2);
  Mlp mlp(g);
  const Tensor x = randn({5, 8}, g);
  const std::size_t saved_before = memory_stats().saved_bytes;
  const Tensor y = checkpoint(CheckpointOptions{"mlp"}, mlp, x);
  REQUIRE(fresh.tape.size() == 1);
  CHECK(std::string(fresh.tape.nodes()[0]->name()) == "mlp");
  CHECK(memory_stats().saved_bytes - saved_before == x.nbytes());
  const SavedTensorReport report = saved_tensors();
  REQUIRE(report.entries.size() == 1);
  CHECK(report.entries[0].op == "mlp");
  CHECK(report.entries[0].shape == Shape{5, 8});
  CHECK(report.total_bytes == x.nbytes());
  CHECK(report.str().find("mlp") != std::string::npos);
  sum(y).backward();
  CHECK(memory_stats().saved_bytes == saved_before);
  CHECK(mlp.w1.grad().defined());
}

TEST_CASE("checkpoint: a block with dropout replays the same masks, bitwise", "[checkpoint][dropout]") {
  Generator init(3);
  nn::TransformerBlock block(16, 2, 0.1, true, init);
  const Tensor x0 = randn({2, 6, 16}, init);
  auto run = [&](bool ck) {
    block.zero_grad();
    Tensor x = x0.detach();
    x.requires_grad_();
    Tensor y = ck ? checkpoint(block, x) : block(x);
    // Draw after the segment: the replay in backward must not disturb the outer stream.
    const Tensor after = randn({3});
    sum(y * y).backward();
    const Tensor later = randn({3});
    return testing::RunRecord()
        .grads(block)
        .grad("x", x)
        .tensor("output", y)
        .tensor("draw after the forward", after)
        .tensor("draw after backward", later);
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); }, 77);
}

TEST_CASE("checkpoint: a whole GPT with every block checkpointed and dropout on, bitwise", "[checkpoint][gpt]") {
  Generator init(4);
  nn::GPT gpt(test::small_gpt(4, 0.1), init);
  const LongTensor idx = randint(0, 23, {3, 12}, init), targets = randint(0, 23, {3, 12}, init);
  test::check_checkpointing(gpt, Checkpointing::each_block(), [&] { return gpt.loss(idx, targets); }, 5);
}

TEST_CASE("checkpoint: nested checkpoints give the same gradients", "[checkpoint][nested]") {
  Generator init(5);
  nn::Sequential blocks;  // holds both, so that one comparison covers every parameter
  nn::TransformerBlock& b0 = blocks.emplace_back<nn::TransformerBlock>(16, 2, 0.1, true, init);
  nn::TransformerBlock& b1 = blocks.emplace_back<nn::TransformerBlock>(16, 2, 0.1, true, init);
  const Tensor x0 = randn({2, 5, 16}, init);
  auto loss = [](const Tensor& y) { return sum(y * y); };
  const testing::GradientComparison r = testing::compare_gradients(
      blocks, [&] { return loss(b1(b0(x0))); },
      [&] { return loss(checkpoint([&](const Tensor& x) { return b1(checkpoint(b0, x)); }, x0)); }, 9);
  INFO(r.message);
  CHECK(r.equal);
}

TEST_CASE("checkpoint: tuple outputs and non-tensor arguments pass through", "[checkpoint]") {
  Generator g(6);
  Tensor a = randn({3}, g).requires_grad_(), b = randn({3}, g).requires_grad_();
  auto fn = [](const Tensor& x, double scale, const Tensor& y) { return std::make_tuple(x * scale, exp(x * y)); };
  auto run = [&](bool checkpointed) {
    a.zero_grad();
    b.zero_grad();
    Tensor p, q;
    if (checkpointed) std::tie(p, q) = checkpoint(fn, a, 2.5, b);
    else std::tie(p, q) = fn(a, 2.5, b);
    sum(p + q).backward();
    return testing::RunRecord().grad("a", a).grad("b", b);
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
}

TEST_CASE("checkpoint: parameters get gradients when no input requires grad (frozen input)", "[checkpoint][frozen]") {
  Generator init(7);
  nn::GPT gpt(test::small_gpt(2, 0.0), init);
  gpt.wte.weight = gpt.wte.weight.detach();  // a frozen embedding feeding checkpointed blocks
  const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
  test::check_checkpointing(gpt, Checkpointing::each_block(), [&] { return gpt.loss(idx, targets); });
  // compare_checkpointing leaves the gradients of the checkpointed run.
  CHECK_FALSE(gpt.wte.weight.grad().defined());
  CHECK(gpt.h[0]->attn.c_attn.weight.grad().defined());
}

TEST_CASE("checkpoint: under no_grad it just runs the function", "[checkpoint]") {
  test::FreshTape fresh;
  Generator g(8);
  Mlp mlp(g);
  no_grad guard;
  const Tensor y = checkpoint(mlp, randn({2, 8}, g));
  CHECK_FALSE(y.requires_grad());
  CHECK(fresh.tape.size() == 0);
}

TEST_CASE("checkpoint: is_replaying lets a module skip side effects during replay", "[checkpoint][replay]") {
  struct CountingLayer : nn::UnaryModule {
    nn::Linear inner{4, 4};
    int calls = 0;          // a side effect: must count real forwards only
    int replays_seen = 0;
    CountingLayer() { register_module("inner", inner); }
    Tensor forward(const Tensor& x) override {
      if (is_replaying()) ++replays_seen;
      else ++calls;
      return inner(x);
    }
  };
  CountingLayer layer;
  CHECK_FALSE(is_replaying());
  Tensor y = checkpoint(layer, randn({2, 4}));
  sum(y).backward();
  CHECK(layer.calls == 1);
  CHECK(layer.replays_seen == 1);
  CHECK_FALSE(is_replaying());
}

TEST_CASE("checkpoint: a replay with a different shape throws CheckpointError and leaves state sound", "[checkpoint][misuse]") {
  int call = 0;
  auto changing = [&](const Tensor& x) {
    ++call;
    return call == 1 ? x * 2.0f : narrow(x, 0, 0, 1) * 2.0f;  // the replay cuts a row
  };
  Tensor x = randn({2, 3}).requires_grad_();
  Tensor y = checkpoint(CheckpointOptions{"shifty"}, changing, x);
  const Generator::State rng_before = default_generator().state();
  bool threw = false;
  try {
    sum(y).backward();
  } catch (const CheckpointError& e) {
    threw = true;
    const std::string msg = e.what();
    CHECK(msg.find("shifty") != std::string::npos);
    CHECK(msg.find("output 0") != std::string::npos);
    CHECK(msg.find("(1, 3)") != std::string::npos);
    CHECK(msg.find("(2, 3)") != std::string::npos);
  }
  CHECK(threw);
  CHECK_FALSE(is_replaying());
  CHECK(default_generator().state() == rng_before);
  CHECK(detail::session().recording);
  CHECK(detail::tape_stack().size() == 1);
  // The library still works afterwards.
  Tensor z = randn({2}).requires_grad_();
  sum(z * 3.0f).backward();
  CHECK(test::values(z.grad()) == std::vector<float>{3, 3});
}

TEST_CASE("checkpoint: value drift is caught in checking mode, and names the output", "[checkpoint][misuse]") {
  float bias = 0.f;
  auto drifting = [&](const Tensor& x) { return std::make_tuple(x * 1.0f, x + bias); };
  Tensor x = randn({4}).requires_grad_();
  {
    CheckpointChecking on;
    auto [a, b] = checkpoint(CheckpointOptions{"drift"}, drifting, x);
    bias = 1.f;  // state the segment reads changes before backward
    REQUIRE_ERROR(sum(a + b).backward(), "drift", "output 1", "different values");
  }
  bias = 0.f;
  auto [a, b] = checkpoint(CheckpointOptions{"drift"}, drifting, x);
  bias = 1.f;
  sum(a + b).backward();  // shapes only: PyTorch's behaviour, the drift passes unseen
  CHECK(x.grad().defined());
}

TEST_CASE("checkpoint: a second backward through a freed segment throws", "[checkpoint][misuse]") {
  Generator g(9);
  Mlp mlp(g);
  Tensor y = sum(checkpoint(mlp, randn({2, 8}, g)));
  y.backward();
  REQUIRE_ERROR(y.backward(), "freed");
}

TEST_CASE("checkpoint: retain_graph replays the segment again", "[checkpoint]") {
  Generator g(10);
  Mlp mlp(g);
  Tensor y = sum(checkpoint(mlp, randn({2, 8}, g)));
  y.backward(true);
  const auto once = mlp.w1.grad().to_vector();
  y.backward();
  const auto twice = mlp.w1.grad().to_vector();
  for (std::size_t i = 0; i < once.size(); ++i) CHECK(twice[i] == Approx(2 * once[i]));
}
