// Online placement against the offline optimum: for every chain length L up to --max-steps, the
// reversal cost of the snapshots OnlinePlacement kept while not knowing L, over F(L, s). Prints
// the worst ratio per s, where it occurs, and the share of lengths at the optimum exactly.
//   online_ratio --max-steps 100000 --snaps 3,5,10,20 [--horizon 1.2] [--sample 1000000]
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <remat/remat.hpp>

#include "flags.hpp"

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(argc, argv, {{"max-steps", "100000"}, {"snaps", "3,5,10,20"}, {"horizon", "1.2"}, {"sample", "0"}}, "online_ratio");
  const std::int64_t Lmax = std::stoll(a["max-steps"]), sample = std::stoll(a["sample"]);
  std::stringstream list(a["snaps"]);
  for (std::string item; std::getline(list, item, ',');) {
    const std::int64_t s = std::stoll(item);
    remat::OnlinePlacement place(s, std::stod(a["horizon"]));
    double worst = 1.0;
    std::int64_t worst_L = 1, optimal = 0, counted = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t end = std::max(Lmax, sample);
    for (std::int64_t L = 1; L <= end; ++L) {
      // The chain ends at L: its last step is L − 1, and x_L is never kept.
      if (L <= Lmax || L % 997 == 0 || L == end) {
        const std::int64_t online = place.cost(place.positions(), L), best = remat::binomial_min_advances(L, s);
        ++counted;
        if (online == best) ++optimal;
        const double ratio = best > 0 ? static_cast<double>(online) / static_cast<double>(best) : 1.0;
        if (ratio > worst) {
          worst = ratio;
          worst_L = L;
        }
        REMAT_CHECK(online >= best, "online cost {} below the optimum {} at L = {}, s = {}", online, best, L, s);
      }
      place.at(L);  // the chain goes on past x_L
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("{{\"snaps\": {}, \"max_steps\": {}, \"sampled_to\": {}, \"worst_ratio\": {:.4f}, \"at_L\": {}, "
               "\"optimal_share\": {:.4f}, \"decision_us\": {:.3f}}}\n", s, Lmax, end, worst, worst_L,
               static_cast<double>(optimal) / static_cast<double>(counted), 1e3 * ms / static_cast<double>(end));
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
