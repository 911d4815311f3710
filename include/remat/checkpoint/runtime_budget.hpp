#pragma once
// MemoryBudget: a hard limit on the activation bytes saved for backward, for any graph the tape
// records (parameters, alive whatever the graph does, count apart: memory_stats()'s
// saved_activation_bytes is what it caps).
//
//   { remat::MemoryBudget budget(512 << 20); loss = model.loss(x, y); loss.backward(); }
//
// A budget is a saved-tensor store and an observer (core/saved_tensor_hooks.hpp,
// core/observer.hpp), nothing more. As an observer it registers every op output computed for a
// recorded graph with how to compute it again (the op's offered Recompute: its own compute, holding
// its inputs and, for a random op, the generator state it drew at). As the store it is handed each
// tensor a node saves (checkpoint boundaries, chain snapshots and compactly held steps too), and
// before those bytes join the saved-for-backward books it discards registered outputs until they
// fit — DTR's rule (Kirisame et al. 2021): the least recompute cost / (bytes x staleness) goes
// first, searched through an index of the candidates by class of cost per byte (choose(),
// budget_search.hpp). A discarded output is recomputed, its discarded inputs first, when its
// store's unpack (or pin, before a node's backward) is asked for it: only saved records and the
// budget's own recipes hold what it discards, so nothing else can read it, and a storage stays
// bytes that never call up. Leaves, parameters, tensors the user holds and tensors an op or a
// backward is reading are never discarded. The inputs a recomputation would read cost nothing while
// something else holds them; once only recomputations do, a rebuildable one is let go (released:
// rebuilt in turn if a recomputation needs it) and any other is counted as saved. So a budget at or
// above the step's activation peak without a budget never discards and never raises that peak. The
// discards of a step are logged, and the log of one step is a static plan the next steps replay
// without searching (training steps repeat): a budget that lives across steps does so by itself,
// while each step registers the ops of the last one (op, output bytes, in order), and searches
// again from the first op that differs. Its second step searches knowing when the first read each
// output (budget_uses.hpp: the farthest next read goes first instead of the stalest), and from the
// third on it replays the cheaper of the two searches.
//
// With a BudgetOffload, a discard may write the output to a file instead, read back when backward
// needs it: chosen tensor by tensor, when writing and reading its bytes would take less time than
// recomputing it (both measured as the step goes; Capuchin's and POET's choice between swapping
// and recomputing). The log says which each discard was.
//
// A store inside the budget (SaveInBFloat16, Offload) is asked first; what it declines the budget
// keeps. A budget below what the step needs is a remat::Error at the end of that step's backward,
// naming the smallest budget that worked (measured); the step's gradients are complete and exact
// all the same, and the next step can retry with that budget.
//
// Second order: under create_graph the tensors the recorded backward saves are held and count
// against the budget with the forward's (only the forward's outputs are registered to be computed
// again); in hvp's tangent walk it caps the saved tensors, not their tangents (autograd metadata,
// outside the books).

#include <algorithm>
#include <any>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "remat/checkpoint/budget_disk.hpp"
#include "remat/checkpoint/budget_log.hpp"
#include "remat/checkpoint/budget_search.hpp"
#include "remat/checkpoint/error.hpp"
#include "remat/checkpoint/replay.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/saved_tensor_hooks.hpp"
#include "remat/core/timeline.hpp"

namespace remat {

namespace detail {

class BudgetCore;

/// What a node keeps of a tensor the budget holds for it: the tensor, and the budget, which it
/// tells when it lets go. One saved reference of the storage while it lives.
struct BudgetHold {
  BudgetHold(TensorRef r, std::shared_ptr<BudgetCore> c);
  ~BudgetHold();
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;

  TensorRef ref;
  std::shared_ptr<BudgetCore> core;
};

/// The budget's state and decisions; MemoryBudget is its scope on one thread. Shared with every
/// hold, since a graph may outlive the scope (then closed: it decides nothing more).
class BudgetCore : BudgetSearch {
 public:
  BudgetCore(std::size_t bytes, std::thread::id owner) : budget_(bytes), limit_(bytes), owner_(owner) { begin_step(); }
  BudgetCore(std::size_t bytes, std::thread::id owner, BudgetOffload offload) : BudgetCore(bytes, owner) {
    disk_.emplace(std::move(offload));
  }
  BudgetCore(const BudgetCore&) = delete;
  BudgetCore& operator=(const BudgetCore&) = delete;

  void use_plan(DiscardPlan plan) {
    plan_ = std::move(plan);
    given_plan_ = true;
  }

