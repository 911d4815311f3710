#pragma once
// What a memory budget's step decided and did (BudgetLog, its BudgetEvents), and the static plan
// made from it (DiscardPlan) that later steps of the same shape replay without searching. The
// budget itself is remat/checkpoint/runtime_budget.hpp.

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace remat {

/// One decision or consequence of a budgeted step.
struct BudgetEvent {
  /// discard: an output's bytes freed; recompute: computed again on a read; overflow: a moment that
  /// did not fit even with everything discardable discarded.
  enum class Kind { discard, recompute, overflow };
  /// Which of the three.
  Kind kind;
  std::size_t moment = 0;  ///< which request for room of the step (discard, overflow)
  std::size_t op_index = 0;  ///< the op invocation, counted from 0 among those the step registered
  std::size_t output = 0;  ///< which of its outputs
  std::string op;          ///< its name
  std::size_t bytes = 0;   ///< discarded or recomputed bytes; for overflow, the bytes the moment needed
  double flops = 0;        ///< recompute cost: estimated (discard) or spent (recompute)
  /// Through the disk (a budget with BudgetOffload): a discard written to a file first, which the
  /// matching recompute reads back instead of computing; flops is then what computing would cost.
  bool disk = false;

  /// One line naming the kind, the op and output, bytes and flops.
  std::string str() const {
    switch (kind) {
      case Kind::discard:
        return fmt::format("{} #{}.{} {:<22} {:>12} B   rebuild {:.3g} flop  (request {})", disk ? "to disk  " : "discard  ",
                           op_index, output, op, bytes, flops, moment);
      case Kind::recompute:
        if (disk) return fmt::format("read back #{}.{} {:<22} {:>12} B", op_index, output, op, bytes);
        return fmt::format("recompute #{}.{} {:<22} {:>12} B   {:.3g} flop", op_index, output, op, bytes, flops);
      case Kind::overflow:
        return fmt::format("overflow  request {}: {} B saved needed with nothing left to discard", moment, bytes);
    }
    return {};
  }
};

/// What one budgeted step decided and did.
struct BudgetLog {
  /// The byte limit the step ran under.
  std::size_t budget = 0;
  /// Every discard, recompute and overflow, in order.
  std::vector<BudgetEvent> events;
  ///@{
  /// How many discards and recomputes the step made.
  std::size_t discards = 0, recomputes = 0;
  ///@}
  /// Op invocations registered with how to recompute them (those computed for a recorded graph).
  std::size_t registered = 0;
  /// Outputs let go once nothing but recomputations held them (not decisions: no budget keeps them).
  std::size_t releases = 0;
  /// What the recomputes cost, in flops.
  double recomputed_flops = 0;
  ///@{
  /// Of the discards, those written to disk, and of the recomputes, those read back (BudgetOffload);
  /// the bytes written, and the seconds writing and reading took.
  std::size_t to_disk = 0, read_back = 0, disk_bytes = 0;
  double write_seconds = 0, read_seconds = 0;
  ///@}
  /// Searches for what to discard (the run-time heuristic). A step replaying a plan makes none.
  std::size_t decisions = 0;
  /// The wall time those searches took, in seconds: the index scanned for each decision.
  double search_seconds = 0;
  /// The wall time spent before searches bringing up to date the costs that discards, rebuilds
  /// and releases changed since the last search (deferred from those moments to here), in seconds.
  double recost_seconds = 0;
  /// Discards a plan named that the step could not carry out (the step differed from the plan's).
  std::size_t plan_misses = 0;
  /// Whether the step began replaying the last step's decisions (a budget living across steps
  /// reuses them while the ops repeat).
  bool reused_plan = false;
  /// Whether a step that began replaying went back to searching because its ops differed.
  bool plan_abandoned = false;
  /// Whether the step searched knowing when the last step read each output (a budget living
  /// across steps searches its second step so, then replays the cheaper of the two searches).
  bool looked_ahead = false;
  std::size_t peak_saved_bytes = 0;  ///< of this thread's saved activation bytes during the step
  /// When the step did not fit: the budget its decisions (this log) fit, measured; else 0.
  std::size_t least_feasible = 0;

  /// A summary line: budget, peak saved bytes, discards and recomputes.
  std::string str() const {
    std::string out = fmt::format("memory budget {} B: peak saved {} B, {} discards, {} recomputes ({:.3g} flop), "
                                  "{} releases, {} decisions\n", budget, peak_saved_bytes, discards, recomputes,
                                  recomputed_flops, releases, decisions);
    if (to_disk || read_back)
      out += fmt::format("  of which {} written to disk ({} B, {:.3g} s) and {} read back ({:.3g} s)\n", to_disk,
                         disk_bytes, write_seconds, read_back, read_seconds);
    for (const BudgetEvent& e : events) out += "  " + e.str() + "\n";
    return out;
  }
};

/// A static plan: what to discard at which request for room, taken from one step's log. Replayed by
/// a MemoryBudget in later steps of the same shape, it makes the same discards without searching.
struct DiscardPlan {
  /// Discard output `output` of the op_index-th op at the moment-th request for room.
  struct Discard {
    ///@{
    /// Which request for room, which op of the step, which of its outputs.
    std::size_t moment, op_index, output;
    ///@}
  };

  /// The byte limit the plan fits.
  std::size_t budget = 0;
  std::vector<Discard> discards;  ///< in order of moment

  /// The plan of a logged step, under its budget — or, for a step that did not fit, under the
  /// least budget its decisions fit (so replaying it is the retry that is sure to succeed).
  static DiscardPlan from(const BudgetLog& log) {
    DiscardPlan plan;
    plan.budget = std::max(log.budget, log.least_feasible);
    for (const BudgetEvent& e : log.events)
      if (e.kind == BudgetEvent::Kind::discard) plan.discards.push_back({e.moment, e.op_index, e.output});
    return plan;
  }
};

/// DiscardPlan's earlier name (it clashed with the chain planner's Plan).
using RematPlan = DiscardPlan;

}  // namespace remat
