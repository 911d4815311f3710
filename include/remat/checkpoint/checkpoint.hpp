#pragma once
// checkpoint(fn, args...): runs fn without recording anything inside it, keeps only the segment's
// boundary (its tensor inputs, the RNG state at entry, and a fingerprint of the outputs) and puts
// one node on the tape. That node's backward restores the RNG state, replays fn on a nested tape
// from the saved inputs, checks the replay against the fingerprint, backpropagates through it and
// frees the replayed activations. Parameters fn uses receive their gradients directly.

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

#include "remat/checkpoint/error.hpp"
#include "remat/checkpoint/replay.hpp"
#include "remat/checkpoint/selective.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/random.hpp"
#include "remat/core/scoped.hpp"

namespace remat {

struct CheckpointOptions {
  CheckpointOptions(std::string name = "checkpoint", bool check_values = false, SavePolicy save = {})
      : name(std::move(name)), check_values(check_values), save(std::move(save)) {}

  std::string name;   ///< names the segment in errors and in the saved-tensor report
  bool check_values;  ///< also compare the replay's output values (else shapes only)
  SavePolicy save;    ///< selective checkpointing: ops whose outputs are kept, not replayed
};

namespace detail {

/// A checkpointed function's result as a list of its tensors: a Tensor or a tuple of Tensors.
template <class R>
struct CheckpointOutputs {
  static_assert(sizeof(R) == 0, "checkpoint: the function must return a Tensor or a std::tuple of Tensors");
};
template <>
struct CheckpointOutputs<Tensor> {
  static std::vector<Tensor*> list(Tensor& r) { return {&r}; }
};
template <class... Ts>
struct CheckpointOutputs<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, Tensor> && ...), "checkpoint: a returned tuple must hold only Tensors");
  static std::vector<Tensor*> list(std::tuple<Ts...>& r) {
    return std::apply([](auto&... t) { return std::vector<Tensor*>{&t...}; }, r);
  }
};

template <class A>
constexpr bool is_checkpoint_tensor_v = std::is_same_v<std::decay_t<A>, Tensor>;

/// Everything a segment's backward needs besides its saved tensors.
template <class Fn, class... Args>
struct Segment {
  Fn fn;
  std::tuple<std::decay_t<Args>...> args;  // tensor slots are left undefined: the node saves those
  CheckpointOptions options;
  bool check_values = false;
  Generator::State rng;
  std::vector<Shape> output_shapes;
  std::vector<std::uint64_t> output_hashes;
  std::size_t inputs = 0;  // tensor arguments, saved first
  std::size_t kept = 0;    // selective outputs, saved after the inputs
  std::vector<KeptOp> kept_ops;  // which op invocations they came from

  /// The arguments for a replay: stored non-tensor values, tensor slots filled from `inputs`.
  std::tuple<std::decay_t<Args>...> replay_args(const std::vector<Tensor>& inputs) const {
    auto out = args;
    std::size_t next = 0;
    std::apply([&](auto&... a) { (fill(a, inputs, next), ...); }, out);
    return out;
  }

 private:
  template <class A>
  static void fill(A& slot, const std::vector<Tensor>& inputs, std::size_t& next) {
    if constexpr (is_checkpoint_tensor_v<A>) slot = inputs[next++];
  }
};

template <class A>
void collect_tensor_arg(const A& a, std::vector<Tensor>& out) {
  if constexpr (is_checkpoint_tensor_v<A>) out.push_back(a);
}
template <class A>
void clear_tensor_arg(A& a) {
  if constexpr (is_checkpoint_tensor_v<A>) a = Tensor();
}

}  // namespace detail

