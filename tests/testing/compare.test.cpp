#include <cmath>

#include "support.hpp"

#include <remat/testing/compare.hpp>

using namespace remat;

TEST_CASE("compare_gradients: equal runs pass, a drifting replay is reported at its first differing tensor",
          "[testing][compare]") {
  Generator init(5);
  nn::Sequential seq;
  nn::Linear& first = seq.emplace_back<nn::Linear>(4, 4, true, init);
  seq.emplace_back<nn::Linear>(4, 2, true, init);
  const Tensor x = randn({3, 4}, init);
  const testing::GradientComparison same =
      testing::compare_gradients(seq, [&] { return sum(seq(x)); }, [&] { return sum(checkpoint(seq, x)); });
  INFO(same.message);
  CHECK(same.equal);
  CHECK(same.tensors_compared == 5);
  CHECK(same.message.find("bitwise equal") != std::string::npos);

  // A segment that computes something else when replayed (its scale changes after the first call):
  // the loss agrees, the gradients do not, and the report names the first parameter that differs.
  int calls = 0;
  auto drifting = [&](const Tensor& h) { return seq(h) * (++calls == 1 ? 1.0f : 1.5f); };
  const testing::GradientComparison drift =
      testing::compare_gradients(seq, [&] { return sum(seq(x)); }, [&] { return sum(checkpoint(drifting, x)); });
  CHECK_FALSE(drift.equal);
  INFO(drift.message);
  CHECK(drift.message.find("gradient of 0.weight") != std::string::npos);
  CHECK(drift.message.find("first at flat index 0") != std::string::npos);
  CHECK(first.weight.grad().defined());
}

TEST_CASE("compare_gradients: a gradient missing on one side is a difference", "[testing][compare]") {
  Generator init(6);
  nn::Linear lin(3, 3, true, init);
  const Tensor x = randn({2, 3}, init);
  const testing::GradientComparison r = testing::compare_gradients(
      lin, [&] { return sum(lin(x)); }, [&] { return sum(linear(x, lin.weight, lin.bias.detach())); });
  CHECK_FALSE(r.equal);
  CHECK(r.message.find("gradient of bias") != std::string::npos);
  CHECK(r.message.find("has none") != std::string::npos);
}

TEST_CASE("compare_runs: input gradients, outputs, counts and generator states, each difference named",
          "[testing][compare]") {
  Generator init(7);
  const Tensor data = randn({3, 4}, init);
  bool drifting = false;
  int calls = 0, forwards = 0;
  auto segment = [&](const Tensor& h) {
    forwards += !is_replaying();
    return tanh(h) * (drifting && ++calls > 1 ? 1.5f : 1.0f);  // when drifting, the replay scales
  };
  auto run = [&](bool checkpointed) {
    return [&, checkpointed] {
      calls = forwards = 0;
      Tensor x = data.detach().requires_grad_();
      Tensor y = checkpointed ? checkpoint(segment, x) : segment(x);
      sum(y * y).backward();
      (void)randn({2});
      return testing::RunRecord()
          .tensor("output", y)
          .grad("x", x)
          .count("forwards", forwards)
          .state("the default generator", default_generator().state());
    };
  };
  const testing::GradientComparison same = testing::compare_runs(run(false), run(true), 3);
  INFO(same.message);
  CHECK(same.equal);
  CHECK(same.tensors_compared == 4);
  CHECK(same.message == "2 tensors bitwise equal and 2 counts equal");

  // The replay of the drifting segment: the output agrees, x's gradient does not.
  drifting = true;
  const testing::GradientComparison drift = testing::compare_runs(run(false), run(true), 3);
  INFO(drift.message);
  CHECK_FALSE(drift.equal);
  CHECK(drift.tensors_compared == 2);
  CHECK(drift.message.find("gradient of x (shape (3, 4)): 12 of 12 elements differ") != std::string::npos);

  // Counts compare exactly, generator states by seed and offset.
  auto counted = [](long long n, std::uint64_t seed) {
    return [n, seed] { return testing::RunRecord().count("calls", n).state("mine", Generator(seed).state()); };
  };
  CHECK(testing::compare_runs(counted(1, 5), counted(2, 5)).message == "calls: 1 (reference) vs 2 (checkpointed)");
  CHECK(testing::compare_runs(counted(1, 5), counted(1, 6)).message ==
        "mine: seed 5, offset 0 (reference) vs seed 6, offset 0 (checkpointed)");
}

TEST_CASE("compare_runs: a gradient neither run gave, and records of other entries, are differences",
          "[testing][compare]") {
  const Tensor frozen = randn({2});
  auto none = [&] { return testing::RunRecord().grad("w", frozen); };
  const testing::GradientComparison missing = testing::compare_runs(none, none);
  CHECK_FALSE(missing.equal);
  CHECK(missing.message == "gradient of w: neither run gave a gradient");
  // A tensor() entry may be undefined in both runs.
  auto undefined = [&] { return testing::RunRecord().tensor("gradient of w", frozen.grad()); };
  CHECK(testing::compare_runs(undefined, undefined).equal);

  auto one = [] { return testing::RunRecord().count("a", 1); };
  auto other = [] { return testing::RunRecord().count("b", 1); };
  auto two = [] { return testing::RunRecord().count("a", 1).count("b", 2); };
  CHECK(testing::compare_runs(one, other).message == "entry 0: 'a' in the reference run, 'b' in the checkpointed one");
  const testing::GradientComparison longer = testing::compare_runs(one, two);
  CHECK_FALSE(longer.equal);
  CHECK(longer.message.find("recorded 1 entries and the checkpointed run 2; the first unmatched is b") !=
        std::string::npos);
}

TEST_CASE("compare_runs: float64 and bfloat16 tensors compared bit for bit, their type named",
          "[testing][compare][dtype]") {
  const DoubleTensor a = to<double>(randn({2, 3}));
  DoubleTensor b = detail::copy_of(a);
  b.data()[4] = std::nextafter(b.data()[4], 1e300);  // one unit in the last place of a double
  auto record = [](const DoubleTensor& t) { return [t] { return testing::RunRecord().tensor("x", t); }; };
  CHECK(testing::compare_runs(record(a), record(detail::copy_of(a))).equal);
  const testing::GradientComparison off = testing::compare_runs(record(a), record(b));
  CHECK_FALSE(off.equal);
  INFO(off.message);
  CHECK(off.message.find("x (shape (2, 3), float64): 1 of 6 elements differ; first at flat index 4") !=
        std::string::npos);
  const BasicTensor<bfloat16> h = to<bfloat16>(randn({4}));
  auto narrow = [&] { return testing::RunRecord().tensor("x", h); };
  auto wide = [&] { return testing::RunRecord().tensor("x", to<float>(h)); };
  CHECK(testing::compare_runs(narrow, narrow).equal);
  CHECK(testing::compare_runs(narrow, wide).message == "x: bfloat16 vs float32");
}
