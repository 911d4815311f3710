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
// Float tensors in the result that require grad are the node's outputs; every other value comes
// back as fn made it (a mask stays an int64 tensor; an output that needs no grad does not get one).

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
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/checkpoint/selective.hpp"
#include "remat/checkpoint/trace.hpp"
#include "remat/core/autograd.hpp"
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

/// One tensor of a segment's result, as the forward made it.
struct SegmentOutput {
  bool defined = false;
  Shape shape;
  const char* dtype = nullptr;
  std::uint64_t hash = 0;  // under check_values
};

/// Where a tensor found in the arguments went: its index among the node's saved tensors, and
/// among the node's (float) inputs when it can receive a gradient; -1 for none.
struct ArgumentSlot {
  std::ptrdiff_t saved = -1;
  std::ptrdiff_t input = -1;
};

/// Everything a segment's backward needs besides its saved tensors.
template <class Fn, class... Args>
struct Segment {
  Segment(Fn f, std::tuple<std::decay_t<Args>...> a, CheckpointOptions o)
      : fn(std::move(f)), args(std::move(a)), options(std::move(o)) {}

  Fn fn;
  std::tuple<std::decay_t<Args>...> args;  // with the tensors inside cleared: the node saves those
  CheckpointOptions options;
  bool check_values = false;
  bool early_stop = true;
  bool debug = false;
  Generator::State rng;                   // the default generator's at the start
  DrawnGenerators other_rng;              // every other generator the forward drew from
  std::vector<ArgumentSlot> arg_slots;   // one per tensor in the arguments, in for_each_tensor order
  std::vector<SegmentOutput> outputs;    // one per tensor in the result, in for_each_tensor order
  std::vector<std::size_t> node_outputs; // which of those are the node's outputs
  std::size_t kept_first = 0;            // selective outputs are saved from here on
  std::size_t kept = 0;
  std::vector<KeptOp> kept_ops;          // which op invocations they came from
  SegmentReads reads;
  std::vector<TracedOp> trace;           // the forward's ops, under debug

  /// The arguments for a replay: stored values, tensors refilled from the node (a float tensor
  /// that needs a gradient under its input's autograd identity, so its gradient arrives there).
  std::tuple<std::decay_t<Args>...> replay_args(const BackwardContext<float>& ctx) const {
    auto out = args;
    std::size_t next = 0;
    std::apply([&](auto&... a) { (for_each_tensor(a, [&](auto& t) { refill(t, ctx, arg_slots[next++]); }), ...); },
               out);
    return out;
  }

 private:
  template <class U>
  static void refill(BasicTensor<U>& slot, const BackwardContext<float>& ctx, const ArgumentSlot& where) {
    if (where.saved < 0) return;
    const auto k = static_cast<std::size_t>(where.saved);
    if constexpr (std::is_same_v<U, float>) {
      slot = where.input >= 0 ? ctx.as_input(static_cast<std::size_t>(where.input), ctx.saved(k)) : ctx.saved(k);
    } else {
      slot = ctx.template saved<U>(k);
    }
  }
};

}  // namespace detail