  std::size_t budget() const { return budget_; }
  const BudgetLog& log() const { return log_; }
  const BudgetLog& last_log() const { return last_log_; }
  /// After an infeasible step: the smallest budget that worked for it (measured); else 0.
  std::size_t least_feasible_bytes() const { return last_log_.least_feasible; }
  /// What the next step replays, if it repeats the last (the cheaper search, after the second
  /// step); else the last step's decisions.
  DiscardPlan plan() const { return reusing() && !given_plan_ ? *plan_ : DiscardPlan::from(last_log_); }

  // --- the scope's end ---------------------------------------------------------------------------
  /// Outputs still discarded and needed by a graph kept for another backward (or never run) are
  /// recomputed now, without a budget, oldest first; then the budget lets go of all it holds.
  void close() {
    closing_ = true;
    prune();
    std::vector<std::shared_ptr<Recipe>> left = recipes();
    std::sort(left.begin(), left.end(), [](const auto& a, const auto& b) { return a->order < b->order; });
    for (const auto& r : left)
      for (const auto& w : r->outputs)
        if (auto s = w.lock(); s && !s->resident() && records_holding(*s) > 0) {
          try {
            rebuild(*s);
          } catch (...) {
            // Left discarded: reading it later is a remat::Error (memory.hpp), not a crash.
          }
        }
    left.clear();
    index_.clear();
    by_index_.clear();
    auto entries = std::move(entries_);
    entries_.clear();
    entries.clear();  // recipes go here, releasing what they held
    auto counted = std::move(counted_);
    counted_.clear();
    for (auto& [serial, held] : counted) held->release_saved();
    counted.clear();
    reads_.clear();
    pending_.clear();
    keep_.clear();
    hashes_.clear();
    disk_.reset();  // its files and directory with it
  }
  bool closed() const { return closing_; }

  // --- the store ---------------------------------------------------------------------------------
  /// A tensor a node saves: the budget keeps it (a hold), parameters apart (alive anyway).
  static std::any pack(const std::shared_ptr<BudgetCore>& self, const AnyTensor& t) {
    if (self->closing_ || t.ref().storage->parameter()) return {};
    return std::make_shared<BudgetHold>(t.ref(), self);
  }

  /// The tensor again, recomputed first if it was discarded.
  AnyTensor unpack(const BudgetHold& h) {
    if (!closing_ && !h.ref.storage->resident()) rebuild(*h.ref.storage);
    return AnyTensor(h.ref);
  }

  /// A backward is about to read the tensor: recomputed if discarded, a use (for staleness), and
  /// held until the returned handle goes.
  std::shared_ptr<void> pin(const BudgetHold& h) {
    if (closing_) return nullptr;
    std::shared_ptr<Storage> held = h.ref.storage;
    if (!held->resident()) rebuild(*held);
    uses_.tick();
    if (auto it = entries_.find(held->serial()); it != entries_.end()) {
      uses_.read(it->second.recipe->index, it->second.output);
      touch(*it, ++clock_);
    }
    sweep(held.get());
    return held;
  }

  /// Where a held tensor is, for print_saved_tensors().
  PackedState state(const BudgetHold& h) const {
    const Storage& s = *h.ref.storage;
    PackedState st;
    st.storage = &s;
    st.discarded = !s.resident();
    st.ram_bytes = st.discarded ? 0 : s.bytes();
    st.where = st.discarded ? "discarded by a memory budget" : "in RAM (memory budget)";
    if (st.discarded)
      if (auto it = entries_.find(s.serial()); it != entries_.end()) st.rebuild_flops = flops_to_rebuild(*it->second.recipe);
    return st;
  }

  /// Before `bytes` of `incoming` join the saved books (a hold taken, a recomputation's input
  /// counted, a rebuilt output back): discards others until they fit.
  void make_room(std::size_t bytes, const Storage* incoming) {
    if (closing_) return;
    sweep(incoming);
    // Saved from now on, so a candidate (a rebuilt one is indexed when its bytes are back).
    if (incoming && incoming->resident())
      if (auto it = entries_.find(incoming->serial()); it != entries_.end() && !it->second.indexed) index(*it);
    const std::size_t moment = moment_++;
    std::size_t saved = books_->saved_bytes();
    if (plan_) {
      while (next_planned_ < plan_->discards.size() && plan_->discards[next_planned_].moment < moment) ++next_planned_;
      for (; next_planned_ < plan_->discards.size() && plan_->discards[next_planned_].moment == moment; ++next_planned_) {
        const DiscardPlan::Discard& d = plan_->discards[next_planned_];
        Storage* s = planned(d, incoming);
        if (!s) {
          ++log_.plan_misses;
          continue;
        }
        saved -= s->bytes();
        discard(*s, moment);
      }
    }
    while (saved + bytes > limit_) {
      ++log_.decisions;
      const auto recosting = std::chrono::steady_clock::now();
      recost_stale();  // what choose() ranks by; timed apart, since it is upkeep deferred to here
      const auto searching = std::chrono::steady_clock::now();
      log_.recost_seconds += std::chrono::duration<double>(searching - recosting).count();
      Storage* victim = choose(incoming);
      log_.search_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - searching).count();
      if (!victim) {
        // Nothing left to discard: the step needs more than the budget. Go on (the gradients stay
        // exact) under a limit raised to what this moment needed, so the rest of the step costs
        // what it would under that budget; the highest limit reached is the budget the error
        // names, and this step's decisions (plan()) fit it exactly. (Discarding all that can be
        // instead, to measure the need with the least kept, recomputes ancestries again and again:
        // minutes for a step of a small GPT.)
        const std::size_t needed = saved + bytes;
        if (!over_)
          first_over_ = fmt::format("first during {}: {} B would be saved with {} B arriving, and nothing left could "
                                    "be discarded", session().backward_depth > 0 ? "backward" : "forward",
                                    needed, bytes);
        over_ = true;
        least_ = std::max(least_, needed);
        limit_ = least_;
        log_.events.push_back({BudgetEvent::Kind::overflow, moment, 0, 0, {}, needed, 0});
        break;
      }
      saved -= victim->bytes();
      discard(*victim, moment);
    }
  }

