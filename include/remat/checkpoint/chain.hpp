#pragma once
// checkpoint_sequential(steps, x, policy): runs a chain x_{i+1} = f_i(x_i) under a schedule and
// puts one node on the tape. The forward pass runs the schedule up to recording the last step;
// the node's backward runs the rest. Every execution of step i sees the generator state step i saw
// in the forward pass, and replays run with is_replaying() set, as checkpoint() does.
//
// Forward mode: inside a dual level the states carry their tangents from step to step (jvp through
// a chain), and each snapshot keeps its state's tangent beside it in the same tier, so a replay in
// backward carries them again: a backward carrying tangents (hvp, forward-over-reverse) runs under
// every schedule at the schedule's memory, each kept state and each recorded step twice over.

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_set>
#include <vector>

#include "remat/checkpoint/compact_records.hpp"
#include "remat/checkpoint/early_stop.hpp"
#include "remat/checkpoint/error.hpp"
#include "remat/checkpoint/replay.hpp"
#include "remat/checkpoint/run_parts.hpp"
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/checkpoint/snapshot.hpp"
#include "remat/checkpoint/step_log.hpp"
#include "remat/checkpoint/trace.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/produce.hpp"
#include "remat/core/random.hpp"
#include "remat/schedule/budget.hpp"
#include "remat/schedule/schedule.hpp"

