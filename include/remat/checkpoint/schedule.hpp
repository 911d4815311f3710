#pragma once
// Schedules for chains x_{i+1} = f_i(x_i), i = 0..L-1. A policy is a pure function from the chain
// length (and, for budget, per-step costs) to a schedule: a list of actions that one executor
// (chain.hpp) runs. Being pure, policies are tested without tensors.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/core/error.hpp"

namespace remat {

/// One executor action. The executor has a current state x_i (its position), snapshot slots, and
/// per-step recorded tapes.
struct Action {
  enum class Kind {
    advance,   ///< x_{i+1} = f_i(x_i) without recording; position i -> i+1
    snapshot,  ///< keep the current x_i in a slot
    restore,   ///< position <- the kept x_i
    free,      ///< drop the kept x_i
    record,    ///< run f_i recorded on its own tape, kept for reverse; position i -> i+1
    reverse,   ///< backpropagate through step i's recorded tape (then free it)
  };
  Kind kind;
  std::int64_t step;
  bool operator==(const Action& o) const { return kind == o.kind && step == o.step; }
};

/// What a step costs: compute (any unit, e.g. seconds or FLOPs), the bytes of its input state
/// x_i (what a snapshot of it holds), and the bytes its recorded tape saves.
struct StepCost {
  double compute = 1.0;
  std::size_t state_bytes = 0;
  std::size_t activation_bytes = 0;
};

using Schedule = std::vector<Action>;

/// A schedule with what running it will do, readable before any run.
struct Plan {
  std::string policy;
  std::int64_t steps = 0;
  Schedule actions;
  std::size_t forward_actions = 0;    ///< actions run during the forward pass (up to recording f_{L-1})
  std::int64_t advances = 0;          ///< non-recording step executions
  std::int64_t records = 0;           ///< recorded step executions
  std::int64_t peak_snapshots = 0;    ///< snapshots alive at once, at most
  std::int64_t peak_recorded = 0;     ///< recorded tapes alive at once, at most
  bool has_costs = false;
  std::size_t peak_bytes = 0;         ///< predicted peak of snapshot + recorded bytes (needs costs)
  std::size_t forward_end_bytes = 0;  ///< predicted bytes held at the end of forward (needs costs)
  double compute = 0;                 ///< predicted compute of advances + records (needs costs)

