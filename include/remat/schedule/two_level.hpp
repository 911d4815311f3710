#pragma once
// Optimal schedules over two tiers of snapshot storage — slots in memory, where a snapshot costs
// nothing to write or read, and slots on disk, where it costs `write` and `read` (in units of one
// step) — by dynamic programming, in the spirit of Aupy, Herrmann et al.'s Disk-Revolve and
// H-Revolve. Time is advances + write·(disk writes) + read·(disk reads). policy::two_tier, at the
// end, is the policy over these tables that chains use.
//
// Reversing steps [a, a + l) with x_a in hand and kept in memory (R) or on disk (K), m memory and
// d disk slots free:
//   R(1) = K(1) = 0 (record step a, reverse it);
//   R(l, m, d) = min of
//     (l − 1) + R(l − 1, m, d)                        keep nothing: record the last step, back to x_a
//     j + R(l − j, m − 1, d) + R(j, m, d)              keep x_{a+j} in memory, reverse the suffix, then the prefix
//     j + write + K(l − j, m, d − 1) + R(j, m, d)      keep x_{a+j} on disk
//   K(l, m, d) = the same with each return to x_a costing a read (read + K(·) for the prefix), or
//     R(l, m − 1, d + 1)                              move x_a into memory (its disk slot freed)
// and the chain's own x_0 goes to memory, R(L, M − 1, D), or to disk, write + K(L, M, D − 1).
// Every action of the executor's model is one of these moves, so this is the optimum for the slot
// counts and costs (RAM-only, d = 0, it is Griewank's F(l, m + 1); tests check both and that it is
// never above the binomial-with-disk family). The tables cost O(l²·M·D) to fill, so a chain longer
// than n = √(2·10^8 / (M·D)) steps (1,534 for 4 + 16 slots) is planned as about n groups of ⌈L / n⌉
// steps: the same recursion with splits at group boundaries on top, each group reversed by exact
// tables of its length, and every stretch left with no disk slot free by the memory-only binomial
// schedule, which is exact at any length (the plan's note says so). The stream walks the recursion on a stack at most
// M + D + 1 frames deep.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "remat/schedule/schedule.hpp"
#include "remat/core/error.hpp"

namespace remat {

/// Cost of moving one snapshot to and from disk, in units of one step's compute.
struct TierCosts {
  /// Writing one snapshot to disk, in steps.
  double write = 1.0;
  /// Reading one snapshot back, in steps.
  double read = 1.0;
};

namespace detail {

class TwoLevelTable {
 public:
  enum Tier : std::uint8_t { kMemory = 0, kDisk = 1 };
  enum Option : std::uint8_t { kNowhere = 0, kMemorySplit = 1, kDiskSplit = 2, kMove = 3, kBinomial = 4 };
  enum LevelId : std::uint8_t { kFine = 0, kFull = 1, kTail = 2 };

  /// Tables for a chain of L steps with `memory` and `disk` slots in all. `exact_limit`: the
  /// longest chain planned without groups (0: as long as about 2·10^8 table updates allow).
  TwoLevelTable(std::int64_t L, std::int64_t memory, std::int64_t disk, TierCosts costs, std::int64_t exact_limit = 0)
      : L_(L), M_(memory + 1), D_(disk + 1), costs_(costs) {
    REMAT_CHECK(L >= 1 && memory >= 0 && disk >= 0 && memory + disk >= 1,
                "two-tier schedule: needs L >= 1 and a slot, got L = {}, {} in memory, {} on disk", L, memory, disk);
    if (exact_limit <= 0)
      exact_limit = std::max<std::int64_t>(64, static_cast<std::int64_t>(std::sqrt(2e8 / static_cast<double>(M_ * D_))));
    if (L <= exact_limit) {
      group_ = 1;
      groups_ = L;
      fill_fine(L);
    } else {
      group_ = (L + exact_limit - 1) / exact_limit;
      groups_ = (L + group_ - 1) / group_;
      last_ = L - (groups_ - 1) * group_;
      fill_fine(group_);
      fill_coarse(false);
      fill_coarse(true);
    }
    const LevelId top_level = group_ == 1 ? kFine : kTail;
    const double in_memory = memory >= 1 ? at(top_level, kMemory, groups_, memory - 1, disk) : kInf;
    const double on_disk = disk >= 1 ? costs_.write + at(top_level, kDisk, groups_, memory, disk - 1) : kInf;
    top_ = in_memory <= on_disk ? kMemory : kDisk;
    time_ = std::min(in_memory, on_disk);
  }

