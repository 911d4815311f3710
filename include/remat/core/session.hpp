#pragma once
// The session: everything remat keeps per thread, in one struct, so a reader sees the whole of
// the state an op, a backward or a replay can depend on, and one guard (Install) switches any of
// it for a scope. Two threads training independent models never share a slot of it.
//
// The session sits at the bottom of core and names the types it holds without including them:
// each room that owns a slot's meaning (autograd, random, observers, the checkpoint modes) reads
// and writes its slot here and nowhere else.
//
// What is process-wide, and why (everything else is in the session):
//   - the allocator's ledger, MemoryLedger::instance() (core/memory.hpp): bytes are one pool,
//     whichever thread allocates them; memory_stats() is the process's;
//   - the storage serial counter, next_storage_serial() (core/memory.hpp): serials order storages
//     across threads (a budget's "existed before this op" test);
//   - the op registry, detail::op_registry() (core/op_output.hpp): op names are program constants,
//     registered once at static initialisation;
//   - the active timeline, detail::active_timeline() (core/timeline.hpp): one trace records every
//     thread, each on its own track.
//   - the file-name serials of disk snapshots (checkpoint/snapshot.hpp), of safetensors'
//     temporary files (io/safetensors.hpp) and of Offload scopes' directories (io/offload.hpp):
//     names unique within the process, whichever thread writes;
//   - the process's MPI rank, for messages (dist/context.hpp): one process, one rank.
//
// A value in an object rather than in the session (a generator's state during a replay, a
// DataParallel's sync flag under no_sync) is switched by ScopedValue (core/scoped.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace remat {

class Tape;
class Generator;
class MemoryBudget;
class Observer;

namespace detail {

class AutocastCache;
class GradCapture;
class RunScope;
class RecordDraws;
class ThreadSavedBooks;
struct SavedTensorHooksPair;
class DualLevelState;

/// The chain step running on this thread and the step its schedule runs after it
/// (checkpoint/chain.hpp sets it around each step and each reversal): what a wrapper around the
/// steps (dist::FullyShardedDataParallel) prepares ahead, read from the plan rather than guessed.
struct ChainPosition {
  const void* chain = nullptr;  ///< the run (null: no chain step is running)
  std::int64_t step = -1;       ///< the step running or being reversed
  std::int64_t next = -1;       ///< the step whose parameters the schedule needs next (-1: none)
};

/// Replays skipped by early stop on this thread, for tests and benchmarks.
struct EarlyStopStats {
  std::size_t ops = 0;
  double flops = 0;
};

/// One thread's state. Read it through session(); switch a slot for a scope with Install.
struct Session {
  // Grad mode and the graph.
  bool grad_enabled = true;   ///< no_grad / enable_grad
  bool recording = true;      ///< false inside a checkpointed forward: requires_grad flows, no nodes
  int replay_depth = 0;       ///< > 0 while a checkpoint or a chain replays a forward (is_replaying)
  int backward_depth = 0;     ///< > 0 inside Tensor::backward (nested: a planner's dry run)
  std::uint64_t next_node_id = 1;
  std::vector<Tape*> tapes;   ///< the current tapes, innermost last; [0] is root_tape (tape_stack())
  /// A dry run (measure_steps), when not 0: the first node id it records. Gradients reaching
  /// leaves, or tensors made before it (their nodes' ids are lower), are dropped.
  std::uint64_t dry_run_first_node = 0;
  GradCapture* grad_capture = nullptr;  ///< remat::grad() walking: leaves' .grad put back after
  bool create_graph = false;        ///< a backward walk that records its own ops (create_graph)
  bool autocast = false;            ///< remat::autocast: float32 matrix products on the bfloat16 GEMM
  std::shared_ptr<AutocastCache> autocast_cache;  ///< the outermost autocast scope's parameter casts
  DualLevelState* dual_level = nullptr;  ///< the open dual level (forward mode), its tangents to clear
  int tangents_off = 0;                  ///< > 0 while a tangent rule computes (its ops carry none)
  bool tangent_walk = false;  ///< a backward carrying tangents (forward-over-reverse): formulas in ops, unrecorded
  /// What backwards that ran held for the rest of the walk (a checkpoint's function, a chain's
  /// steps): a tensor computed before them and captured by them gets its gradient from their
  /// backward and must live until the walk reaches its producer. Dropped when the outermost walk ends.
  std::vector<std::shared_ptr<const void>> walk_keepalive;

