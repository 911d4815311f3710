#pragma once
// policy::two_tier: snapshots in two tiers — a few slots in memory, more in files on disk, where
// writing and reading a snapshot costs time (given relative to one step's compute) — scheduled for
// the least predicted time by the dynamic program of schedule/two_level.hpp.

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "remat/checkpoint/snapshot.hpp"
#include "remat/schedule/schedule.hpp"
#include "remat/schedule/two_level.hpp"

namespace remat {
namespace detail {

/// What a plan predicts its schedule costs over two tiers: advances + write·writes + read·reads.
inline double tier_time(const Plan& p, const TierCosts& c) {
  return static_cast<double>(p.advances) + c.write * static_cast<double>(p.disk_writes) +
         c.read * static_cast<double>(p.disk_reads);
}

/// Predicted time of the binomial schedule with `slots` slots, the `disk_depth` shallowest on
/// disk (BinomialStream): plan()'s counting pass over its stream. The family the two-tier policy
/// was before it solved for the optimum, kept to compare against.
inline double two_tier_time(std::int64_t L, std::int64_t slots, std::int64_t disk_depth, const TierCosts& c) {
  return tier_time(analyse("two_tier candidate", L, [=]() -> std::unique_ptr<ActionStream> {
    return std::make_unique<BinomialStream>(L, slots, disk_depth);
  }, nullptr), c);
}

}  // namespace detail

namespace policy {

/// Checkpointing over `ram_slots` snapshots in memory and up to `disk_slots` in files under
/// `directory` (which must exist), each written and read at the given costs (relative to one
/// step): the schedule of least predicted time, advances + write·writes + read·reads, by the
/// dynamic program of schedule/two_level.hpp — exact up to its tables' length, and past it the
/// better of the grouped tables and the binomial-with-disk family (the plan's note says which).
/// The plan's table marks the snapshots that go to disk. A relative directory is taken against
/// the working directory when the policy is made: a chdir later changes nothing.
inline Policy two_tier(std::int64_t ram_slots, std::int64_t disk_slots, std::string directory, TierCosts costs = {}) {
  REMAT_CHECK(ram_slots >= 0 && disk_slots >= 0 && ram_slots + disk_slots >= 1,
              "policy::two_tier: needs at least one snapshot slot (memory or disk), got {} in memory and {} on disk",
              ram_slots, disk_slots);
  REMAT_CHECK(disk_slots == 0 || !directory.empty(), "policy::two_tier: {} disk slots need a directory", disk_slots);
  REMAT_CHECK(costs.write >= 0 && costs.read >= 0, "policy::two_tier: costs must be non-negative, got write {} read {}",
              costs.write, costs.read);
  // The choice depends on L only; the stream is asked for more than once per chain (plan, forward,
  // each backward), so it is made once per length. Past the exact tables' length the grouped
  // tables are compared with the binomial-with-disk family (binomial over d + ram slots, the d
  // shallowest on disk), and the faster is used: with few slots, splits on group boundaries can
  // cost more than the family's free placement.
  struct Choice {
    std::shared_ptr<const detail::TwoLevelTable> table;
    std::int64_t family_disk = -1;  // ≥ 0: the family member used instead
    std::string note;
  };
  struct Choices {
    std::mutex mutex;
    std::map<std::int64_t, Choice> by_length;
  };
  auto choices = std::make_shared<Choices>();
  Policy p{fmt::format("two_tier:{}+{}", ram_slots, disk_slots), false,
           [ram_slots, disk_slots, costs, choices](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
             Choice c;
             {
               std::lock_guard<std::mutex> lock(choices->mutex);
               Choice& slot = choices->by_length[L];
               if (!slot.table) {
                 slot.table = std::make_shared<const detail::TwoLevelTable>(L, ram_slots, disk_slots, costs);
                 if (slot.table->group() > 1) {
                   double best = slot.table->time();
                   for (std::int64_t d = ram_slots == 0 ? 1 : 0; d <= disk_slots; ++d) {
                     const double t = detail::two_tier_time(L, ram_slots + d, d, costs);
                     if (t < best) {
                       best = t;
                       slot.family_disk = d;
                     }
                   }
                   if (slot.family_disk >= 0)
                     slot.note = fmt::format("two tiers: binomial over {} slots with {} on disk, predicted {:.0f}, faster than "
                                             "the tables over {} groups of {} steps ({:.0f})", ram_slots + slot.family_disk,
                                             slot.family_disk, best, slot.table->groups(), slot.table->group(),
                                             slot.table->time());
                 }
               }
               c = slot;
             }
             if (c.family_disk >= 0) {
               auto family = std::make_unique<detail::BinomialStream>(L, ram_slots + c.family_disk, c.family_disk);
               family->with_note(std::move(c.note));
               return family;
             }
             return std::make_unique<detail::TwoLevelStream>(std::move(c.table));
           }};
  p.disk_directory = detail::absolute_directory(directory);
  return p;
}

}  // namespace policy
}  // namespace remat
