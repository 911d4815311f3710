#pragma once
// policy::budget(bytes): the fastest schedule for a chain of steps of unequal cost that never
// holds more than `bytes` in snapshots and recorded tapes, by dynamic programming over the
// per-step costs (after "Optimal checkpointing for heterogeneous chains", Beaumont et al. 2019).
//
// opt(s, t, m, kept): least compute to reverse steps [s, t) with the position at s and m bytes
// free; `kept` says whether x_s is already held by the caller (or, without a snapshot, by the
// step before, which saves its output: then its bytes are not charged again either). Bytes are
// the executor's (SavedBytesModel): a_i excludes what another holder has, and reversing a step
// adds what only its reversal holds. Options:
//   record all    record s..t-1, then reverse them                 needs Σ a_i ≤ m, costs Σ c_i
//   record first  record s, opt(s+1, t, m - a_s, no), reverse s    costs c_s + ...
//   split at k    keep x_s (x_s bytes unless kept), advance s..k-1, opt(k, t, m', no),
//                 restore s, opt(s, k, m', yes), drop x_s          costs Σ_{s..k-1} c_i + ...
// Bytes are counted in units of budget/resolution, rounded up, so a plan that fits in units fits
// in bytes.
//
// Why these three options are enough: look at what an optimal schedule does first with the
// position at s. Either it records step s at once — then either everything up to t is recorded
// before anything is reversed (record all: no state has to be kept, all activations coexist), or
// x_{s+1} becomes the new start of a smaller problem with a_s bytes less (record first: step s is
// reversed last, after the rest). Or it advances: then the next thing it must hold is some x_k,
// k > s, to come back to later (split at k): the suffix [k, t) is reversed first, with x_s still
// held (its bytes are charged unless the caller already holds it), and then the prefix [s, k) is
// reversed from x_s, which is held — "kept = yes", so no second charge. Every subproblem is again
// "reverse [s, t) from x_s with m bytes", which is the state of the table; its size is
// L·(L + 1)·(M + 1)·2 entries and each entry tries O(L) splits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "remat/schedule/schedule.hpp"

namespace remat {
namespace detail {

class BudgetPlanner {
 public:
  /// `charge_params`: count every step's parameters as held while it is recorded (an upper
  /// bound), not only those of steps held whole (exact when recorded steps share them).
  BudgetPlanner(const std::vector<StepCost>& costs, std::size_t budget, std::int64_t resolution, bool charge_params = false)
      : L_(static_cast<std::int64_t>(costs.size())), costs_(costs) {
    unit_ = std::max<std::size_t>(1, (budget + static_cast<std::size_t>(resolution) - 1) / static_cast<std::size_t>(resolution));
    M_ = static_cast<std::int64_t>(budget / unit_);
    budget_ = budget;
    for (std::int64_t i = 0; i < L_; ++i) {
      // What the executor holds (SavedBytesModel): a step's own bytes and output while recorded,
      // its input unless another holder has it, its parameters while recorded unless held
      // compactly — then only while recorded and reversed, as what reversing it adds (t).
      const StepCost& c = costs[static_cast<std::size_t>(i)];
      const RecordedBytes b = recorded_bytes(costs, i);
      const bool params_held = charge_params || !c.compact;
      x_.push_back(units(c.state_bytes));
      in_.push_back(units(b.input));
      out_.push_back(b.output > 0);
      bytes_.push_back({b.own + b.output + (params_held ? c.param_bytes : 0), b.input,
                        c.reverse_bytes + (params_held ? 0 : c.param_bytes), params_held ? c.param_bytes : 0, c.params});
      a_.push_back(units(bytes_.back().recorded));
      t_.push_back(units(bytes_.back().reversing));
    }
    memo_.assign(table_entries(L_, M_), kUnknown);
    choice_.assign(memo_.size(), 0);
  }