/// Runs fn(args...) as a checkpointed segment and returns what it returns (a Tensor or a tuple of
/// Tensors). Tensor arguments are the segment's boundary; other arguments are copied for replay.
/// An lvalue fn (a module, say) is held by reference and must outlive the backward.
template <class F, class... Args>
auto checkpoint(CheckpointOptions options, F&& fn, const Args&... args) {
  using R = std::invoke_result_t<F&, const Args&...>;
  using Fn = std::conditional_t<std::is_lvalue_reference_v<F>, std::reference_wrapper<std::remove_reference_t<F>>,
                                std::decay_t<F>>;
  using Seg = detail::Segment<Fn, Args...>;
  detail::AutogradState& state = detail::autograd_state();
  if (!state.grad_enabled) return R(std::invoke(fn, args...));  // nothing to save for

  const bool recording = state.recording;  // false inside an enclosing segment's forward
  auto segment = std::make_shared<Seg>(Seg{Fn(std::forward<F>(fn)), std::tuple<std::decay_t<Args>...>(args...),
                                           std::move(options), false, default_generator().state(), {}, {}, 0, 0, {}});
  segment->check_values = segment->options.check_values || detail::checkpoint_checking_flag();
  std::vector<detail::SavedTensor> kept;
  const bool stash = recording && static_cast<bool>(segment->options.save);
  R result = [&] {
    auto not_recording = detail::scoped_recording(false);
    detail::SelectiveHook hook(stash ? detail::SelectiveHook::Mode::stash : detail::SelectiveHook::Mode::off,
                               segment->options.save, segment->kept_ops, kept, segment->options.name);
    return R(std::invoke(segment->fn, args...));
  }();
  if (!recording) return result;  // the enclosing segment saves the boundary; its replay runs us for real

  std::vector<Tensor*> outputs = detail::CheckpointOutputs<R>::list(result);
  bool any_grad = false;
  for (Tensor* o : outputs) any_grad = any_grad || o->requires_grad();
  if (!any_grad) return result;  // nothing inside needs a gradient: nothing to replay

  for (Tensor* o : outputs) {
    *o = o->detach();  // fresh handles: an output never shares autograd metadata with an input
    segment->output_shapes.push_back(o->shape());
    if (segment->check_values) segment->output_hashes.push_back(detail::fingerprint(*o));
  }
  std::vector<Tensor> inputs;
  (detail::collect_tensor_arg(args, inputs), ...);
  std::apply([](auto&... a) { (detail::clear_tensor_arg(a), ...); }, segment->args);
  std::vector<detail::SavedTensor> saved(inputs.begin(), inputs.end());
  segment->inputs = inputs.size();
  segment->kept = kept.size();
  saved.insert(saved.end(), kept.begin(), kept.end());
  const std::string name = segment->options.name;

  detail::record<float>(name, inputs, outputs, std::move(saved), [segment](detail::BackwardContext<float>& ctx) {
    Seg& seg = *segment;
    const std::size_t n_inputs = seg.inputs;
    // The replay reads the saved inputs under the inputs' own autograd identities, so every
    // contribution it makes reaches an input's gradient in the order the plain forward's nodes
    // would have made it: bitwise equal even when the input is also used outside the segment.
    std::vector<Tensor> inputs;
    for (std::size_t i = 0; i < n_inputs; ++i) inputs.push_back(ctx.as_input(i, ctx.saved(i)));
    std::vector<detail::SavedTensor> kept_outputs;
    for (std::size_t j = 0; j < seg.kept; ++j) kept_outputs.emplace_back(ctx.saved(n_inputs + j));

    detail::RecordedRun run;  // the replayed activations live on its tape and die with it
    std::optional<R> replayed;
    run.record([&] {
      detail::as_replay(seg.rng, [&] {
        detail::SelectiveHook hook(detail::SelectiveHook::Mode::reuse, seg.options.save, seg.kept_ops, kept_outputs,
                                   seg.options.name);
        auto call_args = seg.replay_args(inputs);
        replayed.emplace(std::apply([&](auto&... a) { return R(std::invoke(seg.fn, a...)); }, call_args));
        hook.check_all_used();
      });
    });
    std::vector<Tensor*> outs = detail::CheckpointOutputs<R>::list(*replayed);
    std::vector<Tensor> grads;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      if (outs[i]->shape() != seg.output_shapes[i])
        throw CheckpointError(fmt::format(
            "checkpoint '{}': replay produced output {} of shape {}, but the forward produced shape {}; the segment "
            "must compute the same thing when replayed (no dependence on state it changes)",
            seg.options.name, i, outs[i]->shape(), seg.output_shapes[i]));
      if (seg.check_values && detail::fingerprint(*outs[i]) != seg.output_hashes[i])
        throw CheckpointError(fmt::format(
            "checkpoint '{}': replay produced different values for output {} (shape {}) than the forward did; the "
            "segment depends on state that changed between forward and backward", seg.options.name, i,
            outs[i]->shape()));
      // An output that reached no loss seeds nothing: what only it depends on gets no gradient
      // (not a zero one), as without checkpointing.
      grads.push_back(outs[i]->requires_grad() && ctx.has_grad_output(i) ? ctx.grad_output(i) : Tensor());
    }
    run.backward(outs, grads);
  });
  return result;
}

template <class F, class... Args, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, CheckpointOptions>>>
auto checkpoint(F&& fn, const Args&... args) {
  return checkpoint(CheckpointOptions{}, std::forward<F>(fn), args...);
}

}  // namespace remat