  /// A saved reference the budget takes (or a hold): room made first when the bytes join the books.
  void retain_saved(Storage& s) {
    if (s.saved_refs() == 0 && s.resident() && !s.parameter()) make_room(s.bytes(), &s);
    s.retain_saved();
  }
  /// The hold of `s` let go: when no saved record holds it any more, it may now be held only for
  /// recomputations (the next sweep settles it); when nothing holds it at all, it is forgotten.
  void release_saved(std::shared_ptr<Storage> s) {
    s->release_saved();
    if (s->saved_refs() == 0) unsaved(*s);
    const std::uint64_t serial = s->serial();
    const std::weak_ptr<Storage> w = s;
    s.reset();
    if (w.expired()) forget(serial);
  }

  // --- the observer ------------------------------------------------------------------------------
  /// Before an op makes its outputs: what only recipes hold goes first, as it would have without a
  /// budget.
  void op_begin() { sweep(nullptr); }

  /// An op made its outputs: registered with how to compute them again, when computed for a graph
  /// being recorded.
  void op(const OpOutput& out, const OpValues& values) {
    if (out.recompute == nullptr || !registering()) return;
    recomputable(out, values, out.recompute->take());
  }

  /// The outermost backward returned: ends the step's log, and throws (gradients complete) when the
  /// step did not fit.
  void backward_ended(bool completed) {
    if (closing_) return;
    prune();
    finish_step();
    if (completed && last_log_.least_feasible > 0)
      throw Error(fmt::format(
          "MemoryBudget: the step needs more than the budget of {} B of activations saved for backward ({}). The "
          "smallest budget that works for this step is {} B (measured: the step went on under a limit raised to each "
          "moment's need; MemoryBudget(budget.plan()) replays its decisions within that budget); the step's gradients "
          "are complete and exact", budget_, last_first_over_, last_log_.least_feasible));
  }

 private:
  /// Register what ops compute for a graph being recorded: the forward, and a replay's nested tape
  /// (not what a backward function computes for its gradients).
  bool registering() const {
    const Session& st = session();
    return !closing_ && st.grad_enabled && st.recording && (st.backward_depth == 0 || st.replay_depth > 0);
  }

  void recomputable(const OpOutput& out, const OpValues& values, Recompute how) {
    auto recipe = std::make_shared<Recipe>();
    recipe->op = out.op;
    recipe->flops = out.flops;
    recipe->weight = out.flops + kFlopsPerOutputByte * static_cast<double>(out.bytes) +
                     kFlopsPerInnerElement * out.inner_elements;
    recipe->order = next_order_++;
    recipe->index = by_index_.size();
    recipe->outputs.resize(values.size());
    recipe->versions.resize(values.size());
    bool any = false;
    const std::uint64_t now = ++clock_;
    uses_.tick();
    for (std::size_t i = 0; i < values.size(); ++i) {
      Storage* s = values[i].storage.get();
      // A view of an input (reshape) is not this op's to recompute; nor is an empty tensor, nor
      // one registered already.
      if (s->serial() < how.first_new_serial || s->bytes() == 0 || entries_.count(s->serial())) continue;
      recipe->outputs[i] = values[i].storage;
      recipe->versions[i] = s->version();
      auto entry = entries_.insert_or_assign(s->serial(), Entry{recipe, s, i}).first;
      entry->second.rank = rank(entry->second, now);
      if (s->saved_refs() > 0) index(*entry);  // a candidate once something saves it (make_room)
      any = true;
    }
    by_index_.push_back(recipe);
    ++log_.registered;
    // The op sequence of the step, against the last one's while its plan is replayed.
    std::uint64_t sig = fnv1a(out.op.name(), std::strlen(out.op.name()));
    sig = fnv1a(&out.bytes, sizeof out.bytes, sig);
    ops_.push_back(sig);
    if (!diverged_ && (reusing() || uses_.ahead()) &&
        (ops_.size() > last_ops_.size() || last_ops_[ops_.size() - 1] != sig)) {
      // A different step: the search decides from here on, by staleness (the reads ahead were
      // another step's).
      if (reusing()) {
        plan_.reset();
        log_.plan_abandoned = true;
      }
      diverged_ = true;
      uses_.forget_ahead();
      rerank();
    }
    if (!any) return;
    recipe->how = std::move(how);
    recipe->read_refs.resize(recipe->how.reads.size());
    for (std::size_t i = 0; i < recipe->how.reads.size(); ++i) {
      const std::shared_ptr<Storage>& in = recipe->how.reads[i];
      if (in->parameter()) continue;
      auto [read, fresh] = reads_.try_emplace(in->serial(), Read{in, {}, std::make_shared<int>(0)});
      // Not counted while something else holds it (sweep() decides when nothing does).
      *read->second.refs += recipe->how.held_by_compute[i] + 1;
      recipe->read_refs[i] = read->second.refs;
      read->second.readers.push_back(recipe);
      if (fresh) pending_.insert(in->serial());
      if (auto it = entries_.find(in->serial()); it != entries_.end()) {
        uses_.read(it->second.recipe->index, it->second.output);
        touch(*it, now);
      }
    }
    sweep(nullptr);
  }

