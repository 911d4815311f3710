#pragma once
// Schedules for chains x_{i+1} = f_i(x_i), i = 0..L-1. A policy is a pure function from the chain
// length (and, for budget, per-step costs) to a schedule: a stream of actions that one executor
// (chain.hpp) runs as they come. Streams hold state that does not grow with the chain (binomial:
// O(s) frames; uniform, sqrt, none: a few counters), so nothing proportional to L or to the
// number of actions is ever held. Being pure, policies are tested without tensors. The pieces
// live by purpose: the action vocabulary (action_stream.hpp), the binomial schedule
// (binomial.hpp), the byte model of what the executor holds (saved_bytes.hpp); this header has
// the plan, its checking pass, the simple policies and plan().

#include <algorithm>
#include <cerrno>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <unistd.h>

#include "remat/schedule/action_stream.hpp"
#include "remat/schedule/binomial.hpp"
#include "remat/schedule/saved_bytes.hpp"
#include "remat/core/error.hpp"

namespace remat {

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

/// `directory` made absolute against the working directory now, so that a chdir later (between
/// a chain's forward and its backward, say) does not move the files it names.
inline std::string absolute_directory(const std::string& directory) {
  if (directory.empty() || directory.front() == '/') return directory;
  std::vector<char> cwd(4096);
  while (::getcwd(cwd.data(), cwd.size()) == nullptr) {
    REMAT_CHECK(errno == ERANGE, "chain snapshots: cannot make the directory '{}' absolute: the working directory is "
                "unknown ({})", directory, std::strerror(errno));
    cwd.resize(cwd.size() * 2);
  }
  return std::string(cwd.data()) + "/" + directory;
}

}  // namespace detail

namespace detail {

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
