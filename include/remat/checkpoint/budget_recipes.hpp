#pragma once
// What a memory budget (checkpoint/runtime_budget.hpp) knows of the ops it may recompute: a recipe
// per op registered (its compute, what it reads, its outputs), an entry per output by its
// storage's serial, the storages recipes read with the references they hold, and what rebuilding
// an output would cost now. The budget's search (budget_search.hpp) ranks these; the budget itself
// decides when to discard, rebuild and let go.
//
// Kept apart from the decisions: the budget's rules (runtime_budget.hpp) add and remove recipes,
// entries and reads as ops register and storages go, and the search keeps its own state in each
// entry (rank, cost, class); what a recipe computes from, and what rebuilding it costs from the
// state of its inputs, is read here by both.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "remat/core/memory.hpp"
#include "remat/core/op_output.hpp"

namespace remat::detail {

/// The recipes, entries and reads of a memory budget (the base of BudgetCore, through BudgetSearch).
class BudgetRecipes {
 protected:
  struct Recipe {
    OpId op;
    double flops = 0;
    double weight = 0;  // what the heuristic counts: flops, and the memory-bound part of the op
    std::uint64_t order = 0;  // across steps, for pruning newest first
    std::size_t index = 0;    // within its step, for plans and logs
    Recompute how;
    std::vector<std::shared_ptr<int>> read_refs;  // per read: the budget's count of references to it
    std::vector<std::weak_ptr<Storage>> outputs;
    std::vector<std::uint64_t> versions;

    ~Recipe() {
      for (std::size_t i = 0; i < read_refs.size(); ++i)
        if (read_refs[i]) *read_refs[i] -= how.held_by_compute[i] + 1;
    }
  };
  struct Entry {
    std::shared_ptr<Recipe> recipe;
    Storage* storage = nullptr;  // valid while recipe->outputs[output] has not expired
    std::size_t output = 0;
    // Its place in its class, least first: its last use (DTR's staleness), or, looking ahead,
    // kNever less its next read (the farthest read first).
    std::uint64_t rank = 0;
    double cost = 0;       // what rebuilding it would cost now (cost()), kept current while indexed
    int bucket = 0;        // its class of cost per byte in the index
    bool indexed = false;  // a candidate: saved, resident, registered
  };
  using EntryRef = std::pair<const std::uint64_t, Entry>;  // by the storage's serial

  /// The references the budget's recipes hold to `s` (which do not make it "held by the user").
  int budget_refs(const Storage& s) const {
    auto it = reads_.find(s.serial());
    return it == reads_.end() ? 0 : *it->second.refs;
  }

  /// The heuristic's price of an output byte, in flops: element-wise ops move bytes at a few
  /// hundred flops' worth of a GEMM's time each (dropout's random numbers more), so an op's flops
  /// alone make the residual stream look free to rebuild. Measured: at 447 GFLOP/s a GEMM spends
  /// 2.2 ps a flop; dropout_add spends about 1.5 ns an element (Philox included).
  static constexpr double kFlopsPerOutputByte = 150.0;
  /// The price of an element an op computes inside and drops (OpWork::inner_elements: an
  /// attention's scores), in flops. Measured on one thread: the fused attention with dropout took
  /// 482 µs at the deep GPT's shapes (B 4, 4 heads of 32, t 64) and 3.75 ms at the small GPT's (B 8,
  /// 4 heads of 64, t 128), against 10 ps a flop for the qkv linear beside it: after its products,
  /// 4.6-6.1 ns a score, about 500 of the linear's flops. Counted at flops alone, the budget took
  /// an attention output for a fifth of its cost and recomputed 60 of them where per-block
  /// checkpointing replays 32 (the deep GPT at blocks' peak); at 500, 30.
  static constexpr double kFlopsPerInnerElement = 500.0;

  using CostMemo = std::unordered_map<const Recipe*, double>;

  /// What recomputing a recipe's outputs now would cost: its flops, and those of every discarded
  /// input it would have to recompute first, recursively (DTR's evicted neighbourhood, ancestors
  /// side). A discarded residual stream is cheap to add again but not to rebuild from scratch.
  double cost(const Recipe& r, CostMemo& memo, double Recipe::*measure = &Recipe::weight) const {
    if (auto it = memo.find(&r); it != memo.end()) return it->second;
    double c = r.*measure;
    memo[&r] = c;  // an input shared along two paths counts once per path at most
    for (const auto& in : r.how.reads)
      if (!in->resident())
        if (auto it = entries_.find(in->serial()); it != entries_.end()) c += cost(*it->second.recipe, memo, measure);
    memo[&r] = c;
    return c;
  }
  /// The flops recomputing a recipe's outputs now would take (for logs and reports).
  double flops_to_rebuild(const Recipe& r) const {
    CostMemo memo;
    return cost(r, memo, &Recipe::flops);
  }

  bool discardable(const Storage& s, const Entry& e, const std::weak_ptr<Storage>& w, const Storage* incoming) const {
    if (&s == incoming || !s.resident() || s.saved_refs() == 0) return false;
    if (s.version() != e.recipe->versions[e.output]) return false;  // written in place since
    // Held by nothing but saved records and the budget's own recipes: no user handle, no op or
    // backward reading it now.
    return w.use_count() == s.saved_refs() + budget_refs(s);
  }

  /// The recipes reading `s`, those still alive.
  std::vector<std::shared_ptr<Recipe>> readers_of(const Storage& s) const {
    std::vector<std::shared_ptr<Recipe>> out;
    if (auto r = reads_.find(s.serial()); r != reads_.end())
      for (const auto& w : r->second.readers)
        if (auto recipe = w.lock()) out.push_back(std::move(recipe));
    return out;
  }

  /// Every recipe an entry holds, each once.
  std::vector<std::shared_ptr<Recipe>> recipes() const {
    std::vector<std::shared_ptr<Recipe>> out;
    for (const auto& [serial, e] : entries_)
      if (std::find(out.begin(), out.end(), e.recipe) == out.end()) out.push_back(e.recipe);
    return out;
  }

  // Registered outputs by their storage's serial (serials are never reused, addresses are).
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::vector<std::weak_ptr<Recipe>> by_index_;  // this step's op invocations, in order
  // Every storage a recipe reads (parameters apart), with the recipes reading it and the references
  // they hold.
  struct Read {
    std::weak_ptr<Storage> storage;
    std::vector<std::weak_ptr<Recipe>> readers;
    std::shared_ptr<int> refs;
  };
  std::unordered_map<std::uint64_t, Read> reads_;
};

}  // namespace remat::detail