  /// No saved record holds `s` now; if only recomputations do, the next sweep lets it go.
  void unsaved(const Storage& s) {
    if (closing_) return;
    if (auto it = entries_.find(s.serial()); it != entries_.end()) unindex(*it);  // not saved: nothing to discard
    if (reads_.count(s.serial())) pending_.insert(s.serial());
  }

  /// The storage of serial `serial` is gone; its recipe goes with it.
  void forget(std::uint64_t serial) {
    if (closing_) return;
    hashes_.erase(serial);
    reads_.erase(serial);
    pending_.erase(serial);
    keep_.erase(serial);
    if (auto it = entries_.find(serial); it != entries_.end()) unindex(*it);
    drop_file(serial);
    auto node = entries_.extract(serial);  // the recipe (and what it holds) may go when `node` does
  }

  Storage* planned(const DiscardPlan::Discard& d, const Storage* incoming) const {
    if (d.op_index >= by_index_.size()) return nullptr;
    const std::shared_ptr<Recipe> r = by_index_[d.op_index].lock();
    if (!r || d.output >= r->outputs.size()) return nullptr;
    auto s = r->outputs[d.output].lock();
    if (!s) return nullptr;
    auto it = entries_.find(s->serial());
    if (it == entries_.end()) return nullptr;
    Storage* p = s.get();
    const std::weak_ptr<Storage> w = s;
    s.reset();
    return discardable(*p, it->second, w, incoming) ? p : nullptr;
  }

  /// The inputs of recomputations that nothing else holds any more, settled as the step without a
  /// budget would free them: a rebuildable one is let go (rebuilt in turn if a recomputation needs
  /// it); one that is not (made outside the budget's sight: a factory's, a checkpointed forward's)
  /// takes the recipes reading it off the books, so their outputs are no longer discardable —
  /// unless one of those outputs is discarded already and needs it to come back: then it is counted
  /// as saved, since only the budget keeps it. Those something else still holds wait for a later
  /// sweep. Decided first and done after, since letting go may destroy storages.
  void sweep(const Storage* incoming) {
    if (sweeping_ || closing_ || pending_.empty()) return;
    sweeping_ = true;
    std::vector<std::shared_ptr<Storage>> release, settle;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const auto found = reads_.find(*it);
      std::shared_ptr<Storage> s = found == reads_.end() ? nullptr : found->second.storage.lock();
      if (!s || !s->resident() || s->saved_refs() > 0 || s->parameter()) {
        it = pending_.erase(it);  // gone, away, or counted by the record that saves it
        continue;
      }
      if (s.get() == incoming || s.use_count() - 1 > budget_refs(*s)) {
        ++it;  // a user, an op or a backward holds it
        continue;
      }
      it = pending_.erase(it);
      const auto entry = entries_.find(s->serial());
      if (!keep_.count(s->serial()) && entry != entries_.end() &&
          s->version() == entry->second.recipe->versions[entry->second.output])
        release.push_back(std::move(s));
      else
        settle.push_back(std::move(s));
    }
    for (const auto& s : release) {
      forget_bytes(*s);
      ++log_.releases;
    }
    // Counting one makes room (a moment, as plans count them): in an order that does not depend on
    // where the storages happen to be in memory.
    std::sort(settle.begin(), settle.end(), [](const auto& a, const auto& b) { return a->serial() < b->serial(); });
    for (const auto& s : settle) {
      // Rebuilt (so likely needed again), or needed by an output already discarded: counted.
      std::unordered_set<const Storage*> seen;
      if (keep_.erase(s->serial()) > 0 || needed_for_rebuild(*s, seen)) {
        if (counted_.count(s->serial()) == 0) {
          retain_saved(*s);  // may make room: sweeping_ keeps that from sweeping again
          counted_.emplace(s->serial(), s);
        }
        continue;
      }
      cut(*s);
    }
    release.clear();
    settle.clear();  // the last holds of what cut recipes read go here
    sweeping_ = false;
  }

