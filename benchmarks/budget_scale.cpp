// The budget planner at scale: time and peak RSS to plan a chain of L steps of unequal cost
// under a byte budget (a fraction of what recording everything would hold). One L per process,
// so the peak RSS is this plan's.
//   budget_scale --steps 1000 --fraction 0.25 --seed 1
#include <chrono>
#include <map>
#include <random>
#include <string>

#include <sys/resource.h>

#include <remat/remat.hpp>

#include "flags.hpp"

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(argc, argv, {{"steps", "1000"}, {"fraction", "0.25"}, {"seed", "1"}}, "budget_scale");
  const std::int64_t L = std::stoll(a["steps"]);
  std::mt19937_64 rng(std::stoull(a["seed"]));
  std::uniform_int_distribution<int> d(1, 8);
  std::vector<remat::StepCost> costs;
  std::size_t total = 0;
  for (std::int64_t i = 0; i < L; ++i) {
    costs.push_back({static_cast<double>(d(rng)), static_cast<std::size_t>(d(rng)) * 1024,
                     static_cast<std::size_t>(d(rng)) * 8192});
    total += costs.back().state_bytes + costs.back().activation_bytes;
  }
  const auto budget = static_cast<std::size_t>(std::stod(a["fraction"]) * static_cast<double>(total));
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  const auto t0 = std::chrono::steady_clock::now();
  const remat::Plan p = remat::plan(remat::policy::budget(budget), L, costs);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  double all = 0;
  for (const remat::StepCost& c : costs) all += c.compute;
  fmt::print("{{\"steps\": {}, \"budget\": {}, \"ms\": {:.1f}, \"peak_rss_kb\": {}, \"rss_growth_kb\": {}, "
             "\"peak_bytes\": {}, \"compute_over_forward\": {:.3f}, \"note\": \"{}\"}}\n",
             L, budget, ms, after.ru_maxrss, after.ru_maxrss - before.ru_maxrss, p.peak_bytes, p.compute / all, p.note);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
