#pragma once
// Schedules for chains x_{i+1} = f_i(x_i), i = 0..L-1. A policy is a pure function from the chain
// length (and, for budget, per-step costs) to a schedule: a stream of actions that one executor
// (chain.hpp) runs as they come. Streams hold state that does not grow with the chain (binomial:
// O(s) frames; uniform, sqrt, none: a few counters), so nothing proportional to L or to the
// number of actions is ever held. Being pure, policies are tested without tensors.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "remat/core/error.hpp"

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

/// A schedule with what running it will do, readable before any run.
struct Plan {
  /// The name of the policy that made it.
  std::string policy;
  /// The chain length L it plans.
  std::int64_t steps = 0;
  /// A fresh stream of the plan's actions (each call starts from the beginning).
  std::function<std::unique_ptr<ActionStream>()> stream;
  std::size_t actions = 0;            ///< actions in the stream (an advance of several steps is one)
  std::size_t forward_actions = 0;    ///< actions run during the forward pass (up to recording f_{L-1})
  std::int64_t advances = 0;          ///< non-recording step executions
  std::int64_t records = 0;           ///< recorded step executions
  std::int64_t peak_snapshots = 0;    ///< snapshots alive at once, at most
  std::int64_t peak_recorded = 0;     ///< recorded tapes alive at once, at most
  /// Whether it was planned with per-step costs (the byte and compute predictions need them).
  bool has_costs = false;
  std::size_t peak_bytes = 0;         ///< predicted peak of snapshot + recorded bytes (needs costs)
  std::size_t forward_end_bytes = 0;  ///< predicted bytes held at the end of forward (needs costs)
  double compute = 0;                 ///< predicted compute of advances + records (needs costs)
  std::string note;                   ///< what the policy simplified (e.g. steps planned in groups)
  std::int64_t disk_writes = 0;       ///< snapshots written to disk
  std::int64_t disk_reads = 0;        ///< restores read from disk
  std::int64_t peak_disk_snapshots = 0;  ///< of peak_snapshots, on disk at most
  std::string disk_directory;         ///< where disk snapshots go (the policy's)

  /// The actions as a list (advances split into single steps): small chains and tests only.
  Schedule materialise() const {
    auto s = stream();
    return remat::materialise(*s);
  }
  /// The plan in a few lines of bounded size, however long the chain: its counts and bytes, and
  /// the first and last few lines of its action table.
  std::string str() const;
  /// The whole action table (runs of one action over consecutive steps as one line): for short
  /// chains; a plan of more than `max_actions` actions is an error rather than megabytes of text.
  std::string actions_str(std::size_t max_actions = 100000) const;
};

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

/// β(s, r) = C(s + r, s), saturating instead of overflowing.
inline std::uint64_t beta(std::int64_t s, std::int64_t r) {
  if (s < 0 || r < 0) return 0;
  std::uint64_t b = 1;
  for (std::int64_t i = 1; i <= r; ++i) {
    const std::uint64_t num = b * static_cast<std::uint64_t>(s + i);
    if (b != 0 && num / b != static_cast<std::uint64_t>(s + i)) return std::numeric_limits<std::uint64_t>::max();
    b = num / static_cast<std::uint64_t>(i);
  }
  return b;
}

/// The least r with β(s, r) ≥ l: how often the busiest step runs when s slots reverse l steps.
inline std::int64_t binomial_repetitions(std::int64_t l, std::int64_t s) {
  std::int64_t r = 0;
  std::uint64_t b = 1;  // β(s, r), stepped as β(s, r) = β(s, r − 1)·(s + r)/r (exact: a binomial)
  while (b < static_cast<std::uint64_t>(l)) {
    ++r;
    const std::uint64_t f = static_cast<std::uint64_t>(s + r);
    if (b > std::numeric_limits<std::uint64_t>::max() / f) return r;  // β(s, r) ≥ 2^64 / (s + r) > any l
    b = b * f / static_cast<std::uint64_t>(r);
  }
  return r;
}

}  // namespace detail