  /// Whether a recomputation the step may still run reads `s`: an output computed from it is away
  /// and held by a saved record (discarded by a decision), or away and, in turn, so needed.
  bool needed_for_rebuild(const Storage& s, std::unordered_set<const Storage*>& seen) const {
    if (!seen.insert(&s).second) return false;
    for (const auto& recipe : readers_of(s))
      for (const auto& w : recipe->outputs)
        if (auto out = w.lock(); out && !out->resident())
          if (records_holding(*out) > 0 || needed_for_rebuild(*out, seen)) return true;
    return false;
  }

  /// Takes the recipes reading `s` off the books, and what they computed that is away (let go,
  /// never to be rebuilt now) with its own readers: their outputs are no longer discardable, and
  /// each recipe, with what it holds, goes when nothing else refers to it.
  void cut(const Storage& s) {
    for (const auto& recipe : readers_of(s))
      for (const auto& w : recipe->outputs)
        if (auto o = w.lock()) {
          auto it = entries_.find(o->serial());
          if (it == entries_.end() || it->second.recipe != recipe) continue;
          unindex(*it);
          entries_.erase(it);
          drop_file(o->serial());
          if (!o->resident()) cut(*o);
        }
  }

  /// How many saved records (nodes, checkpoints, snapshots) hold `s`: its saved references but the
  /// one the budget takes itself for a storage only recipes hold.
  int records_holding(const Storage& s) const { return s.saved_refs() - static_cast<int>(counted_.count(s.serial())); }

  /// Frees a registered output's bytes (hashed first under checking, to verify its rebuild).
  void forget_bytes(Storage& s) {
    if (session().check_replay_values) hashes_[s.serial()] = checksum64(s.raw_data(), s.bytes());
    if (auto it = entries_.find(s.serial()); it != entries_.end()) unindex(*it);
    s.discard();
    recost_readers(s);
  }

  void discard(Storage& s, std::size_t moment) {
    const Entry& e = entries_.at(s.serial());
    const bool disk = disk_ && write_out(s, *e.recipe);
    log_.events.push_back({BudgetEvent::Kind::discard, moment, e.recipe->index, e.output, e.recipe->op.name(),
                           s.bytes(), flops_to_rebuild(*e.recipe), disk});
    ++log_.discards;
    forget_bytes(s);
  }

  // --- the disk (BudgetOffload) ------------------------------------------------------------------
  /// Writes a discarded output to the disk where that is quicker than recomputing it (with its
  /// discarded inputs); false when it is not, or when the disk refuses (a plain discard then).
  bool write_out(const Storage& s, const Recipe& r) {
    CostMemo memo;
    if (!disk_->quicker(s.bytes(), cost(r, memo))) return false;
    const std::optional<double> seconds = disk_->write(s);
    if (!seconds) return false;
    ++log_.to_disk;
    log_.disk_bytes += s.bytes();
    log_.write_seconds += *seconds;
    return true;
  }

  /// The file of serial's output, if it has one, removed: the output is back, or gone for good.
  void drop_file(std::uint64_t serial) {
    if (disk_) disk_->drop(serial);
  }