namespace remat {

/// One step of a chain: x_{i+1} = f_i(x_i).
using ChainStep = std::function<Tensor(const Tensor&)>;

/// What an executor did, to compare with its plan.
struct ChainCounts {
  /// Steps run without recording.
  std::int64_t advances = 0;
  /// Steps run recorded on their own tape.
  std::int64_t records = 0;
  /// The most snapshots kept at once.
  std::int64_t peak_snapshots = 0;
  /// Snapshots written to disk (the slower tier).
  std::int64_t disk_writes = 0;
  std::int64_t rebuilt = 0;  ///< steps recorded in forward, held compactly, rebuilt when reversed
};

namespace detail {

/// Sums the work the ops of its scope report. An observer: a segment nested in the step still counts.
class FlopCounter final : public Observer {
 public:
  void op(const OpOutput& out, const OpValues&) override { total += out.flops; }
  double total = 0;
};

/// Records f(leaf) on the current tape for measure_steps, noting in c its flops, whether the
/// executor could hold it compactly, and which tensors from outside it saves; returns its output
/// and the bytes of its own op outputs that a compact record would hold.
inline std::pair<Tensor, std::size_t> measure_record(const ChainStep& f, const Tensor& leaf, StepCost& c) {
  SegmentReads reads;
  Tensor y;
  std::size_t held = 0;
  {
    FlopCounter counter;
    RunParts parts;  // as the executor installs them
    parts.reads(reads);
    const CompactRecorder& recorder = parts.recorder(leaf.storage().get());
    y = f(leaf);
    c.compute = counter.total;
    const CompactRecorder::Notes notes = recorder.notes();
    c.compact = notes.complete;
    std::unordered_set<const Storage*> seen{leaf.storage().get()};
    for (const CompactRecorder::Output& o : notes.held)
      if (seen.insert(o.ref.storage.get()).second) held += o.ref.storage->bytes();
  }
  std::unordered_set<std::uint64_t> outside;
  for (const SegmentReads::Outside& o : reads.outside)
    if (const auto st = o.storage.lock(); st && st != leaf.storage() && st->saved_refs() > 0 && outside.insert(st->serial()).second)
      c.params = fnv1a_mix(c.params == 0 ? kFnvOffset : c.params, st->serial());
  return {y, held};
}

}  // namespace detail

/// Measures each step once, for policies that need costs (budget), and for plans that predict
/// the bytes the executor will hold. Deterministic, so the same program plans the same way on
/// every run:
///   compute          the work its ops report (flops), not wall-clock time;
///   state_bytes      the bytes of its input (what a snapshot of it holds);
///   activation_bytes the most bytes saved for backward at any moment of recording the step and
///                    running its backward — more than the tape holds at the end of its forward
///                    when the step contains a checkpoint(), whose replay is part of reversing it
///                    (reverse_bytes is that difference);
///   and which of them the executor shares with others or drops while the step is held compactly:
///   its input, its output, the tensors from outside the chain (parameters, by identity).
/// The dry-run backward gives no parameter a gradient, and the generator is put back.
template <class Steps = std::vector<ChainStep>>
std::vector<StepCost> measure_steps(const Steps& steps, const Tensor& x) {
  std::vector<StepCost> costs;
  const Generator::State rng = default_generator().state();
  detail::DrawnGenerators others;  // put back too: measuring must not move the user's generators
  detail::RecordDraws draws(others);
  // The executor holds steps recorded in forward compactly under the same modes (ChainRun).
  const bool compact = detail::ReplayModes::compose().early_stop;
  // Measured without tangents: a plan is the same whether or not the chain carries them.
  detail::Install<&detail::Session::tangents_off> primal_only(detail::session().tangents_off + 1);
  Tensor h = x.detach();
  for (std::size_t i = 0; i < steps.size(); ++i) {
    Tape scratch;
    TapeGuard use(scratch);
    const std::size_t before = memory_stats().saved_bytes;
    MemoryScope scope;
    Tensor leaf = h.detach();
    leaf.requires_grad_();
    const int input_refs = leaf.storage()->saved_refs();
    const std::uint64_t first_node = detail::session().next_node_id;
    StepCost c{0.0, h.nbytes(), 0};
    auto [y, held] = detail::measure_record(steps[i], leaf, c);
    const std::size_t recorded = memory_stats().saved_bytes - before;
    c.reads_input = leaf.storage()->saved_refs() > input_refs;
    c.saves_output = y.defined() && y.storage() != leaf.storage() && y.storage()->saved_refs() > 0;
    if (y.requires_grad()) {
      detail::Install<&detail::Session::dry_run_first_node> dry_run(first_node);
      y.backward(ones(y.shape()));
    }
    c.activation_bytes = scope.peak_saved_bytes() - before;
    c.reverse_bytes = c.activation_bytes - recorded;
    // What is neither the step's own (the ops' outputs it holds compactly) nor its input is from
    // outside the step; a step that saves something it made other than by an op is held whole.
    const std::size_t inside = held + (c.reads_input ? c.state_bytes : 0);
    c.param_bytes = recorded > inside ? recorded - inside : 0;
    if (!c.compact) c.params = 0;  // what is left may be the step's own, shared with no other
    c.compact = compact && c.compact;
    costs.push_back(c);
    h = y.detach();
  }
  default_generator().set_state(rng);
  others.rewind();
  return costs;
}

namespace detail {

/// A chain's step functions by index: runs of steps that call one function (an RNN cell, an
/// integrator's step) are held once, so a million steps of one cell cost one std::function.
class ChainSteps : public Runs<ChainStep> {
 public:
  ChainSteps() = default;
  explicit ChainSteps(const std::vector<ChainStep>& steps) {
    for (const ChainStep& f : steps) start(f);
  }
  ChainSteps(const ChainStep& cell, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) i == 0 ? start(cell) : extend();
  }
};

struct ChainRun {
  /// A run named `name` starting from x, with the thread's checking, early-stop and debug modes.
  ChainRun(std::string run_name, const Tensor& x, ReplayModes modes = ReplayModes::compose())
      : name(std::move(run_name)), check_values(modes.check_values), early_stop(modes.early_stop),
        debug(modes.debug), compact(early_stop && !tangents_active()), current(detach_keeping_tangent(x)),
        input_shape(x.shape()), input_storage(x.storage()), input_version(x.storage()->version()) {
    if (x.requires_grad()) input_meta = x.meta();
  }

  ChainSteps steps;
  Plan plan;
  std::string name;           // "chain[policy]", in errors
  // The modes the run was made under (ReplayModes at construction), fixed for its life.
  bool check_values = false;  // compare replayed values too (CheckpointChecking), not just shapes
  bool early_stop = true;     // stop replays of steps whose output feeds only their own reversal
  bool debug = false;         // CheckpointDebug: each step's op trace, first execution
  // Hold steps recorded in forward by what their backward reads; not inside a dual level, where
  // what a step's backward reads carries tangents, which a compact record does not hold.
  bool compact = true;

