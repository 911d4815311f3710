#pragma once
// policy::two_tier: snapshots in two tiers — a few slots in memory, more in files on disk, where
// writing and reading a snapshot costs time (given relative to one step's compute). The schedule
// is the binomial one over k + ram slots with the k shallowest snapshots on disk (they are
// restored least; see BinomialStream), and k in 0..disk_slots is the one whose predicted time
//   advances + writes·write_cost + reads·read_cost
// is least for the chain's length: more disk slots mean fewer recomputed steps but more file
// traffic. This is the best of that family, found by counting each candidate's schedule — in the
// spirit of the two-level schedules of Aupy, Herrmann et al. (Disk-Revolve, H-Revolve), not their
// optimal dynamic program, which can also space disk snapshots differently from memory ones.

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "remat/checkpoint/schedule.hpp"

namespace remat {

/// Cost of moving one snapshot to and from disk, in units of one step's compute.
struct TierCosts {
  double write = 1.0;
  double read = 1.0;
};

namespace detail {

/// Predicted time of the two-tier binomial schedule with `slots` slots, the `disk_depth`
/// shallowest on disk: plan()'s counting pass over its stream.
inline double two_tier_time(std::int64_t L, std::int64_t slots, std::int64_t disk_depth, const TierCosts& c) {
  const Plan p = analyse("two_tier candidate", L, [=]() -> std::unique_ptr<ActionStream> {
    return std::make_unique<BinomialStream>(L, slots, disk_depth);
  }, nullptr);
  return static_cast<double>(p.advances) + c.write * static_cast<double>(p.disk_writes) +
         c.read * static_cast<double>(p.disk_reads);
}

}  // namespace detail

namespace policy {

/// Binomial checkpointing over `ram_slots` snapshots in memory and up to `disk_slots` in files
/// under `directory` (which must exist), using as many disk slots as make the chain fastest for
/// the given costs. The plan's table marks the snapshots that go to disk.
inline Policy two_tier(std::int64_t ram_slots, std::int64_t disk_slots, std::string directory, TierCosts costs = {}) {
  REMAT_CHECK(ram_slots >= 0 && disk_slots >= 0 && ram_slots + disk_slots >= 1,
              "policy::two_tier: needs at least one snapshot slot (memory or disk), got {} in memory and {} on disk",
              ram_slots, disk_slots);
  REMAT_CHECK(disk_slots == 0 || !directory.empty(), "policy::two_tier: {} disk slots need a directory", disk_slots);
  REMAT_CHECK(costs.write >= 0 && costs.read >= 0, "policy::two_tier: costs must be non-negative, got write {} read {}",
              costs.write, costs.read);
  // The choice depends on L only; the stream is asked for more than once per chain (plan, forward,
  // each backward), so the choice is remembered.
  struct Choices {
    std::mutex mutex;
    std::map<std::int64_t, std::int64_t> disk_used;
  };
  auto choices = std::make_shared<Choices>();
  Policy p{fmt::format("two_tier:{}+{}", ram_slots, disk_slots), false,
           [ram_slots, disk_slots, costs, choices](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
             std::int64_t k = 0;
             {
               std::lock_guard<std::mutex> lock(choices->mutex);
               auto it = choices->disk_used.find(L);
               if (it == choices->disk_used.end()) {
                 double best = 0;
                 for (std::int64_t d = ram_slots == 0 ? 1 : 0; d <= disk_slots; ++d) {
                   const double t = detail::two_tier_time(L, ram_slots + d, d, costs);
                   if (d == (ram_slots == 0 ? 1 : 0) || t < best) {
                     best = t;
                     k = d;
                   }
                 }
                 choices->disk_used[L] = k;
               } else {
                 k = it->second;
               }
             }
             return std::make_unique<detail::BinomialStream>(L, ram_slots + k, k);
           }};
  p.disk_directory = std::move(directory);
  return p;
}

}  // namespace policy
}  // namespace remat