// Derivation of the binomial schedule (Griewank 1992; Griewank & Walther, "Algorithm 799: Revolve").
// Reverse l steps holding x_0 in one of s snapshot slots, the position at x_0; the last step to be
// reversed is run recorded, so the count F(l, s) is of advances (non-recording executions).
//   • l = 1: record and reverse step 0: F(1, s) = 0.
//   • s = 1: only x_0 is kept, so each step j is reached again from x_0: F(l, 1) = Σ_{j<l} j = l(l−1)/2.
//   • otherwise pick m, advance to x_m (m executions) and snapshot it; reverse [m, l) with s − 1 free
//     slots (x_0 still occupies one), then free x_m, restore x_0 and reverse [0, m) with all s slots:
//         F(l, s) = min_{0<m<l} { m + F(l − m, s − 1) + F(m, s) }.
// The minimum has a closed form. Count repetitions: β(s, r) = C(s + r, s) is the longest chain
// that s slots reverse with no step run more than r times. Proof of β(s, r) = β(s, r − 1) +
// β(s − 1, r) (Pascal's rule, hence the binomial): place the first snapshot at m; the steps before
// m were already run once to reach x_m, so the prefix has r − 1 repetitions left with s slots, and
// the suffix has r repetitions with s − 1 slots. With r the least integer such that β(s, r) ≥ l,
// summing the split recurrence gives Griewank's count (Prop. 1 of his 1992 paper)
//   F(l, s) = r·l − β(s + 1, r − 1),
// i.e. every step runs r times except for β(s + 1, r − 1) executions that the slack between l and
// β(s, r) saves. The split cost m + F(l − m, s − 1) + F(m, s) is convex in m (F is convex in l),
// so the smallest optimal m is well defined; binomial_split gives it in closed form, and the tests check that the
// emitted schedule's advance count equals the closed form for every l ≤ 200, s ≤ 12.

/// Griewank's minimum number of non-recording step executions to reverse l steps with s
/// snapshots (the chain's input counting as one), the last step recorded directly:
/// F(l, s) = r·l − β(s+1, r−1), r the least integer with β(s, r) ≥ l.
inline std::int64_t binomial_min_advances(std::int64_t l, std::int64_t s) {
  REMAT_CHECK(l >= 1 && s >= 1, "binomial_min_advances: needs l >= 1 and s >= 1, got l = {}, s = {}", l, s);
  if (s == 1) return l * (l - 1) / 2;  // r = l − 1 repetitions: a closed form instead of l iterations
  std::int64_t r = 0;
  if (s == 2) {  // β(2, r) = (r + 1)(r + 2)/2 ≥ l: start from the root of the quadratic, then correct
    r = std::max<std::int64_t>(0, static_cast<std::int64_t>(std::sqrt(2.0 * static_cast<double>(l))) - 2);
    while (static_cast<std::uint64_t>((r + 1) * (r + 2) / 2) < static_cast<std::uint64_t>(l)) ++r;
  } else {
    r = detail::binomial_repetitions(l, s);
  }
  return r * l - static_cast<std::int64_t>(detail::beta(s + 1, r - 1));
}

namespace detail {

/// β(s', r') for every s' ≤ s and r' ≤ r: a split only ever needs these, since r never grows
/// down the recursion (the suffix keeps at most r repetitions, the prefix at most r − 1). With
/// C(s + r, s) ≈ l, (s + 1)(r + 1) entries is a few hundred for the usual s (s = 20, l = 10^6: r = 6).
class BinomialTable {
 public:
  BinomialTable(std::int64_t s, std::int64_t r) : r_(r) {
    table_.resize(static_cast<std::size_t>((s + 1) * (r + 1)));
    for (std::int64_t i = 0; i <= s; ++i)
      for (std::int64_t j = 0; j <= r; ++j) table_[static_cast<std::size_t>(i * (r + 1) + j)] = beta(i, j);
  }
  /// β(s, r), 0 for r < 0.
  std::uint64_t operator()(std::int64_t s, std::int64_t r) const {
    return r < 0 ? 0 : table_[static_cast<std::size_t>(s * (r_ + 1) + r)];
  }
  std::size_t bytes() const { return table_.capacity() * sizeof(std::uint64_t); }
  /// The least r' ≤ r with β(s, r') ≥ l, given that β(s, r) ≥ l.
  std::int64_t repetitions(std::int64_t l, std::int64_t s, std::int64_t r) const {
    while (r > 0 && (*this)(s, r - 1) >= static_cast<std::uint64_t>(l)) --r;
    return r;
  }

