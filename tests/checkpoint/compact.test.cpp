// Steps a chain records in forward are held by what their backward reads, and their graphs are
// rebuilt without computing anything when they are reversed (checkpoint/compact_records.hpp).
#include <catch2/catch.hpp>

#include <remat/remat.hpp>

#include "../support.hpp"

using namespace remat;

namespace {

// An RNN cell with dropout: its backward reads the matmul's input and the tanh's output. Records
// the gradients of the input and the weight.
testing::RunRecord rnn_grads(std::int64_t L, const Policy* policy, bool compact,
                             std::shared_ptr<ChainCounts> counts = nullptr) {
  Generator g(5);
  Tensor w = (randn({8, 8}, g) * 0.4f).detach().requires_grad_();
  Tensor x = randn({3, 8}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return dropout(tanh(matmul(h, w)), 0.25); };
  manual_seed(11);
  Tensor y;
  {
    CheckpointEarlyStop records(compact);
    if (policy) {
      y = checkpoint_sequential(cell, L, x, *policy, nullptr, counts);
    } else {
      y = x;
      for (std::int64_t i = 0; i < L; ++i) y = cell(y);
    }
  }
  sum(y * y).backward();
  return testing::RunRecord().grad("x", x).grad("w", w);
}

/// A run recording w's gradient after `steps` of `cell` from x: under policy::none as a chain
/// (counts given), or as a plain loop (counts null).
std::function<testing::RunRecord()> weight_grad(const ChainStep& cell, std::int64_t steps, const Tensor& x,
                                                Tensor& w, std::shared_ptr<ChainCounts> counts) {
  return [&cell, steps, &x, &w, counts] {
    w.zero_grad();
    Tensor y = x;
    if (counts) y = checkpoint_sequential(cell, steps, x, policy::none(), nullptr, counts);
    else for (std::int64_t i = 0; i < steps; ++i) y = cell(y);
    sum(y).backward();
    return testing::RunRecord().grad("w", w);
  };
}

}  // namespace

TEST_CASE("compact records: gradients bitwise equal to full records and to no chain, dropout on", "[chain][compact]") {
  const std::int64_t L = 23;
  auto plain = [&] { return rnn_grads(L, nullptr, true); };
  for (const Policy& p : {policy::none(), policy::uniform(4), policy::binomial(3), policy::sqrt_segments()}) {
    INFO(p.name);
    auto counts = std::make_shared<ChainCounts>();
    CHECK_SAME_RUNS(plain, [&] { return rnn_grads(L, &p, true, counts); });
    CHECK(counts->rebuilt >= 1);
    CHECK_SAME_RUNS(plain, [&] { return rnn_grads(L, &p, false); });
  }
}