  /// The predicted time: advances + write·writes + read·reads.
  double time() const { return time_; }
  Tier top() const { return top_; }
  std::int64_t steps() const { return L_; }
  std::int64_t memory_slots() const { return M_ - 1; }
  std::int64_t disk_slots() const { return D_ - 1; }
  /// Steps per group on top (1: the whole chain is planned exactly).
  std::int64_t group() const { return group_; }
  std::int64_t groups() const { return groups_; }
  std::int64_t last_group() const { return last_; }
  std::size_t bytes() const {
    std::size_t b = sizeof(*this);
    for (const Level& l : levels_) b += l.cost.capacity() * sizeof(double) + l.choice.capacity() * sizeof(std::uint32_t);
    return b;
  }

  /// Steps in `units` units of `level` (a tail's last unit is the short last group).
  std::int64_t steps_of(LevelId level, std::int64_t units) const {
    if (level == kFine) return units;
    return level == kFull ? units * group_ : (units - 1) * group_ + last_;
  }

  struct Choice {
    Option option;
    std::int64_t j;
  };
  Choice choice(LevelId level, Tier tier, std::int64_t units, std::int64_t m, std::int64_t d) const {
    const std::uint32_t c = levels_[level].choice[index(level, tier, units, m, d)];
    return {static_cast<Option>(c >> 29), static_cast<std::int64_t>(c & ((1u << 29) - 1))};
  }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();

  struct Level {
    std::int64_t units = 0;
    std::vector<double> cost;
    std::vector<std::uint32_t> choice;
  };

  std::size_t index(LevelId level, Tier tier, std::int64_t units, std::int64_t m, std::int64_t d) const {
    return ((static_cast<std::size_t>(tier) * static_cast<std::size_t>(levels_[level].units) + static_cast<std::size_t>(units - 1)) *
                static_cast<std::size_t>(M_) + static_cast<std::size_t>(m)) * static_cast<std::size_t>(D_) + static_cast<std::size_t>(d);
  }
  double at(LevelId level, Tier tier, std::int64_t units, std::int64_t m, std::int64_t d) const {
    return levels_[level].cost[index(level, tier, units, m, d)];
  }
  /// Keeping nothing over l steps: each step reached from x_a afresh (a read each time from disk).
  double nowhere(Tier tier, std::int64_t l) const {
    const double n = static_cast<double>(l);
    return n * (n - 1) / 2 + (tier == kDisk ? (n - 1) * costs_.read : 0.0);
  }

  void allocate(LevelId level, std::int64_t units) {
    Level& lv = levels_[level];
    lv.units = units;
    lv.cost.assign(static_cast<std::size_t>(2 * units * M_ * D_), kInf);
    lv.choice.assign(lv.cost.size(), 0);
  }

  void fill_fine(std::int64_t n) {
    allocate(kFine, n);
    fill(kFine, kFine, 1, [](Tier, std::int64_t, std::int64_t) { return 0.0; }, true);
  }

  /// Whole groups (kFull), or whole groups ending with the short last one (kTail), whose
  /// prefixes are whole groups. One group is reversed as the exact tables say.
  void fill_coarse(bool tail) {
    const LevelId self = tail ? kTail : kFull;
    allocate(self, groups_);
    const std::int64_t leaf = tail ? last_ : group_;
    fill(self, kFull, group_, [&](Tier t, std::int64_t m, std::int64_t d) { return at(kFine, t, leaf, m, d); }, false);
  }

