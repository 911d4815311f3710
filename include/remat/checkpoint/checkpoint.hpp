#pragma once
// checkpoint(fn, args...): runs fn without recording anything inside it, keeps only the segment's
// boundary (the tensors among its arguments, the RNG state at entry, what it read from outside and
// a description of its outputs) and puts one node on the tape. That node's backward checks that
// nothing the segment read was written in place since, restores the RNG state, replays fn on a
// nested tape from the saved arguments — computing only up to the last op output the backward
// reads (early_stop.hpp) — checks the replay against the forward, backpropagates through it and
// frees the replayed activations. Parameters fn uses receive their gradients directly.
//
// Arguments and results may be any mix of tensors (of any element type) and other values, nested
// in tuples, pairs, vectors, arrays, optionals, std::maps and plain structs (core/tensor_tree.hpp).
// Floating tensors (float32, float64, bfloat16) in the result that require grad are the node's
// outputs, and those among the arguments its inputs, each receiving its gradient in its own type
// (core/mixed_node.hpp); every other value comes back as fn made it (a mask stays an int64 tensor;
// an output that needs no grad does not get one).

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "remat/checkpoint/early_stop.hpp"
#include "remat/checkpoint/error.hpp"
#include "remat/checkpoint/replay.hpp"
#include "remat/checkpoint/run_parts.hpp"
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/checkpoint/selective.hpp"
#include "remat/checkpoint/trace.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/forward_ad.hpp"
#include "remat/core/random.hpp"
#include "remat/core/scoped.hpp"
#include "remat/core/tensor_tree.hpp"

namespace remat {

/// How one checkpoint() segment is named, checked and replayed.
struct CheckpointOptions {
  /// The common fields in order; early_stop and debug are set by name.
  CheckpointOptions(std::string name = "checkpoint", bool check_values = false, SavePolicy save = {})
      : name(std::move(name)), check_values(check_values), save(std::move(save)) {}

  std::string name;         ///< names the segment in errors and in the saved-tensor report
  bool check_values;        ///< also compare the replay's output values (else shapes only)
  SavePolicy save;          ///< selective checkpointing: ops whose outputs are kept, not replayed
  bool early_stop = true;   ///< replay only up to the last op output backward reads (see CheckpointEarlyStop)
  bool debug = false;       ///< trace the ops of forward and replay; a mismatch names the first differing op
};

namespace detail {

/// Where a tensor found in the arguments went: its index among the node's saved tensors, and
/// among the node's inputs of its element type when it can receive a gradient; -1 for none.
struct ArgumentSlot {
  std::ptrdiff_t saved = -1;
  std::ptrdiff_t input = -1;
};

/// Everything a segment's backward needs besides its saved tensors, and the segment's parts in the
/// order they run: its forward (run_forward), its boundary (take_boundary), its outputs
/// (note_outputs), and in backward its replay (replay) checked against the forward (verify).
template <class R, class Fn, class... Args>
struct Segment {
  Segment(Fn f, std::tuple<std::decay_t<Args>...> a, CheckpointOptions o)
      : fn(std::move(f)), args(std::move(a)), options(std::move(o)) {
    const ReplayModes modes = ReplayModes::compose(options.check_values, options.early_stop, options.debug);
    check_values = modes.check_values;
    early_stop = modes.early_stop;
    debug = modes.debug;
  }

  Fn fn;
  std::tuple<std::decay_t<Args>...> args;  // with the tensors inside cleared: the node saves those
  CheckpointOptions options;
  bool check_values = false;
  bool early_stop = true;
  bool debug = false;
  Generator::State rng;                   // the default generator's at the start
  AutocastState autocast;                 // remat::autocast's state in the forward, and its casts
  DrawnGenerators other_rng;              // every other generator the forward drew from
  std::vector<ArgumentSlot> arg_slots;   // one per tensor in the arguments, in for_each_tensor order
  std::vector<FirstRunOutput> outputs;    // one per tensor in the result, in for_each_tensor order
  std::vector<bool> node_output;          // which of those are the node's outputs
  std::size_t kept_first = 0;            // selective outputs are saved from here on
  std::size_t kept = 0;
  std::vector<KeptOp> kept_ops;          // which op invocations they came from
  SegmentReads reads;
  std::vector<TracedOp> trace;           // the forward's ops, under debug