 private:
  std::int64_t r_;
  std::vector<std::uint64_t> table_;
};

/// Where the binomial reversal of l steps with s > 1 slots places its first snapshot: the
/// smallest m minimising m + F(l − m, s − 1) + F(m, s). With r = binomial_repetitions(l, s), the
/// prefix [0, m) must be reversible with r − 1 repetitions and s slots and the suffix with r and
/// s − 1, and the smallest such m is
///   m = max(1, β(s, r − 2), l − β(s − 1, r))
/// — equal to the bisection on the (convex) split cost for every l < 1500, s ≤ 12, and the tests
/// check the schedules it makes against that search action for action. A closed form: no search,
/// which is what lets a million-step schedule stream in milliseconds.
inline std::int64_t binomial_split(std::int64_t l, std::int64_t s, std::int64_t r, const BinomialTable& beta_of) {
  const auto cap = [&](std::uint64_t v) { return static_cast<std::int64_t>(std::min<std::uint64_t>(v, static_cast<std::uint64_t>(l))); };
  return std::max<std::int64_t>({1, cap(beta_of(s, r - 2)), l - cap(beta_of(s - 1, r))});
}

/// The binomial (Revolve) schedule as a stream: the recursion
///   reverse(start, end, s): advance to start + m, snapshot it, reverse(start + m, end, s − 1),
///                           free it, restore start, reverse(start, start + m, s)
/// run on an explicit stack. The second call is a tail call (the frame is reused), so the stack
/// holds at most s frames: O(s) state for any chain length.
class BinomialStream final : public ActionStream {
 public:
  /// `disk_depth`: snapshots taken at recursion depth below it (x_0 is depth 0, each nested
  /// suffix one deeper) go to disk. The shallow ones are restored least — a frame with s' slots
  /// restores its snapshot once per split of its prefix, and deeper frames, with fewer slots,
  /// split more often relative to their length — so they are the cheapest to keep on disk.
  BinomialStream(std::int64_t L, std::int64_t s, std::int64_t disk_depth = 0)
      : L_(L), s_(s), r_(s > 1 ? binomial_repetitions(L, s) : 0), disk_depth_(disk_depth), beta_(s > 1 ? s : 0, r_) {
    stack_.reserve(static_cast<std::size_t>(std::min(s, L)) + 1);  // the deepest the recursion goes
  }

  std::size_t state_bytes() const override {
    return sizeof(*this) + stack_.capacity() * sizeof(Frame) + beta_.bytes() + note_.capacity();
  }
  std::string note() const override { return note_; }
  /// What the plan should say about this schedule (e.g. why a policy chose it).
  BinomialStream& with_note(std::string note) {
    note_ = std::move(note);
    return *this;
  }
  bool next(Action& out) override {
    if (buffered_ == used_) {
      buffered_ = emit(buffer_.data());
      used_ = 0;
      if (buffered_ == 0) return false;
    }
    out = buffer_[used_++];
    return true;
  }
  std::size_t next(Action* out, std::size_t n) override {
    std::size_t k = 0;
    while (k < n && used_ < buffered_) out[k++] = buffer_[used_++];
    while (n - k >= kBurst) {
      const std::size_t got = emit(out + k);
      if (got == 0) return k;
      k += got;
    }
    while (k < n && next(out[k])) ++k;
    return k;
  }

 private:
  static constexpr std::size_t kBurst = 4;  // the most actions one emit() writes

  struct Frame {
    std::int64_t start, end, s;
    std::int64_t r = 0;  // repetitions (s > 1)
    std::int64_t m = 0;  // the split, once chosen
    std::int64_t j = 0;  // s == 1: the step being reached
    int phase = 0;
  };

  void push(std::int64_t start, std::int64_t end, std::int64_t s, std::int64_t r) {
    stack_.push_back(Frame{start, end, s, r, 0, end - 1, 0});
  }

  /// Writes the next one to kBurst actions (a run the recursion always emits together); 0 at the end.
  std::size_t emit(Action* out) {
    using K = Action::Kind;
    if (stack_.empty()) {
      if (stage_ == 0) {
        stage_ = 1;
        push(0, L_, s_, r_);
        out[0] = {K::snapshot, 0, 1, disk_depth_ > 0};
        return 1;
      }
      if (stage_ == 1) {
        stage_ = 2;
        out[0] = {K::free, 0};
        return 1;
      }
      return 0;
    }
    Frame& f = stack_.back();
    if (f.end - f.start == 1) {  // record and reverse the one step
      out[0] = {K::record, f.start};
      out[1] = {K::reverse, f.start};
      stack_.pop_back();
      return 2;
    }
    if (f.s == 1) {  // only x_start kept: reach each step j from it, newest first
      std::size_t k = 0;
      if (f.j != f.end - 1) out[k++] = {K::restore, f.start};
      if (f.j > f.start) out[k++] = {K::advance, f.start, f.j - f.start};
      out[k++] = {K::record, f.j};
      out[k++] = {K::reverse, f.j};
      if (f.j == f.start) stack_.pop_back();
      else --f.j;
      return k;
    }
    if (f.phase == 0) {  // advance to the split and keep it
      f.m = binomial_split(f.end - f.start, f.s, f.r, beta_);
      const std::int64_t child = f.start + f.m;
      out[0] = {K::advance, f.start, f.m};
      out[1] = {K::snapshot, child, 1, static_cast<std::int64_t>(stack_.size()) < disk_depth_};
      f.phase = 1;
      if (f.end - child == 1) {  // a one-step suffix: recorded and reversed here, no frame
        out[2] = {K::record, child};
        out[3] = {K::reverse, child};
        return 4;
      }
      const std::int64_t end = f.end, s = f.s - 1, r = beta_.repetitions(end - child, s, f.r);
      push(child, end, s, r);  // f is not used after this (push may move it)
      return 2;
    }
    // The suffix is reversed: drop its snapshot, go back to start, and reverse the prefix
    // [start, start + m) with all s slots — a tail call, reusing the frame.
    out[0] = {K::free, f.start + f.m};
    out[1] = {K::restore, f.start};
    f.end = f.start + f.m;
    f.r = f.r > 0 ? beta_.repetitions(f.m, f.s, f.r - 1) : 0;
    f.j = f.end - 1;
    f.m = 0;
    f.phase = 0;
    return 2;
  }