  /// What each step's first execution noted, by step: valid for the steps run so far, and what
  /// every later execution (a replay) is set up from and checked against.
  struct FirstRuns {
    StateRuns rng;                                     // the default generator's state
    EqualRuns<bool> autocast;                          // whether remat::autocast was on (replays too)
    std::shared_ptr<AutocastCache> autocast_cache;     // the parameter casts of the chain's autocast scope
    std::map<std::size_t, DrawnGenerators> other_rng;  // the steps that drew from other generators too
    EqualRuns<Shape> out_shapes;                       // the output's shape
    std::vector<std::uint64_t> out_hashes;             // and its values' hash, when check_values
    EqualRuns<std::ptrdiff_t> last_needed;             // the last op output its backward reads (early stop)
    EqualRuns<std::uint64_t> op_hashes;                // its op sequence, hashed: a compact rebuild is checked
    std::vector<std::vector<TracedOp>> traces;         // its op trace, under debug
    SegmentReads outside_reads;                        // what the steps read from outside the chain
    std::unordered_set<std::uint64_t> outside_seen;
  } first;

  /// Where the forward is: the step next to run and its input.
  std::int64_t position = 0;
  Tensor current;
  Shape input_shape;
  // The chain input's autograd identity (null when it needs no gradient): step 0 is recorded on
  // it, so its gradient arrives in the order, and so to the bits, it would without the chain.
  std::shared_ptr<AutogradMeta<float>> input_meta;
  // The chain input's values, while something else keeps them (create_graph's replay starts there
  // when the run holds no copy).
  std::weak_ptr<Storage> input_storage;
  std::uint64_t input_version = 0;

  /// What the run holds between actions: snapshots, recorded steps (their graphs) and the steps
  /// held compactly (compact_records.hpp), rebuilt as they are reversed.
  struct Kept {
    std::unique_ptr<Snapshot> value;
    std::unique_ptr<Snapshot> tangent;  // the state's tangent, in the same tier (forward mode)
  };
  struct Recorded {
    std::unique_ptr<RecordedRun> run;
    Tensor input, output;
    bool in_forward = false;  // recorded during forward (kept across backward calls under retain_graph)
  };
  struct Held {
    std::map<std::int64_t, Kept> kept;
    std::map<std::int64_t, Recorded> recorded;
    CompactRecords compact_records;
    std::set<std::int64_t> forward_snapshots;  // the snapshots taken during forward
  } held;

  /// The backward in progress.
  Tensor grad;  // gradient of x_{next reversed + 1}; undefined when none arrived
  // Under retain_graph the backward leaves the end-of-forward state as it found it: the snapshots
  // taken and the steps recorded during forward are neither freed nor consumed, so the next
  // backward runs the same actions again.
  bool retaining = false;

  ChainCounts counts;
  std::shared_ptr<ChainCounts> report;  // where the caller reads the counts

