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