  std::int64_t L_, s_, r_, disk_depth_;
  BinomialTable beta_;
  std::string note_;
  int stage_ = 0;  // 0: before the first snapshot, 1: reversing, 2: after the final free
  std::vector<Frame> stack_;
  std::array<Action, kBurst> buffer_{};
  std::size_t buffered_ = 0, used_ = 0;
};

/// Step i's recorded bytes split by who else may hold them: its input x_i (when it reads it), its
/// output x_{i+1} (when it saves it and a step follows; the last step's output is its own), and
/// the rest, parameters and what only its reversal saves left out.
struct RecordedBytes {
  std::size_t input = 0, output = 0, own = 0;
};
inline RecordedBytes recorded_bytes(const std::vector<StepCost>& costs, std::int64_t i) {
  const StepCost& c = costs[static_cast<std::size_t>(i)];
  RecordedBytes b;
  b.input = c.reads_input ? c.state_bytes : 0;
  b.output = c.saves_output && static_cast<std::size_t>(i) + 1 < costs.size() ? costs[static_cast<std::size_t>(i) + 1].state_bytes : 0;
  const std::size_t shared = b.input + b.output + c.param_bytes + c.reverse_bytes;
  b.own = c.activation_bytes > shared ? c.activation_bytes - shared : 0;
  return b;
}

/// The bytes the executor (chain.hpp) holds for backward as a schedule runs, counted as
/// memory_stats() counts them: per storage, once however many hold it. A snapshot of x_i and the
/// recorded step that reads x_i hold one storage; so do a step that saves its output and the next
/// one reading it, and steps sharing parameters. A step recorded in forward with `compact` is
/// held without its parameters, which it saves again for the moment it is rebuilt and reversed.
class SavedBytesModel {
 public:
  explicit SavedBytesModel(const std::vector<StepCost>& costs) : costs_(costs) {}
  std::size_t bytes() const { return bytes_; }
  std::size_t peak() const { return peak_; }

  void advance() { current_ = next_id_++; }
  void snapshot(std::int64_t i, bool disk) {
    kept_.emplace_back(i, current_);
    const auto k = static_cast<std::size_t>(i);
    if (!disk) hold(current_, k < costs_.size() ? costs_[k].state_bytes : 0);
    else kept_.back().second |= kDisk;
  }
  void restore(std::int64_t i) {
    const std::uint64_t id = find(kept_, i)->second;
    current_ = id & kDisk ? next_id_++ : id;  // a file is read back into a new tensor
  }
  void free(std::int64_t i) {
    auto it = find(kept_, i);
    if (!(it->second & kDisk)) release(it->second);
    kept_.erase(it);
  }
  void record(std::int64_t i, bool forward) {
    const StepCost& c = costs_[static_cast<std::size_t>(i)];
    const RecordedBytes b = recorded_bytes(costs_, i);
    Held h{i, b.input ? current_ : 0, 0, b.own ? next_id_++ : 0, 0, forward && c.compact};
    current_ = next_id_++;
    if (b.output) h.output = current_;
    if (c.param_bytes) h.params = c.params ? kShared | c.params : next_id_++;
    hold(h.input, b.input);
    hold(h.output, b.output);
    hold(h.own, b.own);
    hold(h.params, c.param_bytes);  // a compact step's graph exists until it is held compactly
    if (h.compact) release(h.params);
    recorded_.push_back(h);
  }
  void reverse(std::int64_t i) {
    const StepCost& c = costs_[static_cast<std::size_t>(i)];
    auto it = find(recorded_, i);
    if (it->compact) hold(it->params, c.param_bytes);  // rebuilt: its nodes save the parameters again
    peak_ = std::max(peak_, bytes_ + c.reverse_bytes);
    for (std::uint64_t id : {it->input, it->output, it->own, it->params}) release(id);
    recorded_.erase(it);
  }