  /// Step i on x: its first execution (in forward) notes the generator state and what it
  /// produced; every later execution is a replay from that state, checked against the first.
  /// `output_unused`: only the step's own reversal follows, which reads what its ops saved and
  /// not the output's values, so the replay may stop early.
  /// `notes`, at the first execution: receives what the step's backward reads (a compact record).
  /// `rebuild`, at a replay: rebuilds a compactly held step's graph from what it holds.
  Tensor run_step(std::int64_t i, const Tensor& x, bool output_unused = false, CompactRecorder::Notes* notes = nullptr,
                  const CompactRecords::Step* rebuild = nullptr) {
    const auto k = static_cast<std::size_t>(i);
    if (k == first.rng.size()) {
      first.rng.push_back(default_generator().state());
      first.autocast.push_back(session().autocast);
      if (!first.autocast_cache) first.autocast_cache = session().autocast_cache;
      SegmentReads reads;
      Tensor y;
      {
        DrawnGenerators others;
        RecordDraws draws(others);
        // What the step's ops save depends on which inputs need a gradient: observe it as its
        // recorded replays will run it, with the input needing one (step 0: if the chain's does).
        Tensor in = x;
        if (!in.requires_grad() && is_grad_enabled() && (i > 0 || input_meta)) {
          in = detach_keeping_tangent(x);
          in.requires_grad_();
        }
        RunParts parts;
        parts.reads(reads);
        const CompactRecorder* recorder = notes ? &parts.recorder(x.storage().get()) : nullptr;
        if (debug) parts.trace(first.traces.emplace_back());
        y = steps[k](in);
        if (recorder) *notes = recorder->notes();
        if (!others.empty()) first.other_rng.emplace(k, std::move(others));
      }
      first.last_needed.push_back(reads.last_needed);
      first.op_hashes.push_back(reads.ops);
      // The step's input is the chain's own state, not a tensor from outside it.
      for (SegmentReads::Outside& o : reads.outside)
        if (const auto s = o.storage.lock(); s && s != x.storage() && first.outside_seen.insert(s->serial()).second)
          first.outside_reads.outside.push_back(std::move(o));
      first.out_shapes.push_back(y.shape());
      if (check_values) first.out_hashes.push_back(fingerprint(y));
      return y;
    }
    std::vector<TracedOp> replay_trace;
    // Under debug, a mismatch also says where the step's replay first departed from its forward.
    auto mismatch = [&](std::string what) {
      if (debug) what += "\n  " + trace_difference(first.traces[k], replay_trace);
      return CheckpointError(what);
    };
    Tensor y;
    TimelineSpan span("replay", [&] { return fmt::format("{} step {}", rebuild ? "rebuild" : "replay", i); });
    ReplayNotice notice({"chain", name.c_str(), i});
    try {
      const auto others = first.other_rng.find(k);
      y = as_replay(first.rng[k], others == first.other_rng.end() ? nullptr : &others->second,
                    AutocastState{first.autocast[k], first.autocast_cache}, [&] {
        RunParts parts;
        const CompactRebuild* rebuilder =
            rebuild ? &parts.rebuild(*rebuild, first.op_hashes[k], fmt::format("{}: step {} of {}", name, i, steps.size()))
                    : nullptr;
        if (output_unused && early_stop && !rebuild) parts.stop_after(first.last_needed[k]);
        if (debug) parts.trace(replay_trace);
        Tensor out = steps[k](x);
        if (rebuilder) rebuilder->finish();
        return out;
      });
    } catch (const CheckpointError& e) {
      throw mismatch(e.what());
    }
    FirstRunOutput expected{true, first.out_shapes[k], dtype_name<float>(), std::nullopt};
    if (check_values) expected.hash = first.out_hashes[k];
    if (std::string d = replay_difference(fmt::format("{}: step {} of {}", name, i, steps.size()), y, expected); !d.empty())
      throw mismatch(d);
    return y;
  }

  /// The chain's output x_L as one node on the tape, taking x as its input, whose backward runs
  /// the rest of the plan; x_L plainly when no recorded step needs a gradient.
  static Tensor finish(const std::shared_ptr<ChainRun>& run, const Tensor& x, std::string node_name) {
    Tensor out = run->current;
    bool any_grad = false;
    for (auto& [i, r] : run->held.recorded) any_grad = any_grad || r.output.requires_grad();
    any_grad = any_grad || run->held.compact_records.any_requires_grad();
    if (!any_grad || !is_grad_enabled()) return out;
    // The snapshots kept in forward are held by the run, and the run by the output's autograd
    // identity: they go (files on disk too) the moment nothing can send the output a gradient —
    // the output dropped and no node holding it — not when the tape next prunes the node. The
    // node saves nothing of its own and sees the run while the output lives, which it does
    // whenever the node runs (its gradient waits there).
    record<float>(std::move(node_name), {x}, {&out}, {}, [weak = std::weak_ptr<ChainRun>(run)](BackwardContext<float>& ctx) {
      const std::shared_ptr<ChainRun> run = weak.lock();
      REMAT_ASSERT(run != nullptr);
      // A backward carrying tangents (hvp) runs the plan as any other, its replays carrying the
      // snapshots' tangents. One recording its ops (create_graph) could not reach the chain's
      // input through the snapshots, which are cut from the graph: it replays the steps connected.
      const bool tangent_walk = session().tangent_walk;
      run->first.outside_reads.check_versions(run->name);
      if (ctx.create_graph() && !tangent_walk) return run->backward_recorded(ctx);
      run->grad = tangent_walk ? ctx.grad_output() : copy_of(ctx.grad_output());
      run->retaining = ctx.retain_graph();
      try {
        run->run_backward();
      } catch (...) {
        // A failed reversal cannot be resumed: drop what the run holds now — its files on disk
        // included — rather than when the tape next drops this node.
        run->held.kept.clear();
        run->held.recorded.clear();
        run->held.compact_records.clear();
        throw;
      }
      if (run->report) *run->report = run->counts;
      if (!run->retaining) {
        run->held.kept.clear();
        run->held.recorded.clear();
        run->held.compact_records.clear();
        // The steps may hold tensors computed before the chain (a lambda's captures) that their
        // reversal just sent gradients to: they live on until the walk has passed their producers.
        // The run's own state goes now.
        run->current = Tensor();
        run->grad = Tensor();
        session().walk_keepalive.push_back(run);
      }
    });
    out.meta()->keeps = run;
    // The snapshots of the states' tangents (jvp through the chain) go when the dual level ends:
    // a backward after it carries no tangents (a backward carrying them, hvp, runs inside it).
    if (DualLevelState* level = session().dual_level)
      level->at_end([weak = std::weak_ptr<ChainRun>(run)] {
        if (const std::shared_ptr<ChainRun> r = weak.lock())
          for (auto& [i, k] : r->held.kept) k.tangent.reset();
      });
    return out;
  }

