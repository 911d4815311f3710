#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("policy::parse: every word the command lines accept, and clear errors", "[checkpoint][apply]") {
  CHECK(policy::parse("none").kind == Checkpointing::Kind::none);
  CHECK(policy::parse("blocks").kind == Checkpointing::Kind::each_block);
  CHECK_FALSE(policy::parse("blocks").save);
  const Checkpointing selective = policy::parse("selective");
  CHECK(selective.kind == Checkpointing::Kind::each_block);
  REQUIRE(selective.save);
  const Shape s{2, 2};
  CHECK(selective.save(OpOutput{op::matmul, s, "float32", 1, 16, 16.0, false}));
  CHECK_FALSE(selective.save(OpOutput{op::gelu, s, "float32", 1, 16, 4.0, false}));
  CHECK(policy::parse("uniform:3").schedule->name == "uniform:3");
  CHECK(policy::parse("sqrt").schedule->name == policy::sqrt_segments().name);
  CHECK(policy::parse("binomial:4").schedule->name == "binomial:4");
  CHECK(policy::parse("budget:1.5").schedule->needs_costs);
  for (const char* bad : {"uniform", "uniform:", "uniform:0", "uniform:2.5", "binomial:-1", "budget:x", "sqrt:3",
                          "blocks:2", "revolve:3", ""})
    REQUIRE_ERROR(policy::parse(bad), "policy::parse", "none, blocks", "binomial:S", "budget:MB");
}

TEST_CASE("apply_checkpointing: any Sequential of blocks, checkpointed from outside, bitwise equal", "[checkpoint][apply]") {
  Generator init(21);
  nn::Sequential seq;
  for (int i = 0; i < 5; ++i) seq.emplace_back<nn::TransformerBlock>(16, 2, 0.1, true, init);
  const Tensor x = randn({2, 6, 16}, init);
  for (const char* how : {"blocks", "selective", "uniform:2", "sqrt", "binomial:2"}) {
    INFO(how);
    const testing::GradientComparison r =
        testing::compare_checkpointing(seq, policy::parse(how), [&] { return sum(seq(x)); }, 9);
    INFO(r.message);
    CHECK(r.equal);
    CHECK(r.tensors_compared == seq.parameters().size() + 1);
  }
  CHECK_FALSE(seq.block_runner());  // compare_checkpointing put the plain runner back
}

TEST_CASE("apply_checkpointing: checkpointing every block keeps only block boundaries", "[checkpoint][apply]") {
  test::FreshTape fresh;
  Generator init(22);
  nn::Sequential seq;
  for (int i = 0; i < 3; ++i) seq.emplace_back<nn::Linear>(8, 8, true, init);
  const Tensor x = randn({4, 8}, init).requires_grad_();
  apply_checkpointing(seq, Checkpointing::each_block());
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y = seq(x);
  CHECK(memory_stats().saved_bytes - before == 3 * x.nbytes());  // each segment's input, nothing inside
  CHECK(fresh.tape.size() == 3);
  sum(y).backward();
  apply_checkpointing(seq, Checkpointing::none());
  Tensor z = seq(x);
  CHECK(memory_stats().saved_bytes - before > 3 * x.nbytes());
}