  void rebuild(Storage& s) {
    REMAT_CHECK(std::this_thread::get_id() == owner_,
                "MemoryBudget: a discarded tensor was read on another thread than the budget's; recomputation "
                "runs on the thread that records the graph");
    auto it = entries_.find(s.serial());
    REMAT_CHECK(it != entries_.end(), "MemoryBudget: a discarded tensor of {} B can no longer be recomputed (its "
                "recipe was let go)", s.bytes());
    const std::shared_ptr<Recipe> r = it->second.recipe;
    if (disk_ && disk_->holds(s.serial())) {
      Storage fresh(s.bytes());
      const double seconds = disk_->read(s.serial(), fresh);
      log_.read_seconds += seconds;
      ++log_.read_back;
      if (s.saved_refs() > 0) make_room(s.bytes(), &s);
      s.adopt(fresh);
      hashes_.erase(s.serial());  // the file's own hash checked the bytes
      touch(*it, ++clock_);
      if (s.saved_refs() > 0 && !it->second.indexed) index(*it);
      recost_readers(s);
      log_.events.push_back({BudgetEvent::Kind::recompute, moment_, r->index, it->second.output, r->op.name(),
                             s.bytes(), r->flops, true});
      ++log_.recomputes;
      return;
    }
    // Inputs first (recursively), each held from its turn until the compute has run, so none is
    // discarded while it reads them (and, as in pin_saved, one still waiting may make room). The
    // dearest to recompute go first, while this frame holds nothing yet: a discarded residual
    // stream then does not recurse under the held inputs of every block above it.
    std::vector<std::pair<double, std::size_t>> order;
    CostMemo memo;
    for (std::size_t i = 0; i < r->how.reads.size(); ++i) {
      const Storage& in = *r->how.reads[i];
      auto e = in.resident() ? entries_.end() : entries_.find(in.serial());
      order.push_back({e == entries_.end() ? 0.0 : cost(*e->second.recipe, memo), i});
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::shared_ptr<Storage>> inputs;
    for (const auto& [c, i] : order) {
      inputs.push_back(r->how.reads[i]);
      if (!inputs.back()->resident()) rebuild(*inputs.back());
    }
    // Held: the outputs this recomputation brings back (a resident sibling stays discardable).
    std::vector<std::shared_ptr<Storage>> outputs;
    for (const auto& w : r->outputs) {
      auto o = w.lock();
      outputs.push_back(o && !o->resident() ? o : nullptr);
    }
    std::vector<TensorRef> fresh;
    {
      OpOutputHook::Suspended no_scope;
      QuietObservers quiet;
      TimelineSpan span(r->op.name(), "rebuild");
      const auto start = std::chrono::steady_clock::now();
      fresh = r->how.compute();
      step_weight_ += r->weight;
      if (disk_)  // recomputing's measured speed, against which the disk's is weighed
        disk_->recomputed(r->weight, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const std::uint64_t now = ++clock_;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      Storage* o = outputs[i].get();
      if (!o) continue;
      if (o->saved_refs() > 0) make_room(o->bytes(), o);
      o->adopt(*fresh[i].storage);
      drop_file(o->serial());  // a sibling written out comes back with this recomputation
      if (auto h = hashes_.find(o->serial()); h != hashes_.end()) {
        const bool same = checksum64(o->raw_data(), o->bytes()) == h->second;
        hashes_.erase(h);
        if (!same)
          throw CheckpointError(fmt::format("MemoryBudget: recomputing output {} of '{}' gave different values than "
                                            "its first computation; the op depends on state that changed since",
                                            i, r->op.name()));
      }
      if (auto e = entries_.find(o->serial()); e != entries_.end()) {
        touch(*e, now);
        if (o->saved_refs() > 0 && !e->second.indexed) index(*e);
      }
      recost_readers(*o);
      log_.events.push_back({BudgetEvent::Kind::recompute, moment_, r->index, i, r->op.name(), o->bytes(), r->flops});
      ++log_.recomputes;
      log_.recomputed_flops += r->flops;
    }
    // What this recomputation brought back or read may be held only by recipes afterwards. Those
    // are counted as saved then, not let go: a budget tight enough to rebuild is likely to need
    // them again (each rebuild of the residual stream would otherwise redo its ancestry), and the
    // search may still discard them.
    auto settle_later = [&](const std::shared_ptr<Storage>& s) {
      if (!s || !reads_.count(s->serial())) return;
      pending_.insert(s->serial());
      keep_.insert(s->serial());
    };
    for (const auto& s : inputs) settle_later(s);
    for (const auto& s : outputs) settle_later(s);
  }

  /// Lets go of recipes no backward can need: none of their outputs is saved by anything but
  /// recipes, nor read by a recipe still needed. Newest first, since an op's inputs are older.
  void prune() {
    // Outputs gone since they were registered (nothing tells the budget when a storage dies).
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.recipe->outputs[it->second.output].expired()) {
        unindex(*it);
        drop_file(it->first);
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    std::vector<std::shared_ptr<Recipe>> all = recipes();
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a->order > b->order; });
    std::unordered_map<const Storage*, bool> needed_input;
    std::vector<std::shared_ptr<Recipe>> drop;
    for (const auto& r : all) {
      bool needed = false;
      for (const auto& w : r->outputs) {
        auto s = w.lock();
        if (!s) continue;
        if (records_holding(*s) > 0 || needed_input.count(s.get())) needed = true;
      }
      if (needed) {
        for (const auto& in : r->how.reads) needed_input[in.get()] = true;
      } else {
        drop.push_back(r);
      }
    }
    for (const auto& r : drop)
      for (const auto& w : r->outputs)
        if (auto s = w.lock()) {
          auto it = entries_.find(s->serial());
          if (it == entries_.end() || it->second.recipe != r) continue;
          unindex(*it);
          entries_.erase(it);
          drop_file(s->serial());
        }
    drop.clear();
    all.clear();  // what only the dropped recipes held goes now
    for (auto it = counted_.begin(); it != counted_.end();) {
      if (budget_refs(*it->second) > 0) {
        ++it;
        continue;
      }
      std::shared_ptr<Storage> s = std::move(it->second);  // no recomputation reads it any more
      it = counted_.erase(it);
      s->release_saved();
      if (s->saved_refs() == 0) unsaved(*s);
    }
    for (auto it = reads_.begin(); it != reads_.end();) {
      if (it->second.storage.expired()) {
        pending_.erase(it->first);
        keep_.erase(it->first);
        it = reads_.erase(it);
        continue;
      }
      auto& readers = it->second.readers;
      readers.erase(std::remove_if(readers.begin(), readers.end(), [](const std::weak_ptr<Recipe>& w) { return w.expired(); }),
                    readers.end());
      ++it;
    }
  }