  std::string who() const { return fmt::format("checkpoint '{}'", options.name); }

  /// Runs `first` (fn, or the caller's own object fn was copied from) with recording off
  /// (requires_grad still flows), noting the generators it draws from, what it reads from outside,
  /// and the outputs selective saving keeps (into `kept`).
  template <class G>
  R run_forward(G& first, const Args&... call_args, std::vector<SavedTensor>& kept) {
    rng = default_generator().state();
    autocast = autocast_state();
    auto not_recording = scoped_recording(false);
    RecordDraws draws(other_rng);
    RunParts parts;
    parts.stash(options.save, kept_ops, kept);
    parts.reads(reads);
    if (debug) parts.trace(trace);
    return R(std::invoke(first, call_args...));
  }

  /// The boundary: every tensor among the arguments is saved (into `saved`); floating ones that
  /// need a gradient are also the node's inputs of their type. The stored copies of the arguments
  /// are cleared, since the node keeps their tensors.
  void take_boundary(const Args&... call_args, std::vector<SavedTensor>& saved, PerFloatingType<TensorList>& inputs) {
    auto add_argument = [&](const auto& t) {
      using U = typename std::decay_t<decltype(t)>::Scalar;
      ArgumentSlot slot;
      if (t.defined()) {
        slot.saved = static_cast<std::ptrdiff_t>(saved.size());
        saved.emplace_back(t);
        if constexpr (is_floating_dtype<U>) {
          if (t.requires_grad()) {
            slot.input = static_cast<std::ptrdiff_t>(inputs.get<U>().size());
            inputs.get<U>().push_back(t);
          }
        }
      }
      arg_slots.push_back(slot);
    };
    (for_each_tensor(call_args, add_argument), ...);
    std::apply([](auto&... a) { (for_each_tensor(a, [](auto& t) { t = std::decay_t<decltype(t)>(); }), ...); }, args);
  }

  /// Notes what the forward returned (shapes, types, hashes under check_values) and returns the
  /// tensors that become the node's outputs: floating ones that require grad, given fresh handles
  /// (never an input's autograd metadata; a tangent stays).
  PerFloatingType<TensorPointers> note_outputs(R& result) {
    PerFloatingType<TensorPointers> out;
    for_each_tensor(result, [&](auto& t) {
      using U = typename std::decay_t<decltype(t)>::Scalar;
      FirstRunOutput o = FirstRunOutput::of(t, check_values);
      bool is_output = false;
      if constexpr (is_floating_dtype<U>) {
        if (o.defined && t.requires_grad()) {
          is_output = true;
          t = detach_keeping_tangent(t);
          out.get<U>().push_back(&t);
        }
      }
      node_output.push_back(is_output);
      outputs.push_back(std::move(o));
    });
    return out;
  }

  /// The arguments for a replay: stored values, tensors refilled from the node (a floating tensor
  /// that needs a gradient under its input's autograd identity, so its gradient arrives there).
  std::tuple<std::decay_t<Args>...> replay_args(const MixedBackwardContext& ctx) const {
    auto out = args;
    std::size_t next = 0;
    std::apply([&](auto&... a) { (for_each_tensor(a, [&](auto& t) { refill(t, ctx, arg_slots[next++]); }), ...); },
               out);
    return out;
  }