  /// The recursion on `self`, whose suffixes are `self` and prefixes `prefix` (a tail's prefix is
  /// whole groups), one unit being `unit` steps; `leaf(t, m, d)` the cost of one unit.
  template <class Leaf>
  void fill(LevelId self, LevelId prefix, std::int64_t unit, Leaf leaf, bool allow_nowhere) {
    const LevelId suffix = self;
    Level& lv = levels_[self];
    const std::int64_t n = lv.units;
    const auto u = static_cast<double>(unit);
    auto set = [&](Tier t, std::int64_t l, std::int64_t m, std::int64_t d, double c, Option o, std::int64_t j) {
      const std::size_t k = index(self, t, l, m, d);
      if (c < lv.cost[k]) {
        lv.cost[k] = c;
        lv.choice[k] = (static_cast<std::uint32_t>(o) << 29) | static_cast<std::uint32_t>(j);
      }
    };
    for (std::int64_t l = 1; l <= n; ++l) {
      for (int t = 0; t < 2; ++t) {
        const Tier tier = static_cast<Tier>(t);
        const double back = tier == kDisk ? costs_.read : 0.0;
        for (std::int64_t d = 0; d < D_; ++d) {
          for (std::int64_t m = 0; m < M_; ++m) {
            if (l == 1) {
              set(tier, 1, m, d, leaf(tier, m, d), kNowhere, 0);
              continue;
            }
            if (m == 0 && d == 0) {  // nothing to keep: the closed form, whatever the level
              set(tier, l, m, d, nowhere(tier, steps_of(self, l)), kNowhere, 0);
              continue;
            }
            if (allow_nowhere) set(tier, l, m, d, static_cast<double>(l - 1) + back + at(self, tier, l - 1, m, d), kNowhere, l - 1);
            // Groups with no disk slot free: the memory-only optimum over their steps, whatever
            // the group boundaries (Griewank's binomial schedule, x_a moved into memory first if
            // it is on disk).
            if (!allow_nowhere && d == 0 && (tier == kMemory || m >= 1))
              set(tier, l, m, d, static_cast<double>(binomial_min_advances(steps_of(self, l), tier == kMemory ? m + 1 : m)),
                  kBinomial, 0);
            for (std::int64_t j = 1; j < l; ++j) {
              const double prefix_cost = static_cast<double>(j) * u + back + at(prefix, tier, j, m, d);
              if (m >= 1) set(tier, l, m, d, prefix_cost + at(suffix, kMemory, l - j, m - 1, d), kMemorySplit, j);
              if (d >= 1) set(tier, l, m, d, prefix_cost + costs_.write + at(suffix, kDisk, l - j, m, d - 1), kDiskSplit, j);
            }
          }
        }
        // Moving x_a from disk into memory frees a disk slot: reads the memory tables of this l,
        // filled just above.
        if (tier == kDisk)
          for (std::int64_t d = 0; d + 1 < D_; ++d)
            for (std::int64_t m = 1; m < M_; ++m) set(kDisk, l, m, d, at(self, kMemory, l, m - 1, d + 1), kMove, 0);
      }
    }
  }

  std::int64_t L_, M_, D_;
  TierCosts costs_;
  std::int64_t group_ = 1, groups_ = 1, last_ = 1;
  std::array<Level, 3> levels_;
  Tier top_ = kMemory;
  double time_ = 0;
};

/// The schedule a TwoLevelTable describes, on a stack of at most memory + disk + 1 frames.
class TwoLevelStream final : public ActionStream {
 public:
  explicit TwoLevelStream(std::shared_ptr<const TwoLevelTable> table) : table_(std::move(table)) {
    stack_.reserve(static_cast<std::size_t>(table_->memory_slots() + table_->disk_slots() + 2));
  }

  std::string note() const override {
    if (table_->group() == 1) return {};
    return fmt::format("two tiers: {} steps planned as {} groups of {} (splits on top at group boundaries, each group "
                       "exactly)", table_->steps(), table_->groups(), table_->group());
  }
  std::size_t state_bytes() const override {
    return sizeof(*this) + stack_.capacity() * sizeof(Frame) + table_->bytes() + (inner_ ? inner_->state_bytes() : 0);
  }

  bool next(Action& out) override {
    while (used_ == pending_.size()) {
      pending_.clear();
      used_ = 0;
      if (!emit()) return false;
    }
    out = pending_[used_++];
    return true;
  }

 private:
  using T = TwoLevelTable;
  struct Frame {
    std::int64_t a;      // first step
    std::int64_t units;  // length in units of its level
    std::int64_t m, d;   // free slots
    T::Tier tier;        // where x_a is kept
    T::LevelId level;
    int phase = 0;       // 0: x_a in hand, deciding; 1: the suffix is reversed
    std::int64_t j = 0;  // the split, in units
  };