  /// The backward of a walk that records its ops (create_graph): the steps replayed once onto the
  /// tape being walked, each on the last one's output, from x_0 carrying the chain input's identity
  /// (as checkpoint() replays a segment), then walked recording their backward. A second
  /// differentiation follows that graph to the parameters and the input. The schedule is not used:
  /// the walk keeps every step's graph, as an unchecked run would, and the snapshots stay for a
  /// later first-order walk (the graph is retained).
  void backward_recorded(BackwardContext<float>& ctx) {
    RecordedRun replay(current_tape());
    Tensor h = ctx.as_input(0, start_state());
    Tensor y = replay.record([&] {
      const auto L = static_cast<std::int64_t>(steps.size());
      for (std::int64_t i = 0; i < L; ++i) {
        const auto position_now = Install<&Session::chain_position>(ChainPosition{this, i, i + 1 < L ? i + 1 : -1});
        h = run_step(i, h);
      }
      return h;
    });
    replay.backward({&y}, {ctx.grad_output()});
  }

  /// x_0's values as the run holds them: its snapshot, what step 0's record holds of its input, or
  /// the chain's input itself while it lives unchanged.
  Tensor start_state() const {
    if (const auto it = held.kept.find(0); it != held.kept.end()) return it->second.value->load().detach();
    if (const auto it = held.recorded.find(0); it != held.recorded.end())
      return Tensor(it->second.input.storage(), input_shape);
    if (held.compact_records.has(0))
      if (const CompactRecords::Step step = held.compact_records.get(0); step.input) {
        const std::string who = fmt::format("{}: x_0 (shape {}), which step 0 reads,", name, input_shape);
        return Tensor(step.input->saved.ref(who.c_str()).storage, input_shape);
      }
    const std::shared_ptr<Storage> input = input_storage.lock();
    REMAT_CHECK(input != nullptr, "{}: create_graph replays the chain from its input x_0 (shape {}), which nothing "
                "holds any more (no snapshot of it, no step's backward reads it, and the tensor is gone); keep the "
                "chain's input alive until the second differentiation", name, input_shape);
    REMAT_CHECK(input->version() == input_version, "{}: create_graph replays the chain from its input x_0 (shape {}), "
                "which was modified in place after the chain read it", name, input_shape);
    return Tensor(input, input_shape);
  }

  /// Runs the forward part of the plan: its first forward_actions actions.
  void run_forward() { run_actions(0, plan.forward_actions, true); }

  /// Runs the rest of the plan, streamed afresh (so a retained graph can run it again).
  void run_backward() { run_actions(plan.forward_actions, kToTheEnd, false); }