  /// Runs fn again as a replay, recorded on `run`: the generators at their forward states, kept
  /// outputs handed back by position, ops past the last one backward reads skipped (early stop).
  /// Recorded (create_graph), the kept outputs are computed again instead: a kept value has no
  /// graph back to its op's inputs, and a second differentiation must reach them through it.
  R replay(RecordedRun& run, const MixedBackwardContext& ctx, std::vector<TracedOp>& replay_trace,
           bool recorded = false) {
    std::vector<SavedTensor> kept_outputs;
    if (!recorded)
      for (std::size_t j = 0; j < kept; ++j) kept_outputs.emplace_back(ctx.saved_ref(kept_first + j));
    std::optional<R> replayed;
    run.record([&] {
      TimelineSpan span("replay", [&] { return "replay " + options.name; });
      ReplayNotice notice({"checkpoint", options.name.c_str()});
      as_replay(rng, &other_rng, autocast, [&] {
        RunParts parts;
        static const std::vector<KeptOp> none;
        const SelectiveReuse& kept_ones = parts.reuse_kept(recorded ? none : kept_ops, kept_outputs, options.name);
        parts.stop_after(reads.last_needed, early_stop);
        if (debug) parts.trace(replay_trace);
        auto call_args = replay_args(ctx);
        replayed.emplace(std::apply([&](auto&... a) { return R(std::invoke(fn, a...)); }, call_args));
        kept_ones.check_all_used(parts.ops());
      });
    });
    return std::move(*replayed);
  }

  /// Checks the replay's result against the forward's (count, shapes and types; values under
  /// check_values) and returns its node outputs, each type's in the forward's order.
  PerFloatingType<TensorPointers> verify(R& replayed) const {
    const std::string name = who();
    std::size_t i = 0;
    PerFloatingType<TensorPointers> outs;
    for_each_tensor(replayed, [&](auto& t) {
      using U = typename std::decay_t<decltype(t)>::Scalar;
      if (i >= outputs.size())
        throw CheckpointError(fmt::format("{}: the replay returned more tensors than the forward's {}", name,
                                          outputs.size()));
      if (std::string d = replay_difference(fmt::format("{}: output {}", name, i), t, outputs[i]); !d.empty())
        throw CheckpointError(d);
      // The same type as in the forward (checked above), so each type's outputs line up.
      if constexpr (is_floating_dtype<U>) {
        if (node_output[i]) outs.get<U>().push_back(&t);
      }
      ++i;
    });
    if (i != outputs.size())
      throw CheckpointError(fmt::format("{}: the replay returned {} tensors, the forward {}", name, i, outputs.size()));
    return outs;
  }

  /// The node's backward: replay, verify, then backpropagate the replay's tape from the node's
  /// output gradients (its activations live on the run's tape and die with it). In a backward
  /// that records its ops (create_graph) the replay is recorded onto the tape being walked and
  /// stays there: the gradients' graph reaches the inputs through the replayed activations.
  void backward(MixedBackwardContext& ctx) {
    reads.check_versions(who());
    // Formulas in ops (create_graph, or carrying tangents): kept outputs are computed again (a kept
    // value has neither a graph back to its op's inputs nor a tangent); only create_graph records
    // the replay onto the tape being walked.
    const bool recorded = ctx.create_graph();
    std::optional<RecordedRun> run;
    if (recorded && !session().tangent_walk) run.emplace(current_tape());
    else run.emplace();
    std::vector<TracedOp> replay_trace;
    std::optional<R> replayed;
    PerFloatingType<TensorPointers> outs;
    try {
      replayed.emplace(replay(*run, ctx, replay_trace, recorded));
      outs = verify(*replayed);
    } catch (const CheckpointError& e) {
      if (!debug) throw;
      throw CheckpointError(fmt::format("{}\n  {}", e.what(), trace_difference(trace, replay_trace)));
    }
    PerFloatingType<TensorList> grads;
    output_grads<float>(ctx, outs, grads);
    output_grads<double>(ctx, outs, grads);
    output_grads<bfloat16>(ctx, outs, grads);
    run->backward(outs, grads);
  }

 private:
  /// The gradients the node's outputs of type U received. An output that reached no loss seeds
  /// nothing: what only it depends on gets no gradient (not a zero one), as without checkpointing.
  template <class U>
  static void output_grads(MixedBackwardContext& ctx, const PerFloatingType<TensorPointers>& outs,
                           PerFloatingType<TensorList>& grads) {
    const TensorPointers<U>& mine = outs.get<U>();
    for (std::size_t j = 0; j < mine.size(); ++j)
      grads.get<U>().push_back(mine[j]->requires_grad() && ctx.has_grad_output<U>(j) ? ctx.grad_output<U>(j)
                                                                                       : BasicTensor<U>());
  }

