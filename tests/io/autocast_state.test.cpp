// Training state under remat::autocast (issue 27, item 5): bfloat16 tensors of the caller's saved
// and loaded bit for bit beside the float32 state, and an autocast training run (checkpointing and
// dropout on) stopped, saved, loaded into another model and optimizer and continued, ending bitwise
// where the uninterrupted run ends — the in-process form of tests/resume/kill_and_resume.sh.
#include <cstring>

#include "support.hpp"

using namespace remat;

// Names of their own: the io tests are built as one unity translation unit.
namespace {

struct AutocastStatePath : test::TempFile {
  explicit AutocastStatePath(const std::string& name) : test::TempFile("autocast_state_" + name) {}
};

std::uint16_t bf16_bits_of(bfloat16 h) { return Eigen::numext::bit_cast<std::uint16_t>(h); }

bool same_bits(const BFloat16Tensor& a, const BFloat16Tensor& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

/// A 2-layer GPT (dropout 0.1, blocks checkpointed) and AdamW, trained one step at a time with the
/// forward under autocast (`mixed`) and the backward outside it. `long_guard`: one autocast guard
/// lives across the steps instead (backward and the optimizer's step inside it too), so a scope's
/// parameter casts outlive an optimizer step and a load.
struct AutocastRun {
  Generator init;
  nn::GPT gpt;
  optim::AdamW opt;
  std::vector<float> losses;

  explicit AutocastRun(std::uint64_t seed) : init(seed), gpt(test::small_gpt(2, 0.1), init), opt(gpt.parameters(), {3e-3}) {
    apply_checkpointing(gpt, policy::parse("blocks"));
  }
  void step(std::int64_t t, bool mixed = true) {
    Generator data(500 + static_cast<std::uint64_t>(t));
    const LongTensor idx = randint(0, 23, {2, 12}, data), targets = randint(0, 23, {2, 12}, data);
    opt.zero_grad();
    Tensor loss;
    {
      autocast on(mixed);
      loss = gpt.loss(idx, targets);
    }
    loss.backward();
    opt.step();
    losses.push_back(loss.item());
  }
  std::vector<std::vector<float>> weights() {
    std::vector<std::vector<float>> out;
    for (Tensor* p : gpt.parameters()) out.push_back(p->to_vector());
    return out;
  }
  std::map<std::string, std::vector<float>> buffers() const {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [k, t] : opt.state().tensors) out[k] = t.to_vector();
    return out;
  }
};

}  // namespace

TEST_CASE("training state: bfloat16 tensors of the caller's round-trip bit for bit, every pattern, beside float32 ones",
          "[io][state][bfloat16]") {
  AutocastStatePath f("bf16");
  Generator init(1);
  nn::Linear a(4, 3, true, init), b(4, 3, true, init);
  optim::AdamW oa(a.parameters()), ob(b.parameters());
  BFloat16Tensor every(Shape{65536});
  for (std::uint32_t i = 0; i < 65536; ++i)
    every.data()[i] = Eigen::numext::bit_cast<bfloat16>(static_cast<std::uint16_t>(i));
  io::TrainingState s;
  s.step = 4;
  s.tensors["loss_history"] = tensor({2.5f, 2.0f});
  s.bfloat16_tensors["every_pattern"] = every;
  s.bfloat16_tensors["weight_bf16"] = to<bfloat16>(a.weight.detach());
  io::save_training_state(f.path, a, oa, s);

  // On disk as BF16, 2 bytes an element (PyTorch reads it as torch.bfloat16).
  const io::TensorFile file = io::read_safetensors(f.path);
  CHECK(file.at("user.every_pattern").dtype == "BF16");
  CHECK(file.at("user.every_pattern").data.size() == 2 * 65536);
  CHECK(file.at("user.loss_history").dtype == "F32");

  const io::TrainingState got = io::load_training_state(f.path, b, ob);
  REQUIRE(got.bfloat16_tensors.size() == 2);
  CHECK(same_bits(got.bfloat16_tensors.at("every_pattern"), every));
  for (std::uint32_t i : {0x7fc0u, 0xffffu, 0x0001u, 0x8000u, 0x7f80u})  // NaNs, a subnormal, -0, inf: as written
    CHECK(bf16_bits_of(got.bfloat16_tensors.at("every_pattern").data()[i]) == i);
  // The weights it was narrowed from were loaded too: narrowing them again gives the same bits.
  CHECK(same_bits(got.bfloat16_tensors.at("weight_bf16"), to<bfloat16>(b.weight.detach())));
  CHECK(got.tensors.size() == 1);
  CHECK(got.tensors.at("loss_history").to_vector() == std::vector<float>{2.5f, 2.0f});

  // One name for a float32 and a bfloat16 tensor is refused: they would be one entry in the file.
  s.bfloat16_tensors["loss_history"] = every;
  REQUIRE_ERROR(io::save_training_state(f.path, a, oa, s), "'loss_history' names a float32 and a bfloat16 tensor");
}

