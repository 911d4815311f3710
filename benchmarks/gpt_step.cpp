// One training step of the benchmark GPT (forward, backward, SGD), timed per step, with the peak
// of bytes saved for backward. Prints one JSON line for benchmarks/run.py.
//   gpt_step --layers 8 --width 256 --heads 4 --context 128 --batch 8 --vocab 256
//            --mode none|blocks|selective|uniform:K|sqrt|binomial:S|budget:MB --steps 5 --warmup 1
//            --early-stop 1|0 (replays stop at the last output backward reads, or replay every op)
//            --attention fused|explicit (one fused op, or matmul, mask, softmax, dropout, matmul as
//            the PyTorch peer computes it)
//            --precision fp32|bf16 (bf16: each step's forward under remat::autocast, matmul and linear
//            on bfloat16 operands with float32 sums; backward outside it, as the PyTorch peer's
//            torch.autocast("cpu", dtype=torch.bfloat16); weights, gradients, SGD float32)
#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include <remat/remat.hpp>

#include "flags.hpp"

int main(int argc, char** argv) try {
  using namespace remat;
  bench::Flags a = bench::parse_flags(argc, argv,
                                      {{"layers", "8"}, {"width", "256"}, {"heads", "4"}, {"context", "128"},
                                       {"batch", "8"}, {"vocab", "256"}, {"mode", "none"}, {"steps", "5"},
                                       {"warmup", "1"}, {"dropout", "0.1"}, {"early-stop", "1"},
                                       {"attention", "fused"}, {"precision", "fp32"}},
                                      "gpt_step");
  const nn::GPTConfig cfg = bench::gpt_config(a, std::stod(a["dropout"]));
  const std::int64_t B = std::stoll(a["batch"]);
  Generator gen(0);
  nn::GPT model(cfg, gen);
  REMAT_CHECK(a["attention"] == "fused" || a["attention"] == "explicit",
              "gpt_step: --attention is fused or explicit, got {}", a["attention"]);
  for (auto& block : model.h) block->attn.fused = a["attention"] == "fused";
  REMAT_CHECK(a["precision"] == "fp32" || a["precision"] == "bf16", "gpt_step: --precision is fp32 or bf16, got {}",
              a["precision"]);
  const bool bf16 = a["precision"] == "bf16";
  const std::string mode = a["mode"];
  apply_checkpointing(model, policy::parse(mode));
  const CheckpointEarlyStop early_stop(a["early-stop"] != "0");
  optim::SGD sgd(model.parameters(), {1e-3});
  const LongTensor idx = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
  const LongTensor targets = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
  std::vector<double> ms;
  std::size_t peak_saved = 0;
  const auto skipped_before = early_stop_stats();
  const int warmup = std::stoi(a["warmup"]), steps = std::stoi(a["steps"]);
  for (int s = 0; s < warmup + steps; ++s) {
    const std::size_t base = memory_stats().saved_bytes;
    MemoryScope scope;
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss;
    {
      const autocast precision(bf16);  // forward only; backward outside, as in PyTorch
      loss = model.loss(idx, targets);
    }
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) ms.push_back(t);
    peak_saved = std::max(peak_saved, scope.peak_saved_bytes() - base);
  }
  const auto skipped = early_stop_stats();
  const double per_step = 1.0 / (warmup + steps);
  fmt::print("{{\"impl\": \"remat\", \"attention\": \"{}\", \"precision\": \"{}\", \"mode\": \"{}\", \"ms\": [{:.3f}], "
             "\"saved_peak\": {}, \"threads\": {}, \"early_stop_ops\": {}, \"early_stop_gflop\": {:.4f}, "
             "\"products\": \"{}\"}}\n", a["attention"], a["precision"], mode, fmt::join(ms, ", "), peak_saved,
             get_num_threads(), static_cast<double>(skipped.ops - skipped_before.ops) * per_step,
             (skipped.flops - skipped_before.flops) * per_step / 1e9,
             a["precision"] == "bf16" ? remat::gemm_bf16_backend() : remat::gemm_backend());
  return 0;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