  template <class U>
  static void refill(BasicTensor<U>& slot, const MixedBackwardContext& ctx, const ArgumentSlot& where) {
    if (where.saved < 0) return;
    const auto k = static_cast<std::size_t>(where.saved);
    if constexpr (is_floating_dtype<U>) {
      slot = where.input >= 0 ? ctx.as_input<U>(static_cast<std::size_t>(where.input), ctx.saved<U>(k))
                              : ctx.saved<U>(k);
    } else {
      slot = ctx.saved<U>(k);
    }
  }
};

}  // namespace detail

/// Runs fn(args...) as a checkpointed segment and returns what it returns. Tensors among the
/// arguments (also inside containers and structs) are the segment's boundary; other arguments are
/// copied for replay. fn is copied too when it can be (a lambda named in a loop body is gone by
/// the time backward replays it): the forward runs the caller's object, the replay a copy taken
/// before it, so both start from the same state. An fn that cannot be copied (a module) is held by
/// reference and must outlive backward; pass std::ref(fn) to hold a copyable one by reference.
template <class F, class... Args>
auto checkpoint(CheckpointOptions options, F&& fn, const Args&... args) {
  using R = std::decay_t<std::invoke_result_t<F&, const Args&...>>;
  using Callable = std::remove_cv_t<std::remove_reference_t<F>>;
  constexpr bool by_reference = std::is_lvalue_reference_v<F> && !std::is_copy_constructible_v<Callable>;
  using Fn = std::conditional_t<by_reference, std::reference_wrapper<std::remove_reference_t<F>>, Callable>;
  using Seg = detail::Segment<R, Fn, Args...>;
  if (!is_grad_enabled()) return R(std::invoke(fn, args...));  // nothing to save for
  const bool recording = detail::session().recording;  // false inside an enclosing segment's forward
  auto segment = std::make_shared<Seg>(Fn(std::forward<F>(fn)), std::tuple<std::decay_t<Args>...>(args...),
                                       std::move(options));
  Seg& seg = *segment;
  std::vector<detail::SavedTensor> kept, saved;
  detail::PerFloatingType<detail::TensorList> inputs;
  R result = [&] {
    if constexpr (std::is_lvalue_reference_v<F>) return seg.run_forward(fn, args..., kept);
    else return seg.run_forward(seg.fn, args..., kept);
  }();
  seg.take_boundary(args..., saved, inputs);
  seg.kept_first = saved.size();
  seg.kept = kept.size();
  saved.insert(saved.end(), kept.begin(), kept.end());
  if (!recording) {
    // Inside an enclosing segment's forward: that segment's replay runs us for real, and then our
    // node saves this boundary, so the enclosing replay must compute it.
    detail::report_saved_for_backward(saved);
    return result;
  }
  const detail::PerFloatingType<detail::TensorPointers> node_outputs = seg.note_outputs(result);
  if (!node_outputs.any([](const auto& list) { return !list.empty(); }))
    return result;  // nothing inside needs a gradient: nothing to replay
  const std::string name = seg.options.name;
  detail::record_mixed(name, inputs, node_outputs, std::move(saved),
                       [segment](detail::MixedBackwardContext& ctx) {
                         segment->backward(ctx);
                         // fn may hold tensors computed before the segment (a lambda's captures)
                         // that its replay just sent gradients to: they live on with it until the
                         // walk has passed their producers.
                         if (!ctx.retain_graph()) detail::session().walk_keepalive.push_back(segment);
                       },
                       SavedBy::checkpoint);
  return result;
}

/// checkpoint with default CheckpointOptions (the segment named "checkpoint", shapes checked only,
/// nothing kept): runs fn(args...) as a checkpointed segment and returns what it returns.
template <class F, class... Args, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, CheckpointOptions>>>
auto checkpoint(F&& fn, const Args&... args) {
  return checkpoint(CheckpointOptions{}, std::forward<F>(fn), args...);
}

}  // namespace remat
