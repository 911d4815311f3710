#pragma once
// The vocabulary of chain schedules: the actions an executor runs (advance, snapshot, restore,
// free, record, reverse), what a step costs, and streams that hand actions out one batch at a
// time, so that no schedule is ever held whole.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace remat {

/// One executor action. The executor has a current state x_i (its position), snapshot slots, and
/// per-step recorded tapes.
struct Action {
  /// What the action does.
  enum class Kind {
    advance,   ///< x_{i+1} = f_i(x_i) without recording; position i -> i+1
    snapshot,  ///< keep the current x_i in a slot
    restore,   ///< position <- the kept x_i
    free,      ///< drop the kept x_i
    record,    ///< run f_i recorded on its own tape, kept for reverse; position i -> i+1
    reverse,   ///< backpropagate through step i's recorded tape (then free it)
  };
  /// What the action does.
  Kind kind;
  /// The step i it applies to (the first step, for an advance of several).
  std::int64_t step;
  std::int64_t count = 1;  ///< advance only: steps step .. step + count - 1, in one action
  bool disk = false;       ///< snapshot only: kept in a file (the slower tier) rather than in memory
  /// Every field equal.
  bool operator==(const Action& o) const {
    return kind == o.kind && step == o.step && count == o.count && disk == o.disk;
  }
};

/// What a step costs: compute (any unit, e.g. seconds or FLOPs), the bytes of its input state
/// x_i (what a snapshot of it holds), and the bytes its recorded tape saves. The fields after
/// activation_bytes say which of those bytes the executor shares or holds only for a while, so a
/// plan predicts what memory_stats() will count (measure_steps fills them; left at their
/// defaults, every recorded byte is the step's own for as long as it is recorded).
struct StepCost {
  /// The step's compute, in any unit (seconds, FLOPs), the same for all steps.
  double compute = 1.0;
  /// Bytes of its input state x_i: what a snapshot of it holds.
  std::size_t state_bytes = 0;
  std::size_t activation_bytes = 0;  ///< the most saved at once while recording and reversing it, all told
  std::size_t param_bytes = 0;       ///< of them, tensors from outside the chain (parameters)
  std::uint64_t params = 0;          ///< which ones: steps with the same nonzero id share them (counted once)
  bool reads_input = false;          ///< x_i is among them: one storage with its snapshot or the step before
  bool saves_output = false;         ///< x_{i+1} is among them: one storage with the next step or its snapshot
  bool compact = false;              ///< recorded in forward, it is held without its parameters (compact_records.hpp)
  std::size_t reverse_bytes = 0;     ///< of them, saved only while it is reversed (a checkpoint() inside replays)

  /// Field by field: two steps that cost the same get the same schedule.
  friend bool operator==(const StepCost& a, const StepCost& b) {
    return std::tie(a.compute, a.state_bytes, a.activation_bytes, a.param_bytes, a.params, a.reads_input,
                    a.saves_output, a.compact, a.reverse_bytes) ==
           std::tie(b.compute, b.state_bytes, b.activation_bytes, b.param_bytes, b.params, b.reads_input,
                    b.saves_output, b.compact, b.reverse_bytes);
  }
  /// Not field by field equal.
  friend bool operator!=(const StepCost& a, const StepCost& b) { return !(a == b); }
};

/// A schedule held as a list of actions, in the order the executor runs them.
using Schedule = std::vector<Action>;

/// A schedule produced one action at a time.
class ActionStream {
 public:
  virtual ~ActionStream() = default;
  /// Writes the next action to `out`; false at the end of the schedule.
  virtual bool next(Action& out) = 0;
  /// Writes up to n next actions to out and returns how many (fewer only at the end): one call
  /// per batch rather than per action, for consumers of long schedules.
  virtual std::size_t next(Action* out, std::size_t n) {
    std::size_t k = 0;
    while (k < n && next(out[k])) ++k;
    return k;
  }
  /// What the policy simplified to make this schedule (empty when nothing): shown by the plan.
  virtual std::string note() const { return {}; }
  /// Bytes the stream holds for its state (its frames, tables, or the list it streams from).
  virtual std::size_t state_bytes() const = 0;
};

namespace detail {

/// A stream over a list made in advance (for policies that solve for the whole schedule at once).
class ListStream final : public ActionStream {
 public:
  explicit ListStream(Schedule actions, std::string note = {}) : actions_(std::move(actions)), note_(std::move(note)) {}
  std::string note() const override { return note_; }
  std::size_t state_bytes() const override { return actions_.capacity() * sizeof(Action) + note_.capacity(); }
  bool next(Action& out) override {
    if (next_ == actions_.size()) return false;
    out = actions_[next_++];
    return true;
  }

 private:
  Schedule actions_;
  std::string note_;
  std::size_t next_ = 0;
};

}  // namespace detail

/// A stream read in batches: one virtual call per 256 actions rather than one per action (what
/// a million-step schedule costs its consumer is then the stream's own work).
class ActionReader {
 public:
  /// Reads `stream`, which it owns.
  explicit ActionReader(std::unique_ptr<ActionStream> stream) : stream_(std::move(stream)) {}
  /// The next action in `out`; false at the end of the stream.
  bool next(Action& out) {
    if (used_ == got_) {
      got_ = stream_->next(batch_.data(), batch_.size());
      used_ = 0;
      if (got_ == 0) return false;
    }
    out = batch_[used_++];
    return true;
  }

 private:
  std::unique_ptr<ActionStream> stream_;
  std::array<Action, 256> batch_{};
  std::size_t got_ = 0, used_ = 0;
};

/// The whole schedule as a list, each advance of several steps split into single steps: for
/// tests and small chains (a list of F(L, s) actions is exactly what streams avoid holding).
inline Schedule materialise(ActionStream& stream) {
  Schedule out;
  Action a{Action::Kind::free, 0};
  while (stream.next(a)) {
    if (a.kind == Action::Kind::advance) {
      for (std::int64_t i = 0; i < a.count; ++i) out.push_back({Action::Kind::advance, a.step + i});
    } else {
      out.push_back(a);
    }
  }
  return out;
}

namespace detail {

inline const char* action_name(Action::Kind k) {
  switch (k) {
    case Action::Kind::advance: return "advance";
    case Action::Kind::snapshot: return "snapshot";
    case Action::Kind::restore: return "restore";
    case Action::Kind::free: return "free";
    case Action::Kind::record: return "record";
    case Action::Kind::reverse: return "reverse";
  }
  return "?";
}

}  // namespace detail

}  // namespace remat
