// Bookkeeping of long chains: an RNN cell h' = tanh(h W) with d = 32 (a 128-byte state) run for
// L steps under a policy. Reports, per step, the process's resident growth at the end of forward
// (everything the chain holds: tensors and bookkeeping), the tensor bytes the library's books
// count as saved, and the time per step of the forward, the backward and (binomial) per action.
//   chain_overhead --steps 100000 --policy none|binomial:S|sqrt [--step rnn|scale] [--records compact|full]
// With --step scale every step is one multiply of 32 floats: what is left is mostly the executor's
// cost per action (and per recorded step: a tape and a node); --step rnn shows one cell's beside it.
// --records full keeps the graph of every step recorded in forward (early stop off) instead of
// holding it by what its backward reads (compact_records.hpp).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include <unistd.h>

#include <remat/remat.hpp>

#include "flags.hpp"

namespace {
long rss_kb() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}
}  // namespace

int main(int argc, char** argv) try {
  using namespace remat;
  bench::Flags a = bench::parse_flags(argc, argv, {{"steps", "100000"}, {"policy", "none"}, {"step", "rnn"}, {"records", "compact"}}, "chain_overhead");
  const std::int64_t L = std::stoll(a["steps"]);
  Generator g(1);
  Tensor w = (randn({32, 32}, g) * 0.2f).detach().requires_grad_();
  const bool identity = a["step"] == "scale";
  REMAT_CHECK(identity || a["step"] == "rnn", "chain_overhead: --step is rnn or scale, got {}", a["step"]);
  const ChainStep cell = identity ? ChainStep([](const Tensor& h) { return h * 1.0f; })
                                  : ChainStep([&w](const Tensor& h) { return tanh(matmul(h, w)); });
  const Tensor x = randn({1, 32}, g).requires_grad_();
  const bool compact = a["records"] == "compact";
  REMAT_CHECK(compact || a["records"] == "full", "chain_overhead: --records is compact or full, got {}", a["records"]);
  const Checkpointing how = policy::parse(a["policy"]);
  REMAT_CHECK(how.kind != Checkpointing::Kind::each_block, "chain_overhead: {} is not a chain schedule", a["policy"]);
  const Policy p = how.schedule ? *how.schedule : policy::none();
  set_allocator_caching(false);
  const long rss0 = rss_kb();
  const std::size_t saved0 = memory_stats().saved_bytes;
  auto counts = std::make_shared<ChainCounts>();
  const auto t0 = std::chrono::steady_clock::now();
  Tensor y = compact ? checkpoint_sequential(cell, L, x, p, nullptr, counts) : [&] {
    CheckpointEarlyStop full_records(false);  // steps recorded in forward keep their graphs
    return checkpoint_sequential(cell, L, x, p, nullptr, counts);
  }();
  const auto t1 = std::chrono::steady_clock::now();
  const long rss1 = rss_kb();
  const std::size_t saved1 = memory_stats().saved_bytes;
  sum(y).backward();
  const auto t2 = std::chrono::steady_clock::now();
  const Plan planned = plan(p, L);
  const double fwd = std::chrono::duration<double, std::micro>(t1 - t0).count();
  const double bwd = std::chrono::duration<double, std::micro>(t2 - t1).count();
  fmt::print("{{\"policy\": \"{}\", \"steps\": {}, \"rss_growth_per_step_B\": {:.0f}, \"saved_per_step_B\": {:.0f}, "
             "\"forward_us_per_step\": {:.3f}, \"backward_us_per_step\": {:.3f}, \"advances\": {}, \"records\": {}, "
             "\"actions\": {}, \"us_per_action\": {:.3f}, \"step\": \"{}\", \"held\": \"{}\", \"rebuilt\": {}}}\n",
             a["policy"], L, 1024.0 * static_cast<double>(rss1 - rss0) / static_cast<double>(L),
             static_cast<double>(saved1 - saved0) / static_cast<double>(L), fwd / static_cast<double>(L),
             bwd / static_cast<double>(L), counts->advances, counts->records, planned.actions,
             (fwd + bwd) / static_cast<double>(planned.actions), a["step"], a["records"], counts->rebuilt);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