  /// run_actions()'s `to` for "to the plan's end".
  static constexpr std::size_t kToTheEnd = static_cast<std::size_t>(-1);
  /// execute()'s `after` when the caller does not know the plan: the step after the action's last.
  static constexpr std::int64_t kNextInOrder = -2;

  /// Runs actions [from, to) of the plan. It reads ahead to the next action that needs a step's
  /// parameters, so each step knows which one the schedule runs after it (ChainPosition, for a
  /// wrapper that prefetches); in backward it also hands execute() the action right after (a
  /// record followed by its own reverse may stop its replay early).
  void run_actions(std::size_t from, std::size_t to, bool forward) {
    ActionReader stream(plan.stream());
    Action act{Action::Kind::free, 0};
    for (std::size_t a = 0; a < from; ++a) REMAT_ASSERT(stream.next(act));
    std::deque<Action> ahead;  // read, not yet run; ahead[0] runs next
    bool more = true;
    auto read_up_to = [&](std::size_t n) {
      while (more && ahead.size() < n) {
        if (stream.next(act)) ahead.push_back(act);
        else more = false;
      }
    };
    for (std::size_t a = from; a < to; ++a) {
      read_up_to(2);
      if (ahead.empty()) {
        REMAT_ASSERT(to == kToTheEnd);
        break;
      }
      std::int64_t after = -1;
      for (std::size_t k = 1;; ++k) {
        read_up_to(k + 1);
        if (k >= ahead.size()) break;
        if (const std::int64_t s = step_needed(ahead[k], ahead.front(), forward); s >= 0) {
          after = s;
          break;
        }
      }
      execute(ahead[0], !forward && ahead.size() > 1 ? &ahead[1] : nullptr, forward, after);
      ahead.pop_front();
    }
  }

  /// The step whose parameters `later` needs, when it comes after `now` with only bookkeeping
  /// between them; -1 when it needs none: a snapshot, a restore, a free, or in backward the
  /// reverse of the step `now` records (its parameters stay in use; a step recorded in forward
  /// meets its reverse only after the rest of the forward pass).
  static std::int64_t step_needed(const Action& later, const Action& now, bool forward) {
    using K = Action::Kind;
    switch (later.kind) {
      case K::advance:
      case K::record: return later.step;
      case K::reverse: return !forward && now.kind == K::record && now.step == later.step ? -1 : later.step;
      default: return -1;
    }
  }

