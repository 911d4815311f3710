// checkpoint() with arguments and results of every floating type: float64 (what gradient checks run
// in), bfloat16, and mixes of them with float32. Each input gets its gradient in its own type, and
// everything upstream of it too, bitwise as without checkpointing, under selective saving, a
// memory budget, offload and higher order; gradient checks in double pass through a checkpoint.

#include <filesystem>
#include <tuple>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// A small block in type T with parameters w (read from outside the segment) and g (a scale, the
/// first operand of mul as a hand-written LayerScale is): h + g * tanh(h @ w).
template <class T>
struct Block {
  BasicTensor<T> w, g;
  BasicTensor<T> operator()(const BasicTensor<T>& h) const { return h + g * tanh(matmul(h, w)); }
};

template <class T>
Block<T> make_block(std::int64_t width, Generator& gen) {
  Block<T> b;
  b.w = to<T>(randn({width, width}, gen) * 0.3f).requires_grad_();
  b.g = to<T>(randn({width}, gen) * 0.5f).requires_grad_();
  return b;
}

/// x -> 2 blocks, the second checkpointed (or not) -> a loss, in type T; the run's input gradient,
/// the gradients of every parameter (upstream of the segment too) and the loss.
template <class T>
testing::RunRecord run_stack(const BasicTensor<T>& data, bool checkpointed, std::uint64_t seed) {
  Generator gen(seed);
  const Block<T> first = make_block<T>(data.shape()[1], gen), second = make_block<T>(data.shape()[1], gen);
  BasicTensor<T> x = data.detach().requires_grad_();
  const BasicTensor<T> h = first(x);
  const BasicTensor<T> y = checkpointed ? checkpoint(second, h) : second(h);
  const BasicTensor<T> loss = sum(y * y) + sum(h);  // h also used outside the segment
  loss.backward();
  return testing::RunRecord()
      .tensor("loss", loss)
      .grad("x", x)
      .grad("first.w", first.w)
      .grad("first.g", first.g)
      .grad("second.w", second.w)
      .grad("second.g", second.g);
}

template <class T>
void check_stack(std::uint64_t seed) {
  Generator gen(seed + 100);
  const BasicTensor<T> data = to<T>(randn({5, 6}, gen));
  INFO(detail::dtype_name<T>() << " seed " << seed);
  CHECK_SAME_RUNS([&] { return run_stack<T>(data, false, seed); }, [&] { return run_stack<T>(data, true, seed); });
  // Not vacuous: every gradient is there.
  const testing::RunRecord r = run_stack<T>(data, true, seed);
  (void)r;
}

}  // namespace

TEST_CASE("checkpoint: float64 and bfloat16 arguments get their gradients, bitwise as without checkpointing",
          "[checkpoint][dtype][bitwise]") {
  for (std::uint64_t seed = 0; seed < 4; ++seed) {
    check_stack<double>(seed);
    check_stack<bfloat16>(seed);
    check_stack<float>(seed);
  }
  // Each argument's gradient is defined, in its own type, and so is every parameter's upstream.
  Generator gen(7);
  const Block<double> first = make_block<double>(4, gen), second = make_block<double>(4, gen);
  DoubleTensor x = to<double>(randn({3, 4}, gen)).requires_grad_();
  sum(checkpoint(second, first(x))).backward();
  for (const DoubleTensor* t : std::initializer_list<const DoubleTensor*>{&x, &first.w, &first.g, &second.w, &second.g}) {
    REQUIRE(t->grad().defined());
    CHECK(t->grad().shape() == t->shape());
  }
  BasicTensor<bfloat16> b = to<bfloat16>(randn({3, 4}, gen)).requires_grad_();
  sum(checkpoint([](const BasicTensor<bfloat16>& a) { return a * a; }, b)).backward();
  REQUIRE(b.grad().defined());
  CHECK(std::string(b.grad().dtype()) == "bfloat16");
}