  // Randomness.
  std::shared_ptr<Generator> default_generator;  ///< made at first use (default_generator())
  RecordDraws* draw_recorder = nullptr;           ///< the innermost; each draw walks outward

  // Listeners (core/observer.hpp, core/op_output.hpp, core/saved_tensor_hooks.hpp).
  std::vector<Observer*> observers;  ///< outermost first
  int observers_quiet = 0;           ///< > 0 while an op computes from other ops
  RunScope* run_scope = nullptr;     ///< the innermost run scope (its decider, its listeners); each knows its enclosing one
  std::vector<std::shared_ptr<const SavedTensorHooksPair>> saved_tensor_hooks;  ///< innermost last
  int saved_tensor_hooks_off = 0;    ///< > 0 inside a pack or an unpack
  MemoryBudget* memory_budget = nullptr;  ///< the budget in force (one a thread: it is a store and an observer)

  // Modes of replayed computations (checkpoint/replay.hpp, checkpoint/early_stop.hpp).
  bool check_replay_values = false;  ///< CheckpointChecking
  bool debug_replay = false;         ///< CheckpointDebug
  bool early_stop = true;            ///< CheckpointEarlyStop
  ChainPosition chain_position;      ///< the chain step running, and the one after it
  EarlyStopStats early_stop_stats;

  // Memory.
  std::shared_ptr<ThreadSavedBooks> saved_books;  ///< bytes this thread's graphs save; made at first use

  // Last, so destroyed first at thread exit: its nodes free what they saved into the books above.
  std::shared_ptr<Tape> root_tape;
};

/// This thread's session.
inline Session& session() {
  thread_local Session s;
  return s;
}

template <class M>
struct SessionMember;
template <class V>
struct SessionMember<V Session::*> {
  using type = V;
};
/// A slot's kind: a value (kept: its previous value) or a stack (kept: the entry pushed).
template <class V>
struct SlotKind {
  static constexpr bool stack = false;
  using Kept = V;
};
template <class V, class A>
struct SlotKind<std::vector<V, A>> {
  static constexpr bool stack = true;
  using Kept = V;
};

/// RAII: installs a value into one slot of this thread's session for its lifetime. For a value
/// slot it sets the value and puts the previous one back; for a stack slot (observers, saved-tensor
/// hooks, tapes) it pushes an entry and removes that entry again, the newest copy of it, so a
/// scope that ends out of order still leaves no dangling entry. It ends in the session it began in,
/// on whichever thread it is destroyed (a scope object handed over in a holder), so the thread that
/// installed it is not left pointing at it.
///
///   detail::Install<&detail::Session::grad_enabled> no_grad(false);
template <auto Member>
class Install {
  using Slot = typename SessionMember<decltype(Member)>::type;
  static constexpr bool kStack = SlotKind<Slot>::stack;
  using Kept = typename SlotKind<Slot>::Kept;

 public:
  /// Sets the slot to `value` (a value slot) or pushes `value` (a stack slot).
  template <class U>
  explicit Install(U&& value) : owner_(&session()) {
    Slot& slot = owner_->*Member;
    if constexpr (kStack) {
      kept_ = std::forward<U>(value);
      slot.push_back(kept_);
    } else {
      kept_ = std::exchange(slot, std::forward<U>(value));
    }
  }
  ~Install() {
    Slot& slot = owner_->*Member;
    if constexpr (kStack) {
      for (auto it = slot.end(); it != slot.begin();)
        if (*--it == kept_) {
          slot.erase(it);
          break;
        }
    } else {
      slot = std::move(kept_);
    }
  }
  Install(const Install&) = delete;
  Install& operator=(const Install&) = delete;

  /// A value slot's value before this guard (a run scope's enclosing one); a stack slot's entry.
  const Kept& kept() const { return kept_; }

 private:
  Session* owner_;
  Kept kept_{};
};

}  // namespace detail
}  // namespace remat