  void begin_step() {
    log_ = BudgetLog{};
    log_.budget = budget_;
    by_index_.clear();
    moment_ = 0;
    next_planned_ = 0;
    over_ = false;
    least_ = 0;
    limit_ = budget_;
    hashes_.clear();
    books_->reset_peak();
  }

  void finish_step() {
    log_.peak_saved_bytes = books_->peak_saved_bytes();
    last_log_ = std::move(log_);
    last_log_.least_feasible = over_ ? least_ : 0;
    last_first_over_ = first_over_;
    if (given_plan_) uses_.end_step(false);  // the user's plan is replayed, never searched
    else plan_next_step();
    ops_.clear();
    diverged_ = false;
    step_weight_ = 0;
    begin_step();
    log_.reused_plan = reusing();
    log_.looked_ahead = uses_.ahead() && !reusing();
  }

  /// A step that fitted its budget plans the next, if the next repeats it (a plan the user gave
  /// stays theirs; a step that did not fit leaves the retry to the user). A step that searched
  /// (the first, or one whose ops changed) is searched again, knowing when it read each output
  /// (budget_uses.hpp); from then on the cheaper of the two, by what their recomputations weighed,
  /// is replayed. With a disk (BudgetOffload), whose reads the weights do not count, and when the
  /// search discarded nothing, the first is replayed at once.
  void plan_next_step() {
    const bool fit = last_log_.least_feasible == 0 && last_log_.plan_misses == 0;
    if (!fit) {
      phase_ = Phase::search;
      plan_.reset();
      first_.reset();
      uses_.end_step(false);
      rerank();
      return;
    }
    DiscardPlan made = DiscardPlan::from(last_log_);
    if (phase_ == Phase::search || diverged_) {
      if (made.discards.empty() || disk_) {
        phase_ = Phase::replay;
        plan_ = std::move(made);
      } else {
        phase_ = Phase::refine;
        first_ = std::move(made);
        first_weight_ = step_weight_;
        plan_.reset();
      }
    } else if (phase_ == Phase::refine) {
      phase_ = Phase::replay;
      plan_ = step_weight_ < first_weight_ ? std::move(made) : std::move(*first_);
      first_.reset();
    } else {
      plan_ = std::move(made);  // replayed, with what a search added if the plan fell short
    }
    uses_.end_step(true);
    rerank();
    last_ops_ = std::move(ops_);
  }

  /// plan_ is the last step's, replayed while this step's ops repeat it.
  bool reusing() const { return phase_ == Phase::replay && !diverged_; }

  std::size_t budget_;
  std::size_t least_ = 0;  // after an overflow: the most a moment of the step has needed
  std::size_t limit_;      // the budget, raised to least_ after an overflow
  std::thread::id owner_;
  std::optional<DiscardPlan> plan_;
  bool given_plan_ = false;  // plan_ is the user's (MemoryBudget(plan)), not the last step's
  // Searched by staleness; searched again looking ahead; replaying the cheaper (plan_next_step).
  enum class Phase { search, refine, replay };
  Phase phase_ = Phase::search;
  std::optional<DiscardPlan> first_;  // while refining: the searched step's plan, and its weight
  double first_weight_ = 0;
  double step_weight_ = 0;  // what this step's recomputations weighed (Recipe::weight)
  bool diverged_ = false;   // this step's ops stopped repeating the last step's
  std::vector<std::uint64_t> ops_, last_ops_;  // this step's and the last one's op sequence
  std::size_t next_planned_ = 0;
  std::unordered_map<std::uint64_t, std::uint64_t> hashes_;  // under checkpoint checking
  // Of the storages recipes read (reads_): those sweep() has yet to settle, and those it counted as
  // saved because nothing but recipes held them and they could not be let go.
  std::unordered_set<std::uint64_t> pending_, keep_;  // keep_: rebuilt, so counted not released
  std::unordered_map<std::uint64_t, std::shared_ptr<Storage>> counted_;
  bool sweeping_ = false;
  std::uint64_t next_order_ = 0;
  std::size_t moment_ = 0;
  bool closing_ = false;
  bool over_ = false;
  std::string first_over_, last_first_over_;
  BudgetLog log_, last_log_;
  std::shared_ptr<ThreadSavedBooks> books_ = thread_saved_books();
  std::optional<BudgetDisk> disk_;  // with a BudgetOffload
};