  /// Runs one action; `next` is the action after it when known, `forward` while the forward
  /// pass runs the schedule's first part; `after` is the step the schedule needs after this
  /// action's (-1: none; kNextInOrder: the one after the action's last step).
  void execute(const Action& act, const Action* next, bool forward, std::int64_t after = kNextInOrder) {
    // Snapshots and recorded inputs are held here, outside any saved list: every op computes,
    // whatever an enclosing replay would skip. (No scope at all when none is installed: ops then
    // make their outputs by a plain call.)
    std::optional<ComputeAll> compute_all;
    if (RunScope::current()) compute_all.emplace();
    using K = Action::Kind;
    const std::int64_t i = act.step;
    static constexpr const char* kNames[] = {"advance", "snapshot", "restore", "free", "record", "reverse"};
    TimelineSpan span(kNames[static_cast<int>(act.kind)], "chain");
    if (after == kNextInOrder) after = act.step + act.count;
    if (after >= static_cast<std::int64_t>(steps.size())) after = -1;
    // The step running (or being reversed) and the one the schedule needs after it.
    auto at = [this](std::int64_t step, std::int64_t then) {
      return Install<&Session::chain_position>(ChainPosition{this, step, then});  // elided: no copy
    };
    switch (act.kind) {
      case K::advance: {
        auto not_recording = scoped_recording(false);
        for (std::int64_t j = i; j < i + act.count; ++j) {
          const auto position_now = at(j, j + 1 < i + act.count ? j + 1 : after);
          current = detach_keeping_tangent(run_step(j, current));
          ++position;
          ++counts.advances;
        }
        break;
      }
      case K::snapshot:
        if (forward) held.forward_snapshots.insert(i);
        if (act.disk) {
          REMAT_CHECK(!plan.disk_directory.empty(), "{}: the schedule keeps x_{} on disk, but its policy names no "
                      "directory", name, i);
          const Tensor t = tangent_of(current);
          held.kept[i] = {std::make_unique<DiskSnapshot>(current, plan.disk_directory, i),
                          t.defined() ? std::make_unique<DiskSnapshot>(t, plan.disk_directory, i) : nullptr};
          ++counts.disk_writes;
        } else {
          const Tensor t = tangent_of(current);
          held.kept[i] = {std::make_unique<MemorySnapshot>(current.detach()),
                          t.defined() ? std::make_unique<MemorySnapshot>(t) : nullptr};
        }
        counts.peak_snapshots = std::max<std::int64_t>(counts.peak_snapshots, static_cast<std::int64_t>(held.kept.size()));
        break;
      case K::restore: {
        const Kept& k = held.kept.at(i);
        current = k.value->load().detach();
        // Outside the dual level now (a backward after jvp), the replays carry none.
        if (k.tangent && tangents_active()) set_tangent(current, k.tangent->load());
        position = i;
        break;
      }
      case K::free:
        if (forward) held.forward_snapshots.erase(i);  // an online chain frees as it goes: the set stays at s
        if (!(retaining && held.forward_snapshots.count(i))) held.kept.erase(i);
        break;
      case K::record: {
        Recorded r{std::make_unique<RecordedRun>(), Tensor(current.storage(), current.shape()), Tensor(), forward};
        if (i > 0) r.input.requires_grad_();
        else if (input_meta) r.input.set_meta(input_meta);  // x's identity: its tangent too
        if (has_tangent(current) && !has_tangent(r.input)) set_tangent(r.input, tangent_of(current));
        const bool unused = !forward && next && next->kind == Action::Kind::reverse && next->step == i;
        // A step recorded in forward waits for its reversal: hold it by what its backward reads
        // when that is all it needs (noted while it records; its graph goes right after).
        std::optional<CompactRecorder::Notes> notes;
        if (forward && compact) notes.emplace();
        const auto position_now = at(i, after);
        r.output = r.run->record([&] { return run_step(i, r.input, unused, notes ? &*notes : nullptr); });
        current = detach_keeping_tangent(r.output);
        if (notes && notes->complete) {
          held.compact_records.add(i, std::move(*notes), r.input, r.input.storage()->version(), r.output.requires_grad());
        } else {
          held.recorded[i] = std::move(r);
        }
        ++position;
        ++counts.records;
        break;
      }
      case K::reverse: {
        const auto position_now = at(i, after);
        if (!held.recorded.count(i)) rebuild(i);
        Recorded& r = held.recorded.at(i);
        const bool keep = retaining && r.in_forward;
        if (i > 0) r.input.zero_grad();  // a retained step's input still holds the last backward's gradient
        r.run->backward({&r.output}, {grad}, keep);  // a step that returned its input passes grad straight through
        grad = i > 0 ? r.input.grad() : Tensor();  // step 0 delivered into the chain input directly
        if (!keep) held.recorded.erase(i);
        if (!retaining && held.compact_records.has(i)) held.compact_records.drop(i);
        break;
      }
    }
  }

  /// Rebuilds the graph of compactly held step i, computing nothing (compact_records.hpp).
  void rebuild(std::int64_t i) {
    const CompactRecords::Step step = held.compact_records.get(i);
    const Shape& shape = i > 0 ? first.out_shapes[static_cast<std::size_t>(i - 1)] : input_shape;
    Tensor input;
    if (step.input) {
      // Checked against in-place writes since the step read it (and read back from its store).
      const std::string who = fmt::format("{}: x_{} (shape {}), which step {} reads,", name, i, shape, i);
      input = Tensor(step.input->saved.ref(who.c_str()).storage, shape);
    } else {
      input = unread_tensor<float>(shape);  // its backward reads nothing of it
    }
    Recorded r{std::make_unique<RecordedRun>(), input, Tensor(), false};
    if (i > 0) r.input.requires_grad_();
    else if (input_meta) r.input.set_meta(input_meta);
    r.output = r.run->record([&] { return run_step(i, r.input, true, nullptr, &step); });
    held.recorded[i] = std::move(r);
    ++counts.rebuilt;
  }

