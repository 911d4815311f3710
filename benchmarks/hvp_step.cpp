// What a Hessian-vector product of a GPT's loss costs beside a gradient, per checkpointing policy:
// one first-order step (grad of the loss), hvp by forward-over-reverse (remat::hvp), and H·v by
// double backward (grad with create_graph, then grad of ⟨g, v⟩), alternating, the same weights,
// batch, direction and dropout masks.
//
//   bench_hvp_step [--layers 4] [--width 128] [--heads 4] [--context 64] [--batch 4] [--vocab 256]
//                  [--dropout 0.1] [--policies none,blocks,selective] [--repeats 5]
//
// Chain schedules (sqrt, uniform:K, binomial:S, budget:MB) run all three: hvp carries tangents
// through the schedule's replays; double backward's create_graph replays every step onto the tape
// and holds that graph (the chain's memory bound is hvp's, not double backward's).
//
// Columns per policy and method: the median time (ms, with the range over --repeats), the peak
// bytes above the step's start (memory_stats()'s live-byte peak: activations, saved tensors,
// tangents and gradients alike), each also as a ratio to the first-order step's, and the books'
// peak of saved activation bytes (peak_saved_activation_bytes: the saved tensors themselves; a
// tangent is in them only where a chain keeps it beside its snapshot).

#include <algorithm>
#include <chrono>
#include <sstream>

#include "flags.hpp"

using namespace remat;

namespace {

enum class Method { gradient, forward_over_reverse, double_backward };

struct Sample {
  double ms = 0;
  std::size_t peak = 0;
  std::size_t saved = 0;
};

Sample run(nn::GPT& gpt, Method method, const LongTensor& idx, const LongTensor& targets,
           const std::vector<Tensor>& direction) {
  std::vector<Tensor*> slots = gpt.parameters();
  std::vector<Tensor> params;
  for (Tensor* p : slots) params.push_back(*p);
  const auto loss = [&](const std::vector<Tensor>& p) {
    for (std::size_t i = 0; i < p.size(); ++i) *slots[i] = p[i];
    manual_seed(2);
    return gpt.loss(idx, targets);
  };
  reset_peak_memory_stats();
  const std::size_t base = memory_stats().live_bytes;
  const auto start = std::chrono::steady_clock::now();
  {
    if (method == Method::gradient) {
      (void)grad(loss(params), params);
    } else if (method == Method::forward_over_reverse) {
      (void)hvp(loss, params, direction);
    } else {
      GradOptions recorded;
      recorded.create_graph = true;
      const std::vector<Tensor> g = grad(loss(params), params, recorded);
      Tensor dot;
      for (std::size_t i = 0; i < g.size(); ++i) {
        const Tensor term = sum(g[i] * direction[i]);
        dot = dot.defined() ? dot + term : term;
      }
      (void)grad(dot, params);
    }
  }
  Sample s;
  s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  s.peak = memory_stats().peak_bytes - base;
  s.saved = memory_stats().peak_saved_activation_bytes;
  for (std::size_t i = 0; i < slots.size(); ++i) *slots[i] = params[i];
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(argc, argv,
                                      {{"layers", "4"},
                                       {"width", "128"},
                                       {"heads", "4"},
                                       {"context", "64"},
                                       {"batch", "4"},
                                       {"vocab", "256"},
                                       {"dropout", "0.1"},
                                       {"policies", "none,blocks,selective"},
                                       {"repeats", "5"}},
                                      "bench_hvp_step");
  const nn::GPTConfig cfg = bench::gpt_config(a, std::stod(a["dropout"]));
  const std::int64_t B = std::stoll(a["batch"]);
  const int repeats = std::stoi(a["repeats"]);
  Generator init(1);
  nn::GPT gpt(cfg, init);
  const LongTensor idx = randint(0, cfg.vocab_size, {B, cfg.block_size}, init);
  const LongTensor targets = randint(0, cfg.vocab_size, {B, cfg.block_size}, init);
  std::vector<Tensor> direction;
  for (Tensor* p : gpt.parameters()) direction.push_back(randn<float>(p->shape(), init) * 0.01f);

  fmt::print("GPT L={} C={} H={} T={} B={} V={}, dropout {}, {} repeats alternating\n", cfg.n_layer, cfg.n_embd,
             cfg.n_head, cfg.block_size, B, cfg.vocab_size, cfg.dropout, repeats);
  fmt::print("{:<16} {:<22} {:>24} {:>8} {:>12} {:>8} {:>9}\n", "policy", "method", "ms median [min, max]", "x grad",
             "peak MB", "x grad", "saved MB");
  std::stringstream list(a["policies"]);
  for (std::string policy; std::getline(list, policy, ',');) {
    const Checkpointing how = policy::parse(policy);
    apply_checkpointing(gpt, how);
    std::vector<Method> methods{Method::gradient, Method::forward_over_reverse, Method::double_backward};
    std::vector<std::vector<Sample>> samples(methods.size());
    for (int r = 0; r < repeats; ++r)
      for (std::size_t m = 0; m < methods.size(); ++m) samples[m].push_back(run(gpt, methods[m], idx, targets, direction));
    double grad_ms = 0;
    std::size_t grad_peak = 0;
    for (std::size_t m = 0; m < methods.size(); ++m) {
      std::vector<double> ms;
      for (const Sample& s : samples[m]) ms.push_back(s.ms);
      std::sort(ms.begin(), ms.end());
      const double median = ms[ms.size() / 2];
      const std::size_t peak = samples[m].back().peak;  // the same on every repeat: the books are exact
      if (m == 0) grad_ms = median, grad_peak = peak;
      const char* name = methods[m] == Method::gradient               ? "gradient"
                         : methods[m] == Method::forward_over_reverse ? "hvp (fwd-over-rev)"
                                                                      : "H·v (double backward)";
      fmt::print("{:<16} {:<22} {:>9.1f} [{:.1f}, {:.1f}] {:>7.2f}x {:>12.2f} {:>7.2f}x {:>9.2f}\n", policy, name, median,
                 ms.front(), ms.back(), median / grad_ms, peak / 1e6, double(peak) / double(grad_peak),
                 samples[m].back().saved / 1e6);
    }
  }
  return 0;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