  /// Entries of the table for L steps and M units: a pair s < t, a budget m ≤ M, and x_s kept,
  /// held by the step before (its output) or neither.
  static std::size_t table_entries(std::int64_t L, std::int64_t M) {
    return static_cast<std::size_t>(L) * static_cast<std::size_t>(L + 1) / 2 * static_cast<std::size_t>(M + 1) * 3;
  }
  static constexpr std::size_t kBytesPerEntry = sizeof(double) + sizeof(std::int32_t);

  std::int64_t units(std::size_t bytes) const { return static_cast<std::int64_t>((bytes + unit_ - 1) / unit_); }
  std::int64_t budget_units() const { return M_; }

  /// Least compute to reverse the whole chain within m units; infinity if impossible.
  double solve(std::int64_t m) { return opt(0, L_, m, kNotHeld); }

  Schedule schedule(std::int64_t m) {
    Schedule out;
    emit(0, L_, m, kNotHeld, out);
    return out;
  }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  static constexpr double kUnknown = -1.0;
  // Who holds x_s: nobody, the step before (its saved output: no snapshot of it costs more), a
  // snapshot the caller keeps (restorable).
  static constexpr int kNotHeld = 0, kHeld = 1, kKept = 2;

  std::size_t index(std::int64_t s, std::int64_t t, std::int64_t m, int held) const {
    // Pairs s < t ≤ L, row by row: row s starts after Σ_{r<s} (L − r) pairs.
    const std::int64_t pair = s * (2 * L_ - s + 1) / 2 + (t - s - 1);
    return static_cast<std::size_t>((pair * (M_ + 1) + m) * 3 + held);
  }
  /// Step i's recorded bytes when x_i is held by someone else already (`input_held`) or not.
  std::int64_t recorded(std::int64_t i, bool input_held) const {
    return a(i) + (input_held ? 0 : in_[static_cast<std::size_t>(i)]);
  }
  bool out(std::int64_t i) const { return out_[static_cast<std::size_t>(i)]; }
  std::int64_t t(std::int64_t i) const { return t_[static_cast<std::size_t>(i)]; }
  double c(std::int64_t i) const { return costs_[static_cast<std::size_t>(i)].compute; }
  std::int64_t x(std::int64_t i) const { return x_[static_cast<std::size_t>(i)]; }
  std::int64_t a(std::int64_t i) const { return a_[static_cast<std::size_t>(i)]; }

  // choice: 0 = record all, 1 = record first, k >= 2 encodes split at s + k - 1
  double opt(std::int64_t s, std::int64_t t, std::int64_t m, int held) {
    if (m < 0) return kInf;
    double& memo = memo_[index(s, t, m, held)];
    if (memo != kUnknown) return memo;
    double best = kInf;
    std::int64_t pick = -1;
    // Record all: step i is reversed (or rebuilt) with s..i recorded. Summed in bytes, not in
    // units rounded up step by step, so recording everything fits whenever it does in bytes.
    // Parameters shared by steps recorded together are held once.
    double run = 0;
    std::size_t act = 0, peak = 0;
    shared_.clear();
    for (std::int64_t i = s; i < t; ++i) {
      const Bytes& b = bytes_[static_cast<std::size_t>(i)];
      run += c(i);
      act += b.recorded + ((i == s ? held != kNotHeld : out(i - 1)) ? 0 : b.input);
      if (b.params != 0 && b.params_held > 0) {
        if (std::find(shared_.begin(), shared_.end(), b.params) != shared_.end()) act -= b.params_held;
        else shared_.push_back(b.params);
      }
      peak = std::max(peak, act + b.reversing);
    }
    if (peak <= (m == M_ ? budget_ : static_cast<std::size_t>(m) * unit_)) {
      best = run;
      pick = 0;
    }
    if (t - s > 1) {
      const std::int64_t first_bytes = recorded(s, held != kNotHeld);
      if (first_bytes + this->t(s) <= m) {
        const double first = c(s) + opt(s + 1, t, m - first_bytes, out(s) ? kHeld : kNotHeld);
        if (first < best) {
          best = first;
          pick = 1;
        }
      }
      const std::int64_t free = m - (held != kNotHeld ? 0 : x(s));
      double advance = 0;
      for (std::int64_t k = s + 1; k < t && free >= 0; ++k) {
        advance += c(k - 1);
        if (advance >= best) break;
        const double right = opt(k, t, free, kNotHeld);
        if (advance + right >= best) continue;
        const double total = advance + right + opt(s, k, free, kKept);
        if (total < best) {
          best = total;
          pick = k - s + 1;
        }
      }
    }
    choice_[index(s, t, m, held)] = static_cast<std::int32_t>(pick);
    return memo = best;
  }