  void put(Action a) { pending_.push_back(a); }

  /// Appends the next actions to pending_; false at the end.
  bool emit() {
    using K = Action::Kind;
    const T& t = *table_;
    if (stage_ == 0) {
      stage_ = 1;
      put({K::snapshot, 0, 1, t.top() == T::kDisk});
      stack_.push_back(Frame{0, t.groups(), t.memory_slots() - (t.top() == T::kMemory ? 1 : 0),
                             t.disk_slots() - (t.top() == T::kDisk ? 1 : 0), t.top(), t.group() == 1 ? T::kFine : T::kTail});
      return true;
    }
    if (stack_.empty()) {
      if (stage_ == 1) {
        stage_ = 2;
        put({K::free, 0});
        return true;
      }
      return false;
    }
    if (inner_) {
      // A memory-only binomial schedule over the frame's steps; x_a is kept already, by the frame.
      Action a{K::free, 0};
      if (!inner_->next(a)) {
        inner_.reset();
        stack_.pop_back();
        return true;
      }
      if (!((a.kind == K::snapshot || a.kind == K::free) && a.step == 0)) {
        a.step += stack_.back().a;
        put(a);
      }
      return true;
    }
    Frame& f = stack_.back();
    const std::int64_t steps = t.steps_of(f.level, f.units);
    if (f.level != T::kFine && (f.units == 1 || (f.m == 0 && f.d == 0))) {
      // One group, or nothing to keep: the rest of the frame is a fine one over its steps.
      f.level = T::kFine;
      f.units = steps;
    }
    if (steps == 1) {
      put({K::record, f.a});
      put({K::reverse, f.a});
      stack_.pop_back();
      return true;
    }
    if (f.phase == 1) {
      // The suffix from x_{a+j} is reversed: drop it, back to x_a, and reverse the prefix.
      const std::int64_t js = t.steps_of(f.level == T::kTail ? T::kFull : f.level, f.j);
      put({K::free, f.a + js});
      put({K::restore, f.a});
      if (f.level == T::kTail) f.level = T::kFull;
      f.units = f.j;
      f.phase = 0;
      return true;
    }
    const T::Choice c = f.level == T::kFine && f.m == 0 && f.d == 0 ? T::Choice{T::kNowhere, steps - 1}
                                                                    : t.choice(f.level, f.tier, f.units, f.m, f.d);
    switch (c.option) {
      case T::kBinomial:
        if (f.tier == T::kDisk) {
          put({K::free, f.a});
          put({K::snapshot, f.a, 1, false});
        }
        inner_ = std::make_unique<BinomialStream>(steps, f.tier == T::kDisk ? f.m : f.m + 1);
        return true;
      case T::kMove:
        put({K::free, f.a});
        put({K::snapshot, f.a, 1, false});
        f.tier = T::kMemory;
        --f.m;
        ++f.d;
        return true;
      case T::kNowhere:
        // Reach the last step from x_a, record and reverse it, and come back for the rest.
        put({K::advance, f.a, steps - 1});
        put({K::record, f.a + steps - 1});
        put({K::reverse, f.a + steps - 1});
        put({K::restore, f.a});
        f.units -= 1;
        return true;
      case T::kMemorySplit:
      case T::kDiskSplit: {
        const bool disk = c.option == T::kDiskSplit;
        const std::int64_t js = t.steps_of(f.level == T::kTail ? T::kFull : f.level, c.j);
        put({K::advance, f.a, js});
        put({K::snapshot, f.a + js, 1, disk});
        f.phase = 1;
        f.j = c.j;
        const Frame child{f.a + js, f.units - c.j, disk ? f.m : f.m - 1, disk ? f.d - 1 : f.d,
                          disk ? T::kDisk : T::kMemory, f.level};
        stack_.push_back(child);  // f is not used after this (push may move it)
        return true;
      }
    }
    return false;
  }

 private:
  std::shared_ptr<const TwoLevelTable> table_;
  std::unique_ptr<BinomialStream> inner_;  // the innermost frame's memory-only schedule, while it runs
  int stage_ = 0;
  std::vector<Frame> stack_;
  std::vector<Action> pending_;
  std::size_t used_ = 0;
};

}  // namespace detail
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