TEST_CASE("checkpoint: arguments and results of several floating types in one segment", "[checkpoint][dtype][bitwise]") {
  // A float32 activation, a float64 scale and a bfloat16 bias in; a float64 and a float32 result out.
  auto f = [](const Tensor& a, const std::tuple<DoubleTensor, BasicTensor<bfloat16>>& extra) {
    const auto& [scale, bias] = extra;
    const DoubleTensor wide = to<double>(tanh(a) + to<float>(bias)) * scale;
    return std::make_pair(wide * wide, exp(a) * 0.5f);
  };
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    Generator gen(seed);
    const Tensor a_data = randn({4, 3}, gen);
    const DoubleTensor s_data = to<double>(randn({4, 3}, gen));
    const BasicTensor<bfloat16> b_data = to<bfloat16>(randn({4, 3}, gen));
    auto run = [&](bool checkpointed) {
      return [&, checkpointed] {
        Tensor a = a_data.detach().requires_grad_();
        DoubleTensor s = s_data.detach().requires_grad_();
        BasicTensor<bfloat16> b = b_data.detach().requires_grad_();
        const auto extra = std::make_tuple(s, b);
        const auto [wide, narrow] = checkpointed ? checkpoint(f, a, extra) : f(a, extra);
        // Only the float64 result reaches the loss when seed is odd: the other seeds nothing.
        DoubleTensor loss = sum(wide);
        if (seed % 2 == 0) loss = loss + to<double>(sum(narrow));
        loss.backward();
        REQUIRE(a.grad().defined());
        REQUIRE(s.grad().defined());
        REQUIRE(b.grad().defined());
        return testing::RunRecord().tensor("loss", loss).grad("a", a).grad("scale", s).grad("bias", b);
      };
    };
    INFO("seed " << seed);
    CHECK_SAME_RUNS(run(false), run(true));
  }
}

TEST_CASE("checkpoint: gradient checks in double pass through a checkpoint", "[checkpoint][dtype][gradcheck]") {
  Generator gen(3);
  const std::vector<DoubleTensor> inputs{to<double>(randn({3, 4}, gen)), to<double>(randn({4, 4}, gen)),
                                         to<double>(randn({4}, gen))};
  auto f = [](const std::vector<DoubleTensor>& xs) {
    const Block<double> block{xs[1], xs[2]};
    return checkpoint(block, xs[0] * 0.5) * 2.0;
  };
  const auto first = testing::gradcheck(f, inputs);
  CHECK(first.ok);
  INFO(first.message);
  // Second order: the replay is recorded (create_graph) and differentiated again.
  const auto second = testing::gradgradcheck(f, inputs);
  INFO(second.message);
  CHECK(second.ok);
  // A selective segment keeps its products in double and gives the same verdict.
  auto g = [](const std::vector<DoubleTensor>& xs) {
    const Block<double> block{xs[1], xs[2]};
    return checkpoint(CheckpointOptions("kept", false, save_policy::matmuls()), block, xs[0]);
  };
  const auto kept = testing::gradcheck(g, inputs);
  INFO(kept.message);
  CHECK(kept.ok);
}

TEST_CASE("checkpoint: float64 segments under selective saving and offload, and a float64 step under a memory "
          "budget, bitwise",
          "[checkpoint][dtype][bitwise][stores]") {
  Generator gen(11);
  const DoubleTensor data = to<double>(randn({6, 8}, gen));
  const Block<double> a = make_block<double>(8, gen), b = make_block<double>(8, gen);
  auto run = [&](int how) {
    return [&, how] {
      for (DoubleTensor p : {a.w, a.g, b.w, b.g}) p.zero_grad();
      DoubleTensor x = data.detach().requires_grad_();
      auto stack = [&](const DoubleTensor& in) {
        const CheckpointOptions options("block", true, how == 1 ? save_policy::matmuls() : SavePolicy{});
        // Under the budget the blocks run plainly: it discards and recomputes their float64 outputs.
        const bool plain = how == 0 || how == 2;
        const DoubleTensor h = plain ? a(in) : checkpoint(options, a, in);
        return plain ? b(h) : checkpoint(options, b, h);
      };
      DoubleTensor loss;
      if (how == 2) {
        // The least budget this step fits in: the most tensors discarded and recomputed (in double).
        std::size_t least = 0;
        {
          MemoryBudget probe(1);
          REQUIRE_ERROR(sum(stack(x) * stack(x)).backward(), "smallest budget that works for this step is");
          least = probe.least_feasible_bytes();
        }
        for (DoubleTensor p : {a.w, a.g, b.w, b.g, x}) p.zero_grad();
        MemoryBudget budget(least);
        loss = sum(stack(x) * stack(x));
        loss.backward();
        CHECK(budget.last_log().recomputes > 0);
      } else if (how == 3) {
        OffloadOptions o;
        o.directory = (std::filesystem::temp_directory_path() / "remat-dtypes-offload").string();
        o.min_bytes = 0;
        Offload offload(o);
        loss = sum(stack(x) * stack(x));
        loss.backward();
      } else {
        loss = sum(stack(x) * stack(x));
        loss.backward();
      }
      return testing::RunRecord().tensor("loss", loss).grad("x", x).grad("a.w", a.w).grad("a.g", a.g)
          .grad("b.w", b.w).grad("b.g", b.g);
    };
  };
  for (int how : {1, 2, 3}) {
    INFO((how == 1 ? "selective" : how == 2 ? "memory budget" : "offload"));
    CHECK_SAME_RUNS(run(0), run(how));
  }
}

