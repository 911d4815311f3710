#pragma once
// A memory budget's search for what to discard (checkpoint/runtime_budget.hpp): DTR's rule, the
// least recompute cost / (bytes x staleness) first (Kirisame et al. 2021), found through an index
// of the candidates by class of cost per byte instead of a scan of every registered output; and,
// from a budget's second step, staleness replaced by the distance to the next read the last step
// made (budget_uses.hpp).
//
// Kept apart from the budget's books and rules (when to make room, sweep, rebuild, prune, which
// plan a step replays): the index is a cache over the recipes' costs and uses (budget_recipes.hpp).
// The rules add and remove candidates through index() and unindex() and note changed costs
// (recost_readers); a candidate that stopped being one (no longer saved or resident, or written
// in place) is dropped when a search meets it, and costs noted as changed are brought up to date
// when a search starts, so a search sees the classes an eager upkeep would have kept.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "remat/checkpoint/budget_recipes.hpp"
#include "remat/checkpoint/budget_uses.hpp"
#include "remat/core/memory.hpp"

namespace remat::detail {

/// The candidate index of a memory budget and its search (the base of BudgetCore).
class BudgetSearch : protected BudgetRecipes {
 protected:
  /// The candidate with the least DTR score, cost / (bytes x staleness), searched through the index:
  /// candidates are kept in classes of cost per byte (each class within kClassWidth of its
  /// neighbours) and, inside a class, oldest use first; so the oldest discardable candidate of each
  /// class is the best of its class up to that width, and a decision looks at one candidate per
  /// class instead of every registered output. Ties go to the earliest op, whatever the addresses.
  /// Looking ahead (budget_uses.hpp), staleness is the distance to the next read, and the farthest
  /// comes first in a class. The costs noted as changed must be current first (recost_stale()).
  Storage* choose(const Storage* incoming) {
    Storage* best = nullptr;
    double best_score = std::numeric_limits<double>::infinity();
    std::pair<std::uint64_t, std::size_t> best_key{};
    for (auto cls = index_.begin(); cls != index_.end();) {
      std::set<Slot>& slots = cls->second;
      for (auto it = slots.begin(); it != slots.end();) {
        const auto found = entries_.find(it->serial);
        if (found == entries_.end() || found->second.recipe->outputs[found->second.output].expired()) {
          it = slots.erase(it);  // gone
          continue;
        }
        Entry& e = found->second;
        Storage* s = e.storage;
        if (s == incoming) {
          ++it;  // saved the moment this room is made
          continue;
        }
        if (!s->resident() || s->saved_refs() == 0 || s->version() != e.recipe->versions[e.output]) {
          e.indexed = false;  // not a candidate until saved (or rebuilt) again; written in place: never
          it = slots.erase(it);
          continue;
        }
        if (!discardable(*s, e, e.recipe->outputs[e.output], incoming)) {
          ++it;  // held for now by a user, an op or a backward
          continue;
        }
        const double score = e.cost / (static_cast<double>(s->bytes()) * distance(e));
        const std::pair<std::uint64_t, std::size_t> key{e.recipe->order, e.output};
        if (score < best_score || (score == best_score && key < best_key)) {
          best = s;
          best_score = score;
          best_key = key;
        }
        break;
      }
      cls = slots.empty() ? index_.erase(cls) : std::next(cls);
    }
    return best;
  }

  /// Width of a class of cost per byte in the index: the search's choice is DTR's within this factor.
  static constexpr double kClassWidth = 1.02;