inline BudgetHold::BudgetHold(TensorRef r, std::shared_ptr<BudgetCore> c) : ref(std::move(r)), core(std::move(c)) {
  core->retain_saved(*ref.storage);
}
inline BudgetHold::~BudgetHold() { core->release_saved(std::move(ref.storage)); }

/// The budget's ears: every op of its thread, before and after, and the end of each backward.
class BudgetObserver final : public Observer {
 public:
  explicit BudgetObserver(std::shared_ptr<BudgetCore> core) : core_(std::move(core)) {}
  void op_begin(const OpOutput&) override { core_->op_begin(); }
  void op(const OpOutput& out, const OpValues& values) override { core_->op(out, values); }
  void backward_end(bool completed, bool outermost) override {
    if (outermost) core_->backward_ended(completed);
  }

 private:
  std::shared_ptr<BudgetCore> core_;
};

}  // namespace detail

/// RAII: while it lives, the activation bytes saved for backward on this thread's graphs stay at or
/// under the budget (this thread's books: what the graphs built on this thread save, parameters
/// apart; the process's memory_stats().saved_activation_bytes adds every thread's). One per thread
/// at a time. Run both forward and backward inside it: when it ends, outputs still discarded and
/// still needed by a graph kept for another backward are recomputed, without a budget.
class MemoryBudget final {
 public:
  /// A limit of `bytes` on the activation bytes saved for backward on this thread; one budget per
  /// thread at a time.
  explicit MemoryBudget(std::size_t bytes)
      : core_(std::make_shared<detail::BudgetCore>(bytes, std::this_thread::get_id())),
        slot_((check_alone(), this)),
        observer_(core_),
        store_(store_of(core_)) {}
  /// A limit of `bytes` that may also write outputs to files under `offload.directory` instead of
  /// discarding them, where the disk is quicker than recomputing (BudgetOffload). Its writes are
  /// synchronous; the choice counts them.
  MemoryBudget(std::size_t bytes, BudgetOffload offload)
      : core_((check_alone(),  // before its directory is made
               std::make_shared<detail::BudgetCore>(bytes, std::this_thread::get_id(), std::move(offload)))),
        slot_(this),
        observer_(core_),
        store_(store_of(core_)) {}
  /// A budget that replays `plan` (from an earlier step's log) instead of searching.
  explicit MemoryBudget(DiscardPlan plan) : MemoryBudget(plan.budget) { core_->use_plan(std::move(plan)); }

  ~MemoryBudget() { core_->close(); }
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  /// The byte limit it was constructed with.
  std::size_t budget() const { return core_->budget(); }
  /// The log of the step in progress (since the budget began or the last backward ended).
  const BudgetLog& log() const { return core_->log(); }
  /// The log of the last step that ended with a backward.
  const BudgetLog& last_log() const { return core_->last_log(); }
  /// The decisions the next step replays if it repeats the last one — from the third step of a
  /// budget living across steps, the cheaper of its first two steps' searches — else the last
  /// completed step's decisions, as a static plan.
  DiscardPlan plan() const { return core_->plan(); }
  /// After an infeasible step: the smallest budget that worked for it (measured); else 0.
  std::size_t least_feasible_bytes() const { return core_->least_feasible_bytes(); }

 private:
  static void check_alone() {
    REMAT_CHECK(detail::session().memory_budget == nullptr,
                "MemoryBudget: another budget is active on this thread; budgets do not nest");
  }
  static SavedTensorHooks::Pair store_of(const std::shared_ptr<detail::BudgetCore>& core) {
    using Hold = std::shared_ptr<detail::BudgetHold>;
    SavedTensorHooks::Pair pair;
    pair.pack = [core](const AnyTensor& t, const SaveContext&) { return detail::BudgetCore::pack(core, t); };
    pair.unpack = [](const std::any& p) { const Hold& h = std::any_cast<const Hold&>(p); return h->core->unpack(*h); };
    pair.pin = [](const std::any& p) { const Hold& h = std::any_cast<const Hold&>(p); return h->core->pin(*h); };
    pair.state = [](const std::any& p) { const Hold& h = std::any_cast<const Hold&>(p); return h->core->state(*h); };
    return pair;
  }

  std::shared_ptr<detail::BudgetCore> core_;
  detail::Install<&detail::Session::memory_budget> slot_;
  detail::BudgetObserver observer_;
  SavedTensorHooks store_;
};

}  // namespace remat