  /// Forgets step i's recording, full or compact (it will be recorded again when reversed).
  void drop_record(std::int64_t i) {
    held.recorded.erase(i);
    if (held.compact_records.has(i)) held.compact_records.drop(i);
  }
};

}  // namespace detail

namespace detail {

inline Tensor run_chain(ChainSteps steps, const Tensor& x, const Policy& policy, const std::vector<StepCost>* costs,
                        std::shared_ptr<ChainCounts> counts) {
  const auto L = static_cast<std::int64_t>(steps.size());
  // Without grad, or inside a checkpointed segment's forward (which records nothing and replays
  // us for real in its backward), the steps simply run.
  if (!is_grad_enabled() || !session().recording) {
    // The chain that such a replay records keeps x as its first snapshot.
    if (is_grad_enabled()) report_saved_for_backward({x});
    Tensor h = x;
    // Each step in a run scope of its own, as the executor runs it in that replay: the enclosing
    // segment counts the same ops (none of the steps') in both runs.
    for (std::size_t i = 0; i < steps.size(); ++i) {
      RunScope step;
      h = steps[i](h);
    }
    return h;
  }
  std::vector<StepCost> measured;
  if (policy.needs_costs && !costs) {
    measured = measure_steps(steps, x);
    costs = &measured;
  }
  auto run = std::make_shared<ChainRun>(fmt::format("checkpoint_sequential[{}]", policy.name), x);
  run->steps = std::move(steps);
  run->plan = plan(policy, L, costs);
  run->report = std::move(counts);
  run->run_forward();
  return ChainRun::finish(run, x, fmt::format("chain[{}]", policy.name));
}

}  // namespace detail

/// Runs x through `steps` under `policy` and returns x_L; one node on the tape. Costs, when the
/// policy needs them and none are given, are measured by running each step once. `counts`, when
/// given, receives what the executor did (filled in as the backward completes).
inline Tensor checkpoint_sequential(const std::vector<ChainStep>& steps, const Tensor& x, const Policy& policy,
                                    const std::vector<StepCost>* costs = nullptr,
                                    std::shared_ptr<ChainCounts> counts = nullptr) {
  const auto L = static_cast<std::int64_t>(steps.size());
  REMAT_CHECK(L >= 1, "checkpoint_sequential: needs at least one step");
  for (std::size_t i = 0; i < steps.size(); ++i)
    REMAT_CHECK(static_cast<bool>(steps[i]), "checkpoint_sequential: step {} of {} is an empty function", i, L);
  return detail::run_chain(detail::ChainSteps(steps), x, policy, costs, std::move(counts));
}

/// The same function for every one of `steps` steps (an RNN cell over a sequence, an integrator's
/// time step): x_{i+1} = step(x_i). The chain holds the function once, not once per step.
inline Tensor checkpoint_sequential(const ChainStep& step, std::int64_t steps, const Tensor& x, const Policy& policy,
                                    const std::vector<StepCost>* costs = nullptr,
                                    std::shared_ptr<ChainCounts> counts = nullptr) {
  REMAT_CHECK(steps >= 1, "checkpoint_sequential: needs at least one step, got {}", steps);
  REMAT_CHECK(static_cast<bool>(step), "checkpoint_sequential: the step is an empty function");
  return detail::run_chain(detail::ChainSteps(step, steps), x, policy, costs, std::move(counts));
}

/// Modules (e.g. a GPT's blocks) as chain steps, held by reference.
template <class Module>
std::vector<ChainStep> module_steps(const std::vector<std::unique_ptr<Module>>& modules) {
  std::vector<ChainStep> steps;
  for (const auto& m : modules) steps.push_back([mod = m.get()](const Tensor& h) { return (*mod)(h); });
  return steps;
}

/// Runs x through `modules` (e.g. a GPT's blocks) as chain steps under `policy`: checkpoint_sequential
/// over module_steps(modules).
template <class Module>
Tensor checkpoint_sequential(const std::vector<std::unique_ptr<Module>>& modules, const Tensor& x, const Policy& policy,
                             const std::vector<StepCost>* costs = nullptr, std::shared_ptr<ChainCounts> counts = nullptr) {
  return checkpoint_sequential(module_steps(modules), x, policy, costs, std::move(counts));
}

}  // namespace remat
