// Memory/time trade-off: peak bytes saved for backward and step time of a GPT chain of L blocks
// under each policy, and a long RNN chain under binomial. One JSON line per measurement.
#include <chrono>
#include <cmath>
#include <optional>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  auto measure = [](std::int64_t L, const std::string& name, std::optional<Policy> p) {
    nn::GPTConfig cfg;
    cfg.n_layer = L;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.block_size = 64;
    cfg.vocab_size = 64;
    Generator gen(0);
    nn::GPT model(cfg, gen);
    apply_checkpointing(model, p ? Checkpointing::chain(*p) : Checkpointing::none());
    const LongTensor idx = randint(0, 64, {4, 64}, gen), tgt = randint(0, 64, {4, 64}, gen);
    double best = 1e30;
    std::size_t peak = 0;
    for (int rep = 0; rep < 3; ++rep) {
      model.zero_grad();
      const std::size_t base = memory_stats().saved_bytes;
      MemoryScope scope;
      const auto t0 = std::chrono::steady_clock::now();
      model.loss(idx, tgt).backward();
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      peak = scope.peak_saved_bytes() - base;
    }
    fmt::print("{{\"chain\": \"gpt\", \"L\": {}, \"policy\": \"{}\", \"saved_peak\": {}, \"ms\": {:.3f}}}\n", L, name, peak, best);
  };
  for (std::int64_t L : {4, 8, 16, 32, 64}) {
    measure(L, "none", std::nullopt);
    measure(L, "uniform:2", policy::uniform(2));
    measure(L, "sqrt", policy::sqrt_segments());
    const auto s = static_cast<std::int64_t>(std::ceil(std::log2(static_cast<double>(L))));
    measure(L, "binomial:log2L", policy::binomial(s));
  }
  // A long chain: an RNN cell applied L times, binomial(10).
  for (std::int64_t L : {1000, 10000}) {
    Generator g(1);
    Tensor w = (randn({32, 32}, g) * 0.2f).detach().requires_grad_();
    const ChainStep cell = [&](const Tensor& h) { return tanh(matmul(h, w)); };
    const std::vector<ChainStep> steps(static_cast<std::size_t>(L), cell);
    for (const auto& [name, p] : std::vector<std::pair<std::string, Policy>>{{"binomial:10", policy::binomial(10)},
                                                                            {"sqrt", policy::sqrt_segments()},
                                                                            {"none", policy::none()}}) {
      auto counts = std::make_shared<ChainCounts>();
      const std::size_t base = memory_stats().saved_bytes;
      MemoryScope scope;
      const auto t0 = std::chrono::steady_clock::now();
      sum(checkpoint_sequential(steps, randn({1, 32}, g), p, nullptr, counts)).backward();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      fmt::print("{{\"chain\": \"rnn\", \"L\": {}, \"policy\": \"{}\", \"saved_peak\": {}, \"ms\": {:.3f}, \"advances\": {}}}\n", L,
                 name, scope.peak_saved_bytes() - base, ms, counts->advances);
      w.zero_grad();
    }
  }
}