  void emit(std::int64_t s, std::int64_t t, std::int64_t m, int held, Schedule& out) {
    using K = Action::Kind;
    opt(s, t, m, held);
    const std::int64_t pick = choice_[index(s, t, m, held)];
    REMAT_ASSERT(pick >= 0);
    if (pick == 0) {
      for (std::int64_t i = s; i < t; ++i) out.push_back({K::record, i});
      for (std::int64_t i = t - 1; i >= s; --i) out.push_back({K::reverse, i});
    } else if (pick == 1) {
      out.push_back({K::record, s});
      emit(s + 1, t, m - recorded(s, held != kNotHeld), this->out(s) ? kHeld : kNotHeld, out);
      out.push_back({K::reverse, s});
    } else {
      const std::int64_t k = s + pick - 1;
      const std::int64_t free = m - (held != kNotHeld ? 0 : x(s));
      if (held != kKept) out.push_back({K::snapshot, s});
      for (std::int64_t i = s; i < k; ++i) out.push_back({K::advance, i});
      emit(k, t, free, kNotHeld, out);
      out.push_back({K::restore, s});
      emit(s, k, free, kKept, out);
      if (held != kKept) out.push_back({K::free, s});
    }
  }

  std::int64_t L_;
  const std::vector<StepCost>& costs_;
  std::size_t unit_ = 1, budget_ = 0;
  std::int64_t M_ = 0;
  std::vector<std::int64_t> x_, in_, a_, t_;  // units: state, input read, recorded, added while reversed
  std::vector<bool> out_;                       // saves its output (the next step's input)
  struct Bytes {
    std::size_t recorded, input, reversing, params_held;
    std::uint64_t params;
  };
  std::vector<std::uint64_t> shared_;  // scratch: parameter ids seen in one record-all
  std::vector<Bytes> bytes_;  // a_, in_, t_ in bytes
  std::vector<double> memo_;
  std::vector<std::int32_t> choice_;
};


/// The budget planner's problem after coarsening to what it solves exactly within its limits:
/// consecutive steps grouped (a group is recorded, reversed and advanced whole, and snapshots
/// fall on group boundaries), and the byte unit chosen so the table fits its memory cap.
struct BudgetModel {
  std::vector<std::int64_t> starts;  // first step of each group, then L
  std::vector<StepCost> costs;       // per group
  std::int64_t resolution = 0;
  std::string note;                  // what was coarsened, for the plan; empty when exact

