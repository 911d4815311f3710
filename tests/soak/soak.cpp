// Soak: trains a small GPT with checkpointing for many steps and checks that the process does not
// grow — resident memory after the warm-up step and after the last step within a limit. Run in
// the test suite at a small size; `soak --steps 10000` is the full run.
//   soak [--steps 1000] [--warmup 100] [--policy blocks] [--limit-kb 1024]
#include <cstdio>
#include <map>
#include <string>

#include <unistd.h>

#include <remat/remat.hpp>

namespace {

/// Resident set size of this process in bytes (/proc/self/statm, second field, in pages).
std::size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  REMAT_CHECK(f != nullptr, "soak: cannot read /proc/self/statm");
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  REMAT_CHECK(n == 2, "soak: /proc/self/statm has an unexpected format");
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace remat;
  std::map<std::string, std::string> a{{"steps", "1000"}, {"warmup", "100"}, {"policy", "blocks"}, {"limit-kb", "1024"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = std::string(argv[i]).substr(2);
    REMAT_CHECK(a.count(k), "soak: unknown flag --{}", k);
    a[k] = argv[i + 1];
  }
  const std::int64_t steps = std::stoll(a["steps"]), warmup = std::stoll(a["warmup"]);
  REMAT_CHECK(steps > warmup && warmup > 0, "soak: needs steps > warmup > 0");
  nn::GPTConfig cfg;
  cfg.vocab_size = 31;
  cfg.block_size = 16;
  cfg.n_layer = 4;
  cfg.n_head = 2;
  cfg.n_embd = 32;
  cfg.dropout = 0.1;
  Generator gen(7);
  manual_seed(7);
  nn::GPT model(cfg, gen);
  apply_checkpointing(model, policy::parse(a["policy"]));
  optim::AdamW opt(model.parameters(), {1e-3});
  std::size_t at_warmup = 0, peak_saved = 0;
  double loss_value = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    const LongTensor idx = randint(0, cfg.vocab_size, {4, cfg.block_size}, gen);
    const LongTensor targets = randint(0, cfg.vocab_size, {4, cfg.block_size}, gen);
    MemoryScope scope;
    Tensor loss = model.loss(idx, targets);
    loss.backward();
    optim::clip_grad_norm(model.parameters(), 1.0);
    opt.step();
    opt.zero_grad();
    loss_value = loss.item();
    peak_saved = std::max(peak_saved, scope.peak_saved_bytes());
    if (step == warmup) at_warmup = resident_bytes();
  }
  const std::size_t at_end = resident_bytes();
  const long growth = static_cast<long>(at_end) - static_cast<long>(at_warmup);
  const long limit = std::stol(a["limit-kb"]) * 1024;
  fmt::print("soak: {} steps under {}: RSS {:.2f} MB after step {}, {:.2f} MB after step {} (growth {:+.1f} KB, limit "
             "{} KB); tensor bytes live at the end {}, peak saved per step {}, last loss {:.4f}\n", steps, a["policy"],
             static_cast<double>(at_warmup) / (1 << 20), warmup, static_cast<double>(at_end) / (1 << 20), steps,
             static_cast<double>(growth) / 1024, limit / 1024, memory_stats().live_bytes, peak_saved, loss_value);
  return growth <= limit ? 0 : 1;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