/// Runs fn(args...) as a checkpointed segment and returns what it returns. Tensors among the
/// arguments (also inside containers and structs) are the segment's boundary; other arguments are
/// copied for replay. An lvalue fn (a module, say) is held by reference and must outlive backward.
template <class F, class... Args>
auto checkpoint(CheckpointOptions options, F&& fn, const Args&... args) {
  using R = std::decay_t<std::invoke_result_t<F&, const Args&...>>;
  using Fn = std::conditional_t<std::is_lvalue_reference_v<F>, std::reference_wrapper<std::remove_reference_t<F>>,
                                std::decay_t<F>>;
  using Seg = detail::Segment<Fn, Args...>;
  detail::AutogradState& state = detail::autograd_state();
  if (!state.grad_enabled) return R(std::invoke(fn, args...));  // nothing to save for

  const bool recording = state.recording;  // false inside an enclosing segment's forward
  auto segment = std::make_shared<Seg>(Fn(std::forward<F>(fn)), std::tuple<std::decay_t<Args>...>(args...),
                                       std::move(options));
  Seg& seg = *segment;
  seg.rng = default_generator().state();
  seg.check_values = seg.options.check_values || detail::checkpoint_checking_flag();
  seg.early_stop = seg.options.early_stop && detail::checkpoint_early_stop_flag() && !seg.check_values;
  seg.debug = seg.options.debug || detail::checkpoint_debug_flag();
  std::vector<detail::SavedTensor> kept;
  R result = [&] {
    auto not_recording = detail::scoped_recording(false);
    detail::RecordDraws draws(seg.other_rng);
    // Innermost last: the trace and the observer see every op output before the selective
    // handler, which passes none outward.
    detail::SelectiveHook hook(seg.options.save ? detail::SelectiveHook::Mode::stash : detail::SelectiveHook::Mode::off,
                               seg.options.save, seg.kept_ops, kept, seg.options.name);
    detail::SegmentReadsObserver observer(seg.reads);
    std::optional<detail::OpTrace> trace;
    if (seg.debug) trace.emplace(seg.trace);
    return R(std::invoke(seg.fn, args...));
  }();

  // The boundary: every tensor among the arguments is saved; float ones that need a gradient are
  // also the node's inputs.
  std::vector<detail::SavedTensor> saved;
  std::vector<Tensor> inputs;
  auto add_argument = [&](const auto& t) {
    detail::ArgumentSlot slot;
    if (t.defined()) {
      slot.saved = static_cast<std::ptrdiff_t>(saved.size());
      saved.emplace_back(t);
      if constexpr (std::is_same_v<std::decay_t<decltype(t)>, Tensor>) {
        if (t.requires_grad()) {
          slot.input = static_cast<std::ptrdiff_t>(inputs.size());
          inputs.push_back(t);
        }
      }
    }
    seg.arg_slots.push_back(slot);
  };
  (detail::for_each_tensor(args, add_argument), ...);
  std::apply([](auto&... a) { (detail::for_each_tensor(a, [](auto& t) { t = std::decay_t<decltype(t)>(); }), ...); },
             seg.args);
  seg.kept_first = saved.size();
  seg.kept = kept.size();
  saved.insert(saved.end(), kept.begin(), kept.end());
  if (!recording) {
    // Inside an enclosing segment's forward: that segment's replay runs us for real, and then our
    // node saves this boundary, so the enclosing replay must compute it.
    detail::report_saved_for_backward(saved);
    return result;
  }

  std::vector<Tensor*> node_outputs;
  detail::for_each_tensor(result, [&](auto& t) {
    detail::SegmentOutput o;
    o.defined = t.defined();
    if (o.defined) {
      o.shape = t.shape();
      o.dtype = t.dtype();
      if (seg.check_values) o.hash = detail::fingerprint(t);
      if constexpr (std::is_same_v<std::decay_t<decltype(t)>, Tensor>) {
        if (t.requires_grad()) {
          seg.node_outputs.push_back(seg.outputs.size());
          node_outputs.push_back(&t);
        }
      }
    }
    seg.outputs.push_back(std::move(o));
  });
  if (node_outputs.empty()) return result;  // nothing inside needs a gradient: nothing to replay
  for (Tensor* o : node_outputs) *o = o->detach();  // fresh handles: never an input's autograd metadata

  const std::string name = seg.options.name;
  detail::record<float>(name, inputs, node_outputs, std::move(saved), [segment](detail::BackwardContext<float>& ctx) {
    Seg& seg = *segment;
    const std::string who = fmt::format("checkpoint '{}'", seg.options.name);
    seg.reads.check_versions(who);
    std::vector<detail::SavedTensor> kept_outputs;
    for (std::size_t j = 0; j < seg.kept; ++j) kept_outputs.emplace_back(ctx.saved(seg.kept_first + j));

    detail::RecordedRun run;  // the replayed activations live on its tape and die with it
    std::optional<R> replayed;
    std::vector<detail::TracedOp> replay_trace;
    std::vector<Tensor*> outs;
    try {
      run.record([&] {
        detail::TimelineSpan span("replay", [&] { return "replay " + seg.options.name; });
        detail::ReplayNotice notice({"checkpoint", seg.options.name.c_str()});
        detail::as_replay(seg.rng, &seg.other_rng, [&] {
          detail::SelectiveHook hook(detail::SelectiveHook::Mode::reuse, seg.options.save, seg.kept_ops, kept_outputs,
                                     seg.options.name);
          detail::ReplaySkipper skipper(seg.reads.last_needed, seg.early_stop);
          std::optional<detail::OpTrace> trace;
          if (seg.debug) trace.emplace(replay_trace);
          auto call_args = seg.replay_args(ctx);
          replayed.emplace(std::apply([&](auto&... a) { return R(std::invoke(seg.fn, a...)); }, call_args));
          hook.check_all_used();
        });
      });
      std::size_t i = 0;
      std::vector<Tensor*> all;
      detail::for_each_tensor(*replayed, [&](auto& t) {
        if (i >= seg.outputs.size())
          throw CheckpointError(fmt::format("{}: the replay returned more tensors than the forward's {}", who,
                                            seg.outputs.size()));
        const detail::SegmentOutput& o = seg.outputs[i];
        const bool same = t.defined() == o.defined && (!o.defined || (t.shape() == o.shape && std::strcmp(t.dtype(), o.dtype) == 0));
        if (!same)
          throw CheckpointError(fmt::format(
              "{}: replay produced output {} as {}, but the forward produced {}; the segment must compute the same "
              "thing when replayed (no dependence on state it changes)", who, i,
              t.defined() ? fmt::format("shape {} ({})", t.shape(), t.dtype()) : std::string("undefined"),
              o.defined ? fmt::format("shape {} ({})", o.shape, o.dtype) : std::string("undefined")));
        if (seg.check_values && o.defined && detail::fingerprint(t) != o.hash)
          throw CheckpointError(fmt::format(
              "{}: replay produced different values for output {} (shape {}) than the forward did; the segment "
              "depends on state that changed between forward and backward", who, i, o.shape));
        if constexpr (std::is_same_v<std::decay_t<decltype(t)>, Tensor>) all.push_back(&t);
        else all.push_back(nullptr);
        ++i;
      });
      if (i != seg.outputs.size())
        throw CheckpointError(fmt::format("{}: the replay returned {} tensors, the forward {}", who, i, seg.outputs.size()));
      for (std::size_t k : seg.node_outputs) outs.push_back(all[k]);
    } catch (const CheckpointError& e) {
      if (!seg.debug) throw;
      throw CheckpointError(fmt::format("{}\n  {}", e.what(), detail::trace_difference(seg.trace, replay_trace)));
    }
    std::vector<Tensor> grads;
    for (std::size_t j = 0; j < outs.size(); ++j) {
      // An output that reached no loss seeds nothing: what only it depends on gets no gradient
      // (not a zero one), as without checkpointing.
      grads.push_back(outs[j]->requires_grad() && ctx.has_grad_output(j) ? ctx.grad_output(j) : Tensor());
    }
    run.backward(outs, grads);
  });
  return result;
}

/// checkpoint with default CheckpointOptions (the segment named "checkpoint", shapes checked only,
/// nothing kept): runs fn(args...) as a checkpointed segment and returns what it returns.
template <class F, class... Args, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, CheckpointOptions>>>
auto checkpoint(F&& fn, const Args&... args) {
  return checkpoint(CheckpointOptions{}, std::forward<F>(fn), args...);
}

}  // namespace remat