 private:
  static constexpr std::uint64_t kShared = std::uint64_t{1} << 63, kDisk = std::uint64_t{1} << 62;
  struct Held {
    std::int64_t step;
    std::uint64_t input, output, own, params;  // storage ids, 0 for none
    bool compact;
  };
  void hold(std::uint64_t id, std::size_t bytes) {
    if (id == 0) return;
    auto& [b, refs] = books_[id];
    if (refs++ == 0) {
      b = bytes;
      bytes_ += bytes;
      peak_ = std::max(peak_, bytes_);
    }
  }
  void release(std::uint64_t id) {
    if (id == 0) return;
    auto it = books_.find(id);
    if (--it->second.second == 0) {
      bytes_ -= it->second.first;
      books_.erase(it);
    }
  }
  // Newest first: schedules restore, free and reverse what they made last.
  template <class V>
  static typename V::iterator find(V& v, std::int64_t i) {
    auto it = v.end();
    while (it != v.begin())
      if (step_of(*--it) == i) return it;
    REMAT_ASSERT(false);
    return v.end();
  }
  static std::int64_t step_of(const std::pair<std::int64_t, std::uint64_t>& k) { return k.first; }
  static std::int64_t step_of(const Held& h) { return h.step; }

  const std::vector<StepCost>& costs_;
  std::unordered_map<std::uint64_t, std::pair<std::size_t, int>> books_;  // id -> bytes, holders
  std::vector<std::pair<std::int64_t, std::uint64_t>> kept_;
  std::vector<Held> recorded_;
  std::uint64_t current_ = 1, next_id_ = 2;
  std::size_t bytes_ = 0, peak_ = 0;
};

/// Runs the bookkeeping of a schedule: checks it is well-formed (every step recorded then
/// reversed exactly once, newest first; restores and frees of kept states only; the forward
/// phase ends by recording f_{L-1}) and fills the plan's counts and, with costs, its bytes. One
/// pass over the stream; it holds the kept and recorded sets, never the actions.
inline Plan analyse(std::string policy, std::int64_t L, std::function<std::unique_ptr<ActionStream>()> make_stream,
                    const std::vector<StepCost>* costs) {
  using K = Action::Kind;
  Plan p;
  p.policy = std::move(policy);
  p.steps = L;
  p.has_costs = costs != nullptr;
  std::int64_t pos = 0, next_reverse = L - 1;
  // Kept snapshots and recorded steps (their bytes: SavedBytesModel). Schedules use them last-in first-out
  // (restore and free the newest snapshot, reverse the newest record), so searches start at the
  // back and are O(1) in practice; no allocation per action, and no search on insertion (a
  // duplicate shows at the end as a state never freed or a record never reversed).
  std::vector<std::pair<std::int64_t, std::size_t>> kept, recorded;
  std::vector<bool> kept_on_disk;  // beside kept
  std::int64_t on_disk = 0;
  auto find = [](std::vector<std::pair<std::int64_t, std::size_t>>& v, std::int64_t i) {
    for (std::size_t k = v.size(); k-- > 0;)
      if (v[k].first == i) return static_cast<std::ptrdiff_t>(k);
    return std::ptrdiff_t{-1};
  };
  std::optional<SavedBytesModel> bytes;
  if (costs) bytes.emplace(*costs);
  bool forward_done = false;
  const std::unique_ptr<ActionStream> stream = make_stream();
  std::array<Action, 256> batch;
  std::size_t a = 0, got = 0;
  for (std::size_t b = 0;; ++a, ++b) {
    if (b == got) {
      got = stream->next(batch.data(), batch.size());
      b = 0;
      if (got == 0) break;
    }
    const Action& act = batch[b];
    const std::int64_t i = act.step;
    REMAT_CHECK(i >= 0 && i <= L, "schedule: action {} names step {} of a chain of {}", a, i, L);
    switch (act.kind) {
      case K::advance:
        REMAT_CHECK(pos == i && act.count >= 1 && i + act.count <= L, "schedule: action {} advances steps {}..{} from position {}",
                    a, i, i + act.count - 1, pos);
        pos += act.count;
        p.advances += act.count;
        if (bytes) bytes->advance();
        if (costs)
          for (std::int64_t k = i; k < i + act.count; ++k) p.compute += (*costs)[static_cast<std::size_t>(k)].compute;
        break;
      case K::snapshot:
        // (A second snapshot of a kept state is caught at the end: one of the two is never freed.)
        REMAT_CHECK(pos == i, "schedule: action {} snapshots x_{} at position {}", a, i, pos);
        kept.emplace_back(i, 0);
        kept_on_disk.push_back(act.disk);
        if (bytes) bytes->snapshot(i, act.disk);
        if (act.disk) {
          ++p.disk_writes;
          p.peak_disk_snapshots = std::max(p.peak_disk_snapshots, ++on_disk);
        }
        break;
      case K::restore: {
        const std::ptrdiff_t k = find(kept, i);
        REMAT_CHECK(k >= 0, "schedule: action {} restores x_{}, which is not kept", a, i);
        REMAT_CHECK(forward_done, "schedule: the forward phase (up to recording the last step) must not restore");
        if (kept_on_disk[static_cast<std::size_t>(k)]) ++p.disk_reads;
        if (bytes) bytes->restore(i);
        pos = i;
        break;
      }
      case K::free: {
        const std::ptrdiff_t k = find(kept, i);
        REMAT_CHECK(k >= 0, "schedule: action {} frees x_{}, which is not kept", a, i);
        if (bytes) bytes->free(i);
        if (kept_on_disk[static_cast<std::size_t>(k)]) --on_disk;
        kept.erase(kept.begin() + k);
        kept_on_disk.erase(kept_on_disk.begin() + k);
        break;
      }
      case K::record: {
        // (A step recorded twice is caught at the end: one of the two records is never reversed.)
        REMAT_CHECK(pos == i && i < L, "schedule: action {} records step {} at position {}", a, i, pos);
        recorded.emplace_back(i, 0);
        if (bytes) bytes->record(i, !forward_done);
        ++pos;
        ++p.records;
        if (costs) p.compute += (*costs)[static_cast<std::size_t>(i)].compute;
        break;
      }
      case K::reverse: {
        REMAT_CHECK(forward_done, "schedule: the forward phase (up to recording the last step) must not reverse");
        const std::ptrdiff_t k = find(recorded, i);
        REMAT_CHECK(i == next_reverse && k >= 0,
                    "schedule: action {} reverses step {}, but step {} is next and must be recorded", a, i, next_reverse);
        if (bytes) bytes->reverse(i);
        recorded.erase(recorded.begin() + k);
        --next_reverse;
        break;
      }
    }
    p.peak_snapshots = std::max<std::int64_t>(p.peak_snapshots, static_cast<std::int64_t>(kept.size()));
    p.peak_recorded = std::max<std::int64_t>(p.peak_recorded, static_cast<std::int64_t>(recorded.size()));
    if (bytes) p.peak_bytes = bytes->peak();
    if (!forward_done && act.kind == K::record && i == L - 1) {
      forward_done = true;
      p.forward_actions = a + 1;
      p.forward_end_bytes = bytes ? bytes->bytes() : 0;
    }
  }
  REMAT_CHECK(forward_done && next_reverse == -1, "schedule: not every step was reversed ({} left)", next_reverse + 1);
  REMAT_CHECK(recorded.empty(), "schedule: step {} was recorded and never reversed", recorded.empty() ? 0 : recorded.back().first);
  REMAT_CHECK(kept.empty(), "schedule: x_{} was kept and never freed", kept.empty() ? 0 : kept.back().first);
  p.actions = a;
  p.stream = std::move(make_stream);
  return p;
}

}  // namespace detail