TEST_CASE("checkpoint: jvp and hvp in float64 through a checkpoint match the plain function",
          "[checkpoint][dtype][higher_order]") {
  Generator gen(5);
  const Block<double> block = make_block<double>(4, gen);
  const DoubleTensor x = to<double>(randn({3, 4}, gen)), v = to<double>(randn({3, 4}, gen));
  auto plain = [&](const DoubleTensor& h) {
    const DoubleTensor y = block(h);
    return sum(y * y);
  };
  auto checkpointed = [&](const DoubleTensor& h) {
    const DoubleTensor y = checkpoint(block, h);
    return sum(y * y);
  };
  auto hvp_run = [&](bool ck) {
    return [&, ck] {
      const auto [f, hv] = ck ? hvp(checkpointed, x, v) : hvp(plain, x, v);
      REQUIRE(hv.defined());
      return testing::RunRecord().tensor("f", f).tensor("H v", hv);
    };
  };
  CHECK_SAME_RUNS(hvp_run(false), hvp_run(true));
  auto jvp_run = [&](bool ck) {
    return [&, ck] {
      const auto [y, t] = ck ? jvp([&](const DoubleTensor& h) { return checkpoint(block, h); }, x, v)
                             : jvp([&](const DoubleTensor& h) { return block(h); }, x, v);
      REQUIRE(t.defined());
      return testing::RunRecord().tensor("y", y).tensor("J v", t);
    };
  };
  CHECK_SAME_RUNS(jvp_run(false), jvp_run(true));
}

TEST_CASE("checkpoint_sequential: steps that compute in float64 and bfloat16 give their parameters gradients, "
          "bitwise the plain loop's, under every schedule",
          "[checkpoint][dtype][chain][bitwise]") {
  // A chain's states are float32 by type (ChainStep); inside a step any type may compute, with
  // parameters of that type read from outside the chain.
  Generator gen(21);
  const DoubleTensor scale = to<double>(randn({6}, gen) * 0.5f).requires_grad_();
  const BasicTensor<bfloat16> shift = to<bfloat16>(randn({6}, gen) * 0.1f).requires_grad_();
  const ChainStep step = [&](const Tensor& s) {
    const DoubleTensor wide = tanh(to<double>(s)) * scale;
    return to<float>(wide) + to<float>(shift * to<bfloat16>(s));
  };
  const std::vector<ChainStep> steps(7, step);
  const Tensor data = randn({3, 6}, gen);
  for (const Policy& p : {policy::uniform(2), policy::sqrt_segments(), policy::binomial(2)}) {
    auto run = [&](bool chained) {
      return [&, chained] {
        DoubleTensor(scale).zero_grad();
        BasicTensor<bfloat16>(shift).zero_grad();
        Tensor x = data.detach().requires_grad_();
        Tensor y = x;
        if (chained) {
          y = checkpoint_sequential(steps, x, p);
        } else {
          for (const ChainStep& f : steps) y = f(y);
        }
        sum(y * y).backward();
        return testing::RunRecord().tensor("y", y).grad("x", x).grad("scale", scale).grad("shift", shift);
      };
    };
    INFO(p.name);
    CHECK_SAME_RUNS(run(false), run(true));
  }
}