  std::string str() const;
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
// so binomial_reverse finds the optimal m by bisection on its slope, and the tests check that the
// emitted schedule's advance count equals the closed form for every l ≤ 200, s ≤ 12.

/// Griewank's minimum number of non-recording step executions to reverse l steps with s
/// snapshots (the chain's input counting as one), the last step recorded directly:
/// F(l, s) = r·l − β(s+1, r−1), r the least integer with β(s, r) ≥ l.
inline std::int64_t binomial_min_advances(std::int64_t l, std::int64_t s) {
  REMAT_CHECK(l >= 1 && s >= 1, "binomial_min_advances: needs l >= 1 and s >= 1, got l = {}, s = {}", l, s);
  std::int64_t r = 0;
  while (detail::beta(s, r) < static_cast<std::uint64_t>(l)) ++r;
  return r * l - static_cast<std::int64_t>(detail::beta(s + 1, r - 1));
}

namespace detail {

/// Appends the binomial (Revolve) reversal of steps [start, end) with s snapshots, x_start being
/// held in one of them and the position at start. Split at m minimising m + F(l-m, s-1) + F(m, s),
/// which is convex in m, so a binary search on its slope finds it.
inline void binomial_reverse(std::int64_t start, std::int64_t end, std::int64_t s, Schedule& out) {
  using K = Action::Kind;
  const std::int64_t l = end - start;
  if (l == 1) {
    out.push_back({K::record, start});
    out.push_back({K::reverse, start});
    return;
  }
  if (s == 1) {
    for (std::int64_t j = end - 1; j >= start; --j) {
      if (j != end - 1) out.push_back({K::restore, start});
      for (std::int64_t i = start; i < j; ++i) out.push_back({K::advance, i});
      out.push_back({K::record, j});
      out.push_back({K::reverse, j});
    }
    return;
  }
  auto cost = [&](std::int64_t m) { return m + binomial_min_advances(l - m, s - 1) + binomial_min_advances(m, s); };
  std::int64_t lo = 1, hi = l - 1;  // smallest m with cost(m + 1) >= cost(m)
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (cost(mid + 1) >= cost(mid)) hi = mid;
    else lo = mid + 1;
  }
  const std::int64_t m = lo;
  for (std::int64_t i = start; i < start + m; ++i) out.push_back({K::advance, i});
  out.push_back({K::snapshot, start + m});
  binomial_reverse(start + m, end, s - 1, out);
  out.push_back({K::free, start + m});
  out.push_back({K::restore, start});
  binomial_reverse(start, start + m, s, out);
}

/// Runs the bookkeeping of a schedule: checks it is well-formed (every step recorded then
/// reversed exactly once, newest first; restores and frees of kept states only; the forward
/// phase ends by recording f_{L-1}) and fills the plan's counts and, with costs, its bytes.
inline Plan analyse(std::string policy, std::int64_t L, Schedule actions, const std::vector<StepCost>* costs) {
  using K = Action::Kind;
  Plan p;
  p.policy = std::move(policy);
  p.steps = L;
  p.actions = std::move(actions);
  p.has_costs = costs != nullptr;
  std::int64_t pos = 0, next_reverse = L - 1;
  std::map<std::int64_t, std::size_t> kept;        // snapshot position -> bytes
  std::map<std::int64_t, std::size_t> recorded;    // step -> bytes
  std::size_t bytes = 0;
  bool forward_done = false;
  auto state = [&](std::int64_t i) { return costs && i < L ? (*costs)[static_cast<std::size_t>(i)].state_bytes : 0; };
  for (std::size_t a = 0; a < p.actions.size(); ++a) {
    const Action act = p.actions[a];
    const std::int64_t i = act.step;
    REMAT_CHECK(i >= 0 && i <= L, "schedule: action {} names step {} of a chain of {}", a, i, L);
    switch (act.kind) {
      case K::advance:
        REMAT_CHECK(pos == i && i < L, "schedule: action {} advances step {} from position {}", a, i, pos);
        ++pos;
        ++p.advances;
        if (costs) p.compute += (*costs)[static_cast<std::size_t>(i)].compute;
        break;
      case K::snapshot:
        REMAT_CHECK(pos == i && !kept.count(i), "schedule: action {} snapshots x_{} at position {}", a, i, pos);
        kept[i] = state(i);
        bytes += kept[i];
        break;
      case K::restore:
        REMAT_CHECK(kept.count(i), "schedule: action {} restores x_{}, which is not kept", a, i);
        pos = i;
        break;
      case K::free:
        REMAT_CHECK(kept.count(i), "schedule: action {} frees x_{}, which is not kept", a, i);
        bytes -= kept[i];
        kept.erase(i);
        break;
      case K::record: {
        REMAT_CHECK(pos == i && i < L && !recorded.count(i), "schedule: action {} records step {} at position {}", a, i, pos);
        const std::size_t b = costs ? (*costs)[static_cast<std::size_t>(i)].activation_bytes : 0;
        recorded[i] = b;
        bytes += b;
        ++pos;
        ++p.records;
        if (costs) p.compute += (*costs)[static_cast<std::size_t>(i)].compute;
        break;
      }
      case K::reverse:
        REMAT_CHECK(i == next_reverse && recorded.count(i),
                    "schedule: action {} reverses step {}, but step {} is next and must be recorded", a, i, next_reverse);
        bytes -= recorded[i];
        recorded.erase(i);
        --next_reverse;
        break;
    }
    p.peak_snapshots = std::max<std::int64_t>(p.peak_snapshots, static_cast<std::int64_t>(kept.size()));
    p.peak_recorded = std::max<std::int64_t>(p.peak_recorded, static_cast<std::int64_t>(recorded.size()));
    p.peak_bytes = std::max(p.peak_bytes, bytes);
    if (!forward_done && act.kind == K::record && i == L - 1) {
      forward_done = true;
      p.forward_actions = a + 1;
      p.forward_end_bytes = bytes;
    }
  }
  REMAT_CHECK(forward_done && next_reverse == -1, "schedule: not every step was reversed ({} left)", next_reverse + 1);
  for (std::size_t a = 0; a < p.forward_actions; ++a)
    REMAT_CHECK(p.actions[a].kind != K::reverse && p.actions[a].kind != K::restore,
                "schedule: the forward phase (up to recording the last step) must not restore or reverse");
  return p;
}

}  // namespace detail

/// A named, pure function from the chain length and optional per-step costs to a schedule.
struct Policy {
  std::string name;
  bool needs_costs = false;
  std::function<Schedule(std::int64_t L, const std::vector<StepCost>* costs)> make;
};

namespace policy {

/// Record everything: no recomputation, every step's activations kept.
inline Policy none() {
  return {"none", false, [](std::int64_t L, const std::vector<StepCost>*) {
            Schedule s;
            for (std::int64_t i = 0; i < L; ++i) s.push_back({Action::Kind::record, i});
            for (std::int64_t i = L - 1; i >= 0; --i) s.push_back({Action::Kind::reverse, i});
            return s;
          }};
}

/// A segment every k steps, as torch.utils.checkpoint.checkpoint_sequential: each segment's input
/// is kept and the segment replayed in backward; the last segment is recorded directly.
inline Policy uniform(std::int64_t k) {
  REMAT_CHECK(k >= 1, "policy::uniform: segment length must be at least 1, got {}", k);
  return {fmt::format("uniform:{}", k), false, [k](std::int64_t L, const std::vector<StepCost>*) {
            using K = Action::Kind;
            Schedule s;
            const std::int64_t last = ((L - 1) / k) * k;  // start of the last segment
            for (std::int64_t b = 0; b < last; b += k) {
              s.push_back({K::snapshot, b});
              for (std::int64_t i = b; i < b + k; ++i) s.push_back({K::advance, i});
            }
            for (std::int64_t i = last; i < L; ++i) s.push_back({K::record, i});
            for (std::int64_t i = L - 1; i >= last; --i) s.push_back({K::reverse, i});
            for (std::int64_t b = last - k; b >= 0; b -= k) {
              s.push_back({K::restore, b});
              for (std::int64_t i = b; i < b + k; ++i) s.push_back({K::record, i});
              for (std::int64_t i = b + k - 1; i >= b; --i) s.push_back({K::reverse, i});
              s.push_back({K::free, b});
            }
            return s;
          }};
}

/// k = ⌈√L⌉ steps a segment: O(√L) memory for about one extra forward.
inline Policy sqrt_segments() {
  return {"sqrt", false, [](std::int64_t L, const std::vector<StepCost>* c) {
            std::int64_t k = 1;
            while (k * k < L) ++k;
            return uniform(k).make(L, c);
          }};
}

/// Griewank's binomial schedule (Revolve) with s snapshots in all, the chain's input counting as
/// one: O(log L) memory and the provably minimal number of non-recording step executions.
inline Policy binomial(std::int64_t s) {
  REMAT_CHECK(s >= 1, "policy::binomial: needs at least 1 snapshot (the chain's input), got {}", s);
  return {fmt::format("binomial:{}", s), false, [s](std::int64_t L, const std::vector<StepCost>*) {
            Schedule out{{Action::Kind::snapshot, 0}};
            detail::binomial_reverse(0, L, s, out);
            out.push_back({Action::Kind::free, 0});
            return out;
          }};
}

}  // namespace policy

/// The plan a policy makes for a chain of L steps; costs (one per step) add predicted bytes and
/// compute, and are required by policies that optimise with them (budget).
inline Plan plan(const Policy& p, std::int64_t L, const std::vector<StepCost>* costs = nullptr) {
  REMAT_CHECK(L >= 1, "plan: a chain needs at least one step, got {}", L);
  REMAT_CHECK(!costs || static_cast<std::int64_t>(costs->size()) == L, "plan: {} step costs for a chain of {} steps",
              costs ? costs->size() : 0, L);
  REMAT_CHECK(!p.needs_costs || costs, "plan: policy {} needs per-step costs", p.name);
  return detail::analyse(p.name, L, p.make(L, costs), costs);
}
inline Plan plan(const Policy& p, std::int64_t L, const std::vector<StepCost>& costs) { return plan(p, L, &costs); }

inline std::string Plan::str() const {
  std::string out = fmt::format("plan {} for {} steps: {} advances (non-recording), {} records, at most {} snapshots and "
                                "{} recorded steps alive", policy, steps, advances, records, peak_snapshots, peak_recorded);
  if (has_costs) out += fmt::format(", predicted peak {} bytes ({} at the end of forward), compute {:.4g}", peak_bytes,
                                    forward_end_bytes, compute);
  out += fmt::format("\n{:<9} {:<9} {:<12}\n", "phase", "action", "steps");
  for (std::size_t a = 0; a < actions.size();) {
    std::size_t b = a + 1;  // merge runs of the same action over consecutive steps
    const int dir = actions[a].kind == Action::Kind::reverse ? -1 : 1;
    while (b < actions.size() && actions[b].kind == actions[a].kind &&
           (actions[a].kind == Action::Kind::advance || actions[a].kind == Action::Kind::record ||
            actions[a].kind == Action::Kind::reverse) &&
           actions[b].step == actions[b - 1].step + dir && (a < forward_actions) == (b < forward_actions))
      ++b;
    const std::string range = b - a == 1 ? fmt::format("{}", actions[a].step)
                                         : fmt::format("{}..{}", actions[a].step, actions[b - 1].step);
    out += fmt::format("{:<9} {:<9} {:<12}\n", a < forward_actions ? "forward" : "backward",
                       detail::action_name(actions[a].kind), range);
    a = b;
  }
  return out;
}

}  // namespace remat