  /// Makes a registered, saved, resident output a candidate (again), at its current cost.
  void index(EntryRef& ref) {
    Entry& e = ref.second;
    if (e.indexed) unindex(ref);
    // Its recipe's own weight while every input is here (the usual case), else with what is away.
    const auto& reads = e.recipe->how.reads;
    if (std::all_of(reads.begin(), reads.end(), [](const auto& in) { return in->resident(); })) {
      e.cost = e.recipe->weight;
    } else {
      CostMemo memo;
      e.cost = cost(*e.recipe, memo);
    }
    e.bucket = static_cast<int>(std::floor(std::log(e.cost / static_cast<double>(e.storage->bytes())) /
                                           std::log(kClassWidth)));
    index_[e.bucket].insert(Slot{e.rank, e.recipe->order, e.output, ref.first});
    e.indexed = true;
  }
  void unindex(EntryRef& ref) {
    Entry& e = ref.second;
    if (!e.indexed) return;
    auto cls = index_.find(e.bucket);
    cls->second.erase(Slot{e.rank, e.recipe->order, e.output, ref.first});
    if (cls->second.empty()) index_.erase(cls);
    e.indexed = false;
  }
  /// Where an entry used at `now` (the budget's clock) stands in its class: by its last use, or,
  /// with the last step's reads to look ahead with, by how far its next read is.
  std::uint64_t rank(const Entry& e, std::uint64_t now) const {
    return uses_.ahead() ? BudgetUses::kNever - uses_.next_read(e.recipe->index, e.output) : now;
  }
  /// The score's divisor beside the bytes: the staleness of the last use, or the ticks to the next
  /// read (a read that the step has passed without making counts as imminent).
  double distance(const Entry& e) const {
    if (!uses_.ahead()) return static_cast<double>(clock_ - e.rank + 1);
    const std::uint64_t next = BudgetUses::kNever - e.rank;
    return next > uses_.now() ? static_cast<double>(next - uses_.now()) : 1.0;
  }
  /// A use of a registered output: staleness restarts, or the next read is the one after.
  void touch(EntryRef& ref, std::uint64_t now) {
    Entry& e = ref.second;
    if (!e.indexed) {
      e.rank = rank(e, now);
      return;
    }
    auto cls = index_.find(e.bucket);
    cls->second.erase(Slot{e.rank, e.recipe->order, e.output, ref.first});
    e.rank = rank(e, now);
    cls->second.insert(Slot{e.rank, e.recipe->order, e.output, ref.first});
  }
  /// `s` went away or came back: what rebuilding each candidate computed from it (through outputs
  /// that are away, recursively) would cost has changed. Noted here, re-costed by the next search
  /// (recost_stale): most releases of a step never meet a decision (none at all under a budget the
  /// step fits, none under a replayed plan), and the walk, eager, was most of a budget's own time
  /// on the deep GPT (2.7% of its step; cache misses in the maps, not instructions).
  void recost_readers(const Storage& s) {
    stale_.push_back(s.serial());
    // Bounded between searches: duplicates and the dead go, leaving at most one per storage that
    // recipes read, so the next compaction is that many pushes away.
    if (stale_.size() > 2 * reads_.size() + 1024) {
      std::sort(stale_.begin(), stale_.end());
      stale_.erase(std::unique(stale_.begin(), stale_.end()), stale_.end());
      stale_.erase(std::remove_if(stale_.begin(), stale_.end(), [&](std::uint64_t k) { return !reads_.count(k); }),
                   stale_.end());
    }
  }
  /// The costs recost_readers noted as changed, brought up to date from the state now: index()
  /// depends on that state alone, so doing it late gives the classes an eager walk would have.
  void recost_stale() {
    std::sort(stale_.begin(), stale_.end());
    stale_.erase(std::unique(stale_.begin(), stale_.end()), stale_.end());
    for (const std::uint64_t serial : stale_) recost_walk(serial);
    stale_.clear();
  }
  void recost_walk(std::uint64_t first) {
    // Small: the readers of one storage, and whatever is away beyond them (a linear seen list).
    std::vector<std::uint64_t> seen{first}, todo{first};
    while (!todo.empty()) {
      const std::uint64_t from = todo.back();
      todo.pop_back();
      const auto read = reads_.find(from);
      if (read == reads_.end()) continue;
      for (const auto& reader : read->second.readers) {
        const std::shared_ptr<Recipe> recipe = reader.lock();
        if (!recipe) continue;
        for (const auto& w : recipe->outputs) {
          auto o = w.lock();
          if (!o || std::find(seen.begin(), seen.end(), o->serial()) != seen.end()) continue;
          seen.push_back(o->serial());
          auto it = entries_.find(o->serial());
          if (it == entries_.end()) continue;
          if (!o->resident()) todo.push_back(o->serial());
          else if (it->second.indexed) index(*it);
        }
      }
    }
  }

  /// Every candidate placed again in its class, after the rank's meaning changed (looking ahead
  /// or not).
  void rerank() {
    for (auto& ref : entries_) {
      Entry& e = ref.second;
      const bool indexed = e.indexed && !e.recipe->outputs[e.output].expired();
      unindex(ref);
      e.rank = rank(e, clock_);
      if (indexed) index(ref);
    }
  }

  BudgetUses uses_;         // when this step read each output, and when the last one did
  // The candidates for discarding, by class of cost per byte, oldest use first within a class.
  struct Slot {
    std::uint64_t rank, order;
    std::size_t output;
    std::uint64_t serial;
    bool operator<(const Slot& o) const {
      return std::tie(rank, order, output) < std::tie(o.rank, o.order, o.output);
    }
  };
  std::map<int, std::set<Slot>> index_;
  std::vector<std::uint64_t> stale_;  // serials whose readers' costs changed since the last search
  std::uint64_t clock_ = 0;
};

}  // namespace remat::detail