  /// The group schedule as a step schedule.
  Schedule expand(const Schedule& groups) const {
    using K = Action::Kind;
    Schedule out;
    for (const Action& a : groups) {
      const std::int64_t first = starts[static_cast<std::size_t>(a.step)];
      const std::int64_t last = a.kind == K::advance ? starts[static_cast<std::size_t>(a.step + a.count)]
                                                     : starts[static_cast<std::size_t>(a.step) + 1];
      switch (a.kind) {
        case K::advance: out.push_back({K::advance, first, last - first}); break;
        case K::record:
          for (std::int64_t i = first; i < last; ++i) out.push_back({K::record, i});
          break;
        case K::reverse:
          for (std::int64_t i = last - 1; i >= first; --i) out.push_back({K::reverse, i});
          break;
        default: out.push_back({a.kind, first}); break;
      }
    }
    return out;
  }
};

/// Limits of the exact planner: at most `max_steps` (groups beyond), a table of at most
/// `max_table_bytes` (a coarser byte unit beyond). Measured on this machine (benchmarks/
/// budget_scale.cpp): 100 steps at 256 units plan in about 0.4 s with a 31 MB table.
struct BudgetLimits {
  std::int64_t max_steps = 100;
  std::size_t max_table_bytes = std::size_t{48} << 20;
};

/// Steps [b, e) as one step recorded and reversed whole: what it holds is each step's own bytes,
/// and each input no output before it holds; what reversing it adds is bounded by the most any
/// of its steps adds, with all of its parameters (an upper bound: plan() then counts exactly).
inline StepCost group_cost(const std::vector<StepCost>& costs, std::int64_t b, std::int64_t e) {
  const StepCost& first = costs[static_cast<std::size_t>(b)];
  StepCost g{0.0, first.state_bytes, 0};
  g.reads_input = first.reads_input;
  g.compact = true;
  g.params = first.params;
  std::size_t held = 0;
  std::vector<std::uint64_t> seen;
  for (std::int64_t i = b; i < e; ++i) {
    const StepCost& c = costs[static_cast<std::size_t>(i)];
    const RecordedBytes r = recorded_bytes(costs, i);
    g.compute += c.compute;
    held += r.own + r.output + (i > b && !costs[static_cast<std::size_t>(i - 1)].saves_output ? r.input : 0);
    if (c.params == 0 || std::find(seen.begin(), seen.end(), c.params) == seen.end()) g.param_bytes += c.param_bytes;
    if (c.params != 0) seen.push_back(c.params);
    if (c.params != g.params) g.params = 0;
    g.compact = g.compact && c.compact;
    g.reverse_bytes = std::max(g.reverse_bytes, c.reverse_bytes);
    g.saves_output = r.output > 0;
  }
  g.activation_bytes = held + g.reverse_bytes + g.param_bytes + (g.reads_input ? g.state_bytes : 0);
  return g;
}

inline BudgetModel budget_model(const std::vector<StepCost>& costs, std::int64_t resolution, const BudgetLimits& limits) {
  BudgetModel m;
  const auto L = static_cast<std::int64_t>(costs.size());
  const std::int64_t G = std::min(L, limits.max_steps);
  for (std::int64_t g = 0; g <= G; ++g) m.starts.push_back(g * L / G);
  for (std::int64_t g = 0; g < G; ++g) m.costs.push_back(group_cost(costs, m.starts[static_cast<std::size_t>(g)],
                                                                   m.starts[static_cast<std::size_t>(g) + 1]));
  m.resolution = resolution;
  while (m.resolution > 16 && BudgetPlanner::table_entries(G, m.resolution) * BudgetPlanner::kBytesPerEntry > limits.max_table_bytes)
    m.resolution = m.resolution * 3 / 4;
  std::vector<std::string> notes;
  if (G < L)
    notes.push_back(fmt::format("{} steps planned as {} groups of {} consecutive steps (the exact planner's limit is "
                                "{} steps): optimal among schedules that keep states only at group boundaries", L, G,
                                L % G == 0 ? fmt::format("{}", L / G) : fmt::format("{}-{}", L / G, L / G + 1),
                                limits.max_steps));
  if (m.resolution < resolution)
    notes.push_back(fmt::format("bytes counted in 1/{} of the budget rather than 1/{}, to keep the table within {} MB",
                                m.resolution, resolution, limits.max_table_bytes >> 20));
  for (const std::string& n : notes) m.note += (m.note.empty() ? "" : "; ") + n;
  return m;
}

/// The last schedule a policy::budget made, with the chain it was made for: a training loop asks
/// for the same chain's schedule every step, and the dynamic program was 6% of a deep GPT's step
/// under budget:24 (perf, 32 steps). Shared by the policy's copies (equal inputs, equal plans).
struct BudgetMemo {
  std::mutex mutex;
  std::int64_t L = -1;
  std::vector<StepCost> costs;
  std::shared_ptr<const Schedule> schedule;
  std::string note;