/// A named, pure function from the chain length and optional per-step costs to a schedule.
struct Policy {
  /// The name policy::parse reads ("sqrt", "binomial:4", ...) and reports print.
  std::string name;
  /// Whether `stream` needs per-step costs (measured on a first run when not given).
  bool needs_costs = false;
  /// Makes the schedule's actions for a chain of L steps, with the per-step costs (null when not needed).
  std::function<std::unique_ptr<ActionStream>(std::int64_t L, const std::vector<StepCost>* costs)> stream;
  std::string disk_directory = {};  ///< where snapshots the schedule puts on disk go (two_tier)
};

namespace detail {

/// none: record every step, then reverse them all.
class RecordAllStream final : public ActionStream {
 public:
  explicit RecordAllStream(std::int64_t L) : L_(L) {}
  std::size_t state_bytes() const override { return sizeof(*this); }
  bool next(Action& out) override {
    if (i_ < L_) out = {Action::Kind::record, i_};
    else if (i_ < 2 * L_) out = {Action::Kind::reverse, 2 * L_ - 1 - i_};
    else return false;
    ++i_;
    return true;
  }

 private:
  std::int64_t L_, i_ = 0;
};

/// uniform:k — forward: snapshot each segment's start and advance through it, record the last
/// segment; backward: reverse it, then for each earlier segment restore, record, reverse, free.
class UniformStream final : public ActionStream {
 public:
  UniformStream(std::int64_t L, std::int64_t k) : L_(L), k_(k), last_(((L - 1) / k) * k) {}
  std::size_t state_bytes() const override { return sizeof(*this); }
  bool next(Action& out) override {
    using K = Action::Kind;
    switch (phase_) {
      case 0:  // forward: segments before the last, each a snapshot and one advance of k steps
        if (b_ < last_) {
          if (!half_) {
            half_ = true;
            out = {K::snapshot, b_};
          } else {
            half_ = false;
            out = {K::advance, b_, k_};
            b_ += k_;
          }
          return true;
        }
        phase_ = 1;
        i_ = last_;
        [[fallthrough]];
      case 1:  // record the last segment
        if (i_ < L_) {
          out = {K::record, i_++};
          return true;
        }
        phase_ = 2;
        i_ = L_ - 1;
        [[fallthrough]];
      case 2:  // reverse it
        if (i_ >= last_) {
          out = {K::reverse, i_--};
          return true;
        }
        phase_ = 3;
        b_ = last_ - k_;
        [[fallthrough]];
      case 3:  // earlier segments, newest first: restore, record k, reverse k, free
        while (b_ >= 0) {
          if (sub_ == 0) {
            sub_ = 1;
            i_ = b_;
            out = {K::restore, b_};
            return true;
          }
          if (sub_ == 1) {
            if (i_ < b_ + k_) {
              out = {K::record, i_++};
              return true;
            }
            sub_ = 2;
            i_ = b_ + k_ - 1;
          }
          if (sub_ == 2) {
            if (i_ >= b_) {
              out = {K::reverse, i_--};
              return true;
            }
            sub_ = 0;
            out = {K::free, b_};
            b_ -= k_;
            return true;
          }
        }
        phase_ = 4;
        [[fallthrough]];
      default:
        return false;
    }
  }

