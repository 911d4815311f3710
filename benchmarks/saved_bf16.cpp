// What keeping activations in 16 bits costs in gradient accuracy and saves in bytes: one GPT step
// per (policy, compute precision, saved format), the same weights, batch and dropout masks, each
// step's parameter gradients compared with the float32 step without checkpointing.
//
//   bench_saved_bf16 [--layers 8] [--width 256] [--heads 4] [--context 128] [--batch 8] [--vocab 256]
//                    [--dropout 0.1] [--policies none,blocks,sqrt]
//
// Compute: fp32, or bf16 (remat::autocast around the forward; with its parameter-cast cache, or
// without: autocast(true, false)). Saved: as computed, or bf16
// (SaveInBFloat16 around the forward: every float32 activation a node saves kept in bfloat16).
// Columns: the bytes the graph holds for backward when the forward ends (memory_stats()'s live
// bytes above the step's start: the books, packed copies included), and the gradient error
// ‖g − g_fp32‖ / ‖g_fp32‖ over all parameters together and for the worst single parameter.

#include <cmath>
#include <optional>
#include <sstream>

#include "flags.hpp"

using namespace remat;

namespace {

struct Step {
  std::size_t held = 0;                    // bytes held for backward at the end of forward
  std::vector<std::vector<float>> grads;   // per parameter
};

enum class Compute { fp32, bf16, bf16_uncached };

Step run(nn::GPTConfig cfg, const std::string& policy, Compute compute, bool save_bf16, const LongTensor& idx,
         const LongTensor& targets) {
  Generator init(1);
  nn::GPT gpt(cfg, init);
  if (policy != "none") apply_checkpointing(gpt, policy::parse(policy));
  manual_seed(2);
  Step s;
  const std::size_t base = memory_stats().live_bytes;
  Tensor loss;
  {
    std::optional<autocast> precision;
    if (compute != Compute::fp32) precision.emplace(true, compute == Compute::bf16);
    std::optional<SaveInBFloat16> format;
    if (save_bf16) format.emplace();
    loss = gpt.loss(idx, targets);
  }
  s.held = memory_stats().live_bytes - base;
  loss.backward();
  for (Tensor* p : gpt.parameters()) s.grads.push_back(p->grad().to_vector());
  return s;
}

/// (‖g − ref‖ / ‖ref‖ over everything, the worst parameter's own ratio).
std::pair<double, double> error(const Step& s, const Step& ref) {
  double diff_all = 0, norm_all = 0, worst = 0;
  for (std::size_t i = 0; i < ref.grads.size(); ++i) {
    double diff = 0, norm = 0;
    for (std::size_t j = 0; j < ref.grads[i].size(); ++j) {
      diff += std::pow(double(s.grads[i][j]) - ref.grads[i][j], 2);
      norm += std::pow(double(ref.grads[i][j]), 2);
    }
    diff_all += diff;
    norm_all += norm;
    if (norm > 0) worst = std::max(worst, std::sqrt(diff / norm));
  }
  return {std::sqrt(diff_all / norm_all), worst};
}

}  // namespace

int main(int argc, char** argv) {
  bench::Flags a = bench::parse_flags(argc, argv,
                                      {{"layers", "8"}, {"width", "256"}, {"heads", "4"}, {"context", "128"},
                                       {"batch", "8"}, {"vocab", "256"}, {"dropout", "0.1"},
                                       {"policies", "none,blocks,sqrt"}},
                                      "bench_saved_bf16");
  const nn::GPTConfig cfg = bench::gpt_config(a, std::stod(a["dropout"]));
  const std::int64_t B = std::stoll(a["batch"]), T = cfg.block_size;
  Generator data(3);
  const LongTensor idx = randint(0, cfg.vocab_size, {B, T}, data), targets = randint(0, cfg.vocab_size, {B, T}, data);
  const Step ref = run(cfg, "none", Compute::fp32, false, idx, targets);
  fmt::print("GPT L {} d {} T {} B {}, dropout {}; error against the float32 step without checkpointing\n\n",
             cfg.n_layer, cfg.n_embd, T, B, cfg.dropout);
  fmt::print("| policy | compute | saved | held for backward (MB) | gradient error | worst parameter |\n");
  fmt::print("|---|---|---|---|---|---|\n");
  std::stringstream policies(a["policies"]);
  for (std::string policy; std::getline(policies, policy, ',');)
    for (Compute compute : {Compute::fp32, Compute::bf16, Compute::bf16_uncached})
      for (bool save : {false, true}) {
        const Step s = run(cfg, policy, compute, save, idx, targets);
        const auto [all, worst] = error(s, ref);
        const char* name = compute == Compute::fp32 ? "fp32" : compute == Compute::bf16 ? "bf16" : "bf16, no cast cache";
        fmt::print("| {} | {} | {} | {:.2f} | {:.2e} | {:.2e} |\n", policy, name,
                   save ? "bf16" : "as computed", static_cast<double>(s.held) / 1e6, all, worst);
      }
}