TEST_CASE("compact records: the books count what a held step keeps, as its nodes would", "[chain][compact][memory]") {
  test::FreshTape fresh;
  Generator g(2);
  Tensor w = (randn({16, 16}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({4, 16}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return tanh(matmul(h, w)); };
  const std::int64_t L = 10;
  std::size_t saved[2] = {0, 0};
  for (const bool compact : {true, false}) {
    const std::size_t before = memory_stats().saved_bytes;
    CheckpointEarlyStop records(compact);
    Tensor y = checkpoint_sequential(cell, L, x, policy::none());
    // Each step's tanh output (the next step's input, which its matmul saves): L states, plus the
    // chain input the first matmul saves.
    saved[compact ? 0 : 1] = memory_stats().saved_bytes - before;
    sum(y).backward();
    CHECK(memory_stats().saved_bytes == before);
  }
  CHECK(saved[0] == static_cast<std::size_t>(L + 1) * x.nbytes());
  // Full records' nodes also hold the weight; a held step reads it through the step's own capture.
  CHECK(saved[1] == saved[0] + w.nbytes());
}

TEST_CASE("compact records: a step whose backward reads a tensor it made without an op is recorded in full",
          "[chain][compact]") {
  Generator g(3);
  Tensor w = (randn({6, 6}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 6}, g).requires_grad_();
  // The mul saves the factory-made scale, which a rebuild that computes nothing could not give back.
  const ChainStep cell = [&w](const Tensor& h) { return tanh(matmul(h, w) * full({2, 6}, 0.5f)); };
  auto counts = std::make_shared<ChainCounts>();
  CHECK_SAME_RUNS(weight_grad(cell, 7, x, w, nullptr), weight_grad(cell, 7, x, w, counts));
  CHECK(counts->records == 7);
  CHECK(counts->rebuilt == 0);
}

TEST_CASE("compact records: a held input written in place before backward is an error, not a wrong gradient",
          "[chain][compact]") {
  Generator g(4);
  Tensor w = (randn({5, 5}, g) * 0.3f).detach().requires_grad_();
  Tensor x = randn({2, 5}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return tanh(matmul(h, w)); };
  Tensor y = checkpoint_sequential(cell, 4, x, policy::none());
  x.data()[0] += 1.0f;  // the first matmul saved x
  CHECK_THROWS_AS(sum(y).backward(), Error);
}

TEST_CASE("compact records: a step that runs other ops when rebuilt is an error naming the step", "[chain][compact]") {
  Generator g(6);
  Tensor w = (randn({4, 4}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 4}, g).requires_grad_();
  // Same bytes, other ops: exp where the forward ran tanh would be handed tanh's output.
  const ChainStep cell = [&w](const Tensor& h) {
    const Tensor z = matmul(h, w);
    return is_replaying() ? exp(z) : tanh(z);
  };
  Tensor y = checkpoint_sequential(cell, 3, x, policy::none());
  try {
    sum(y).backward();
    FAIL("no error");
  } catch (const CheckpointError& e) {
    CHECK_THAT(e.what(), Catch::Contains("step 2 of 3") && Catch::Contains("other ops"));
  }
}

TEST_CASE("compact records: retain_graph runs the same backward twice", "[chain][compact]") {
  Generator g(7);
  Tensor w = (randn({4, 4}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 4}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return tanh(matmul(h, w)); };
  Tensor y = checkpoint_sequential(cell, 9, x, policy::binomial(2));
  sum(y).backward(Tensor(), true);
  const std::vector<float> once = w.grad().to_vector();
  w.zero_grad();
  sum(y).backward();
  CHECK(w.grad().to_vector() == once);
}

TEST_CASE("compact records: an online chain of one repeated step function", "[chain][compact][online]") {
  Generator g(8);
  Tensor w = (randn({4, 4}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 4}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return dropout(tanh(matmul(h, w)), 0.1); };
  auto run = [&](bool online) {
    w.zero_grad();
    if (online) {
      OnlineChain chain(x, 3);
      CHECK_THROWS_AS(chain.advance(), Error);  // nothing to repeat yet
      chain.advance(cell);
      for (int i = 1; i < 40; ++i) chain.advance();
      CHECK(chain.steps() == 40);
      sum(chain.finish()).backward();
    } else {
      Tensor h = x;
      for (int i = 0; i < 40; ++i) h = cell(h);
      sum(h).backward();
    }
    return testing::RunRecord().grad("w", w);
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); }, 3);
}

TEST_CASE("compact records: a step whose ops save its input and views of it", "[chain][compact]") {
  Generator g(9);
  Tensor w = (randn({4, 4}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 4}, g).requires_grad_();
  // matmul saves the input itself; the mul saves two reshapes of it, which share its storage.
  const ChainStep cell = [&w](const Tensor& h) {
    const Tensor flat = reshape(h, {8});
    return tanh(matmul(h, w)) + reshape(flat * reshape(h, {8}), {2, 4}) * 0.1f;
  };
  auto counts = std::make_shared<ChainCounts>();
  CHECK_SAME_RUNS(weight_grad(cell, 6, x, w, nullptr), weight_grad(cell, 6, x, w, counts));
  CHECK(counts->rebuilt == 6);
}