 private:
  std::int64_t L_, k_, last_;
  int phase_ = 0, sub_ = 0;
  bool half_ = false;
  std::int64_t b_ = 0, i_ = 0;
};

inline std::int64_t ceil_sqrt(std::int64_t L) {
  auto k = static_cast<std::int64_t>(std::sqrt(static_cast<double>(L)));
  while (k * k < L) ++k;
  while (k > 1 && (k - 1) * (k - 1) >= L) --k;
  return std::max<std::int64_t>(k, 1);
}

}  // namespace detail

/// Checkpointing policies for chains (none, uniform, sqrt_segments, binomial, budget, two_tier), and
/// parse(), which turns a policy's name into a Checkpointing.
namespace policy {

/// Record everything: no recomputation, every step's activations kept.
inline Policy none() {
  return {"none", false, [](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
            return std::make_unique<detail::RecordAllStream>(L);
          }};
}

/// A segment every k steps, as torch.utils.checkpoint.checkpoint_sequential: each segment's input
/// is kept and the segment replayed in backward; the last segment is recorded directly.
inline Policy uniform(std::int64_t k) {
  REMAT_CHECK(k >= 1, "policy::uniform: segment length must be at least 1, got {}", k);
  return {fmt::format("uniform:{}", k), false, [k](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
            return std::make_unique<detail::UniformStream>(L, k);
          }};
}

/// k = ⌈√L⌉ steps a segment: O(√L) memory for about one extra forward.
inline Policy sqrt_segments() {
  return {"sqrt", false, [](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
            return std::make_unique<detail::UniformStream>(L, detail::ceil_sqrt(L));
          }};
}

/// Griewank's binomial schedule (Revolve) with s snapshots in all, the chain's input counting as
/// one: O(log L) memory and the provably minimal number of non-recording step executions.
inline Policy binomial(std::int64_t s) {
  REMAT_CHECK(s >= 1, "policy::binomial: needs at least 1 snapshot (the chain's input), got {}", s);
  return {fmt::format("binomial:{}", s), false, [s](std::int64_t L, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
            return std::make_unique<detail::BinomialStream>(L, s);
          }};
}

}  // namespace policy

/// The plan a policy makes for a chain of L steps; costs (one per step) add predicted bytes and
/// compute, and are required by policies that optimise with them (budget). One counting pass over
/// the policy's stream: the plan holds counts and a way to stream the actions again, not a list.
inline Plan plan(const Policy& p, std::int64_t L, const std::vector<StepCost>* costs = nullptr) {
  REMAT_CHECK(L >= 1, "plan: a chain needs at least one step, got {}", L);
  REMAT_CHECK(!costs || static_cast<std::int64_t>(costs->size()) == L, "plan: {} step costs for a chain of {} steps",
              costs ? costs->size() : 0, L);
  REMAT_CHECK(!p.needs_costs || costs, "plan: policy {} needs per-step costs", p.name);
  REMAT_CHECK(static_cast<bool>(p.stream), "plan: policy '{}' has no stream function", p.name);
  // A policy that solves for its whole schedule at once (budget) is asked once; the list it made
  // is what the plan streams from then on.
  std::function<std::unique_ptr<ActionStream>()> make;
  std::string note;
  if (p.needs_costs) {
    const std::unique_ptr<ActionStream> solved = p.stream(L, costs);
    note = solved->note();
    auto made = std::make_shared<Schedule>();
    Action a{Action::Kind::free, 0};
    while (solved->next(a)) made->push_back(a);
    make = [made]() -> std::unique_ptr<ActionStream> { return std::make_unique<detail::ListStream>(*made); };
  } else {
    make = [stream = p.stream, L]() { return stream(L, nullptr); };
    note = make()->note();
  }
  Plan out = detail::analyse(p.name, L, std::move(make), costs);
  out.note = std::move(note);
  out.disk_directory = p.disk_directory;
  REMAT_CHECK(out.disk_writes == 0 || !out.disk_directory.empty(),
              "plan: policy {} keeps snapshots on disk but names no directory for them", p.name);
  return out;
}
/// plan(p, L, &costs): the plan for L steps with their costs.
inline Plan plan(const Policy& p, std::int64_t L, const std::vector<StepCost>& costs) { return plan(p, L, &costs); }