TEST_CASE("training state: an autocast run saved, loaded into another model and continued ends bitwise where the "
          "uninterrupted run ends", "[io][state][autocast]") {
  constexpr std::int64_t kSteps = 6, kSaveAt = 3;
  manual_seed(11);
  AutocastRun whole(1);
  for (std::int64_t t = 0; t < kSteps; ++t) whole.step(t);

  for (const bool warm_cache : {false, true}) {
    INFO((warm_cache ? "the resumed process ran an autocast forward with its own weights before loading, in one guard"
                     : "a guard per step"));
    AutocastStatePath f(warm_cache ? "resume_warm" : "resume");
    manual_seed(11);
    AutocastRun first(1);
    for (std::int64_t t = 0; t < kSaveAt; ++t) first.step(t);
    io::TrainingState s;
    s.step = kSaveAt;
    s.bfloat16_tensors["lm_head_bf16"] = to<bfloat16>(first.gpt.lm_head.weight.detach());
    io::save_training_state(f.path, first.gpt, first.opt, s);

    AutocastRun resumed(2);  // other initial weights, no optimizer state, another generator state
    manual_seed(99);
    std::optional<autocast> outer;
    if (warm_cache) {
      // An autocast scope alive across the load: the bfloat16 copies it made of the weights it
      // had must not be what the resumed steps multiply with.
      outer.emplace();
      Generator data(7);
      (void)resumed.gpt.loss(randint(0, 23, {2, 12}, data), randint(0, 23, {2, 12}, data)).item();
    }
    const io::TrainingState got = io::load_training_state(f.path, resumed.gpt, resumed.opt);
    REQUIRE(got.step == kSaveAt);
    CHECK(same_bits(got.bfloat16_tensors.at("lm_head_bf16"), to<bfloat16>(resumed.gpt.lm_head.weight.detach())));
    for (std::int64_t t = got.step; t < kSteps; ++t) resumed.step(t);
    outer.reset();
    CHECK(resumed.weights() == whole.weights());
    CHECK(resumed.buffers() == whole.buffers());
    const std::vector<float> tail(whole.losses.begin() + kSaveAt, whole.losses.end());
    CHECK(resumed.losses == tail);
  }

  // The comparison sees precision: the same resume continued in float32 ends elsewhere.
  AutocastStatePath f("resume_fp32");
  manual_seed(11);
  AutocastRun first(1);
  for (std::int64_t t = 0; t < kSaveAt; ++t) first.step(t);
  io::save_training_state(f.path, first.gpt, first.opt, {});
  AutocastRun fp32(2);
  (void)io::load_training_state(f.path, fp32.gpt, fp32.opt);
  for (std::int64_t t = kSaveAt; t < kSteps; ++t) fp32.step(t, false);
  CHECK(fp32.weights() != whole.weights());
}
