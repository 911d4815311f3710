#pragma once
// When a step read each output a memory budget registered, kept for the next step's search.
//
// DTR's staleness guesses from the past which tensor is needed last. A training step repeats the
// last one, so a budget living across steps can know instead: the step records, on a clock that
// its own decisions cannot move, when each output (op invocation, output) was read — as the
// input of a later op of the forward, or by a backward node — and the next step's search weighs a
// candidate by the distance to its next read (Belady's rule, priced by recompute cost per byte).
// On the clock: one tick per op the forward registers and per saved tensor a backward node
// reads; recomputations do not tick (they are what decisions change). Measured on the deep GPT
// (32 blocks of 128) at per-block checkpointing's activation peak, one thread: the search by
// staleness recomputed 3.11 GFLOP a step, the search knowing the last step's reads 2.56 (per-block
// replays, which skip each block's last product: 2.42 by their ops' count).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <utility>
#include <vector>

namespace remat::detail {

class BudgetUses {
 public:
  /// A distance beyond any step: an output with no read ahead.
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max() / 4;

  /// One tick of the step's clock: an op registered, or a saved tensor read by a backward node.
  void tick() { ++now_; }
  /// The ticks of the step so far.
  std::uint64_t now() const { return now_; }

  /// Output `output` of the step's op invocation `op` was read at this tick.
  void read(std::size_t op, std::size_t output) { recording_[{op, output}].push_back(now_); }

  /// The step ended: its reads are what the next step looks ahead with (`keep`), or nothing is
  /// (the step is not one to repeat).
  void end_step(bool keep) {
    ahead_ = keep ? std::move(recording_) : Reads{};
    recording_.clear();
    now_ = 0;
  }
  /// The step stopped repeating the last one: the reads ahead name other ops now.
  void forget_ahead() { ahead_.clear(); }
  /// Whether there are reads to look ahead with.
  bool ahead() const { return !ahead_.empty(); }

  /// The next tick after now at which the last step read that output; kNever if it did not.
  std::uint64_t next_read(std::size_t op, std::size_t output) const {
    const auto it = ahead_.find({op, output});
    if (it == ahead_.end()) return kNever;
    const auto next = std::upper_bound(it->second.begin(), it->second.end(), now_);  // ticks in order
    return next == it->second.end() ? kNever : *next;
  }

 private:
  using Reads = std::map<std::pair<std::size_t, std::size_t>, std::vector<std::uint64_t>>;
  Reads recording_, ahead_;
  std::uint64_t now_ = 0;
};

}  // namespace remat::detail