namespace detail {

/// The action table's lines, produced one at a time from the plan's stream: runs of the same
/// action over consecutive steps are one line.
class PlanLines {
 public:
  explicit PlanLines(const Plan& p) : stream_(p.stream()), forward_actions_(p.forward_actions) {}
  static std::string header() { return fmt::format("{:<9} {:<9} {:<12}\n", "phase", "action", "steps"); }
  /// The next line (with its newline); false at the end.
  bool next(std::string& line) {
    using K = Action::Kind;
    Action a{K::free, 0};
    while (!done_) {
      if (!stream_->next(a)) {
        done_ = true;
        break;
      }
      const bool forward = index_++ < forward_actions_;
      const std::int64_t begin = a.step, end = a.kind == K::advance ? a.step + a.count - 1 : a.step;
      const int dir = a.kind == K::reverse ? -1 : 1;
      const bool mergeable = a.kind == K::advance || a.kind == K::record || a.kind == K::reverse;
      if (open_ && mergeable && a.kind == first_.kind && forward == first_forward_ && begin == last_step_ + dir) {
        last_step_ = end;
        continue;
      }
      const bool had = open_;
      if (had) line = format();
      open_ = true;
      first_ = a;
      first_forward_ = forward;
      last_step_ = end;
      if (had) return true;
    }
    if (!open_) return false;
    line = format();
    open_ = false;
    return true;
  }
  std::size_t actions_read() const { return index_; }

 private:
  std::string format() const {
    const std::string range = last_step_ == first_.step ? fmt::format("{}", first_.step) : fmt::format("{}..{}", first_.step, last_step_);
    return fmt::format("{:<9} {:<9} {:<12}{}\n", first_forward_ ? "forward" : "backward", action_name(first_.kind), range,
                       first_.kind == Action::Kind::snapshot && first_.disk ? " to disk" : "");
  }
  std::unique_ptr<ActionStream> stream_;
  std::size_t forward_actions_, index_ = 0;
  bool open_ = false, done_ = false, first_forward_ = false;
  Action first_{Action::Kind::free, 0};
  std::int64_t last_step_ = 0;
};

}  // namespace detail

inline std::string Plan::str() const {
  std::string out = fmt::format("plan {} for {} steps: {} actions, {} advances (non-recording), {} records, at most {} "
                                "snapshots and {} recorded steps alive", policy, steps, actions, advances, records,
                                peak_snapshots, peak_recorded);
  if (has_costs) out += fmt::format(", predicted peak {} bytes ({} at the end of forward), compute {:.4g}", peak_bytes,
                                    forward_end_bytes, compute);
  if (disk_writes > 0)
    out += fmt::format(", {} snapshots written to disk (at most {} there at once) and {} read back", disk_writes,
                       peak_disk_snapshots, disk_reads);
  if (!note.empty()) out += fmt::format("\nnote: {}", note);
  out += "\n" + detail::PlanLines::header();
  // The first and last few lines of the table: a ring of the last ones, so the text stays a few
  // kilobytes for any chain (the whole table is actions_str()).
  constexpr std::size_t kEnds = 8;
  detail::PlanLines lines(*this);
  std::string line;
  std::size_t n = 0;
  std::array<std::string, kEnds> last;
  for (; lines.next(line); ++n) {
    if (n < kEnds) out += line;
    else last[n % kEnds] = std::move(line);
  }
  if (n > 2 * kEnds) out += fmt::format("... {} more lines (Plan::actions_str() lists them all) ...\n", n - 2 * kEnds);
  for (std::size_t k = std::max(kEnds, n > kEnds ? n - kEnds : kEnds); k < n; ++k) out += last[k % kEnds];
  return out;
}

inline std::string Plan::actions_str(std::size_t max_actions) const {
  REMAT_CHECK(actions <= max_actions, "Plan::actions_str: plan {} has {} actions, more than the {} asked for at most; "
              "str() summarises any plan, or stream() gives the actions one at a time", policy, actions, max_actions);
  std::string out = detail::PlanLines::header(), line;
  detail::PlanLines lines(*this);
  while (lines.next(line)) out += line;
  return out;
}

}  // namespace remat