  /// The schedule made for this chain last, if the last was this chain.
  std::unique_ptr<ActionStream> find(std::int64_t steps, const std::vector<StepCost>& c) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!schedule || steps != L || c != costs) return nullptr;
    return std::make_unique<ListStream>(*schedule, note);
  }
  void keep(std::int64_t steps, const std::vector<StepCost>& c, const Schedule& made, const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex);
    L = steps;
    costs = c;
    schedule = std::make_shared<const Schedule>(made);
    note = why;
  }
};

}  // namespace detail

namespace policy {

/// The least-compute schedule whose snapshots and recorded steps never exceed `bytes`, for steps
/// of unequal cost; needs per-step costs (given to plan(), or measured by checkpoint_sequential).
/// A budget no schedule fits is an error that names (within 1%) the least budget that fits.
/// Exact up to limits.max_steps steps; longer chains are planned over groups of consecutive steps
/// (the plan says so), so planning stays within about a second and limits.max_table_bytes.
inline Policy budget(std::size_t bytes, std::int64_t resolution = 256, detail::BudgetLimits limits = {}) {
  REMAT_CHECK(resolution >= 1, "policy::budget: resolution must be at least 1, got {}", resolution);
  REMAT_CHECK(limits.max_steps >= 1, "policy::budget: max_steps must be at least 1, got {}", limits.max_steps);
  return {fmt::format("budget:{}", bytes), true,
          [bytes, resolution, limits, memo = std::make_shared<detail::BudgetMemo>()](
              std::int64_t L, const std::vector<StepCost>* costs) -> std::unique_ptr<ActionStream> {
            if (auto again = memo->find(L, *costs)) return again;
            const detail::BudgetModel model = detail::budget_model(*costs, resolution, limits);
            // Parameters are first charged as the executor holds them when recorded steps share
            // them; when the exact count says that was too few (steps recorded in backward with
            // parameters of their own), the planner charges each step its own.
            for (const bool charge_params : {false, true}) {
              detail::BudgetPlanner planner(model.costs, bytes, model.resolution, charge_params);
              const std::int64_t m = planner.budget_units();
              if (std::isinf(planner.solve(m))) continue;
              auto made = std::make_shared<Schedule>(model.expand(planner.schedule(m)));
              const auto again = [made]() -> std::unique_ptr<ActionStream> { return std::make_unique<detail::ListStream>(*made); };
              if (charge_params || detail::analyse("budget", L, again, costs).peak_bytes <= bytes) {
                memo->keep(L, *costs, *made, model.note);
                return std::make_unique<detail::ListStream>(std::move(*made), model.note);
              }
            }
            // Recording everything always fits Σ(a_i + x_i); bisect down to the least budget that fits.
            std::size_t lo = bytes, hi = 0;
            for (const StepCost& c : model.costs) hi += c.activation_bytes + c.state_bytes;
            while (hi - lo > std::max<std::size_t>(1, hi / 100)) {
              const std::size_t mid = lo + (hi - lo) / 2;
              detail::BudgetPlanner probe(model.costs, mid, model.resolution);
              (std::isinf(probe.solve(probe.budget_units())) ? lo : hi) = mid;
            }
            throw Error(fmt::format("policy::budget: no schedule fits {} bytes for this chain of {} steps; the "
                                    "least budget that fits is about {} bytes{}", bytes, costs->size(), hi,
                                    model.note.empty() ? "" : fmt::format(" ({})", model.note)));
          }};
}

}  // namespace policy
}  // namespace remat
