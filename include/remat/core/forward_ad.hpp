#pragma once
// Forward-mode differentiation, as PyTorch's torch.autograd.forward_ad and torch.func.jvp: inside
// a dual_level scope a tensor may carry a tangent (a direction of its own shape), and an op that
// reads one computes its output's tangent by the op's tangent rule as it runs — the output's
// Jacobian-vector product, with no tape and nothing saved. make_dual attaches a tangent, tangent()
// reads one, jvp(f, primals, tangents) does both around a call.
//
// An op has a tangent rule when it is registered with one (register_op(name, tangent_rule)); one
// without a rule that reads a tangent is a remat::Error naming it, never a tangent silently
// dropped. A rule computes in ops with grad and tangents off, so its own ops carry neither.

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/tangent.hpp"
#include "remat/core/tensor.hpp"

namespace remat {
namespace detail {

/// The op is about to read tensors carrying tangents: it must have a rule.
inline void require_tangent_rule(OpId op) {
  REMAT_CHECK(has_tangent_rule(op),
              "{}: forward-mode differentiation (jvp, a dual tensor) reached this op, which has no tangent rule "
              "yet; ops with one: {}",
              op.name(), fmt::join(ops_with_tangent_rules(), ", "));
}

/// RAII: a tangent rule computes — its ops carry no tangents, record no graph, and are seen by no
/// run scope or observer (a checkpoint's positions and a budget's books are the primal ops', the
/// same whether or not tangents are carried).
class TangentRuleScope {
 public:
  TangentRuleScope() : off_(session().tangents_off + 1), grad_(false) {}

 private:
  Install<&Session::tangents_off> off_;
  Install<&Session::grad_enabled> grad_;
  OpOutputHook::Suspended unscoped_;
  QuietObservers quiet_;
};

/// An op's tangent rule, applied when tangents are active and any of `inputs` carries one:
/// y's tangent = rule(tangent of each input, undefined where it has none).
template <class T, class Rule, class... In>
void push_tangent(BasicTensor<T>& y, const Rule& rule, const BasicTensor<In>&... inputs) {
  if (!tangents_active() || !(has_tangent(inputs) || ...)) return;
  BasicTensor<T> t = [&] {
    TangentRuleScope computing;
    return rule(tangent_of(inputs)...);
  }();
  if (t.defined()) set_tangent(y, std::move(t));
}

/// push_tangent for an op reading a list of tensors: rule(their tangents, undefined where none).
template <class T, class Rule>
void push_tangent_list(BasicTensor<T>& y, const Rule& rule, const std::vector<BasicTensor<T>>& inputs) {
  if (!tangents_active() || std::none_of(inputs.begin(), inputs.end(), [](const auto& x) { return has_tangent(x); }))
    return;
  BasicTensor<T> t = [&] {
    TangentRuleScope computing;
    std::vector<BasicTensor<T>> tangents;
    for (const BasicTensor<T>& x : inputs) tangents.push_back(tangent_of(x));
    return rule(tangents);
  }();
  if (t.defined()) set_tangent(y, std::move(t));
}

}  // namespace detail

/// RAII: a dual level (PyTorch's forward_ad.dual_level): tangents exist while it lives, and every
/// tangent set inside it is cleared when it ends. One at a time per thread, as in PyTorch.
class dual_level {
 public:
  /// Opens the thread's dual level (a remat::Error if one is open already).
  dual_level() {
    detail::Session& s = detail::session();
    REMAT_CHECK(s.dual_level == nullptr, "dual_level: a dual level is already open on this thread (they do not nest)");
    s.dual_level = &state_;
    ++detail::dual_levels_open();
  }
  /// Clears every tangent set inside it and closes it.
  ~dual_level() {
    state_.clear_all();
    detail::session().dual_level = nullptr;
    --detail::dual_levels_open();
  }
  dual_level(const dual_level&) = delete;
  dual_level& operator=(const dual_level&) = delete;

 private:
  detail::DualLevelState state_;
};

/// A view of `primal` (its storage, and its graph: gradients pass through to it) carrying
/// `tangent` inside the open dual level (PyTorch's forward_ad.make_dual).
template <class T>
BasicTensor<T> make_dual(const BasicTensor<T>& primal, const BasicTensor<T>& tangent) {
  static_assert(detail::is_floating_dtype<T>, "make_dual: only floating-point tensors have tangents");
  REMAT_CHECK(detail::session().dual_level != nullptr, "make_dual: no dual level is open (use remat::dual_level)");
  REMAT_CHECK(primal.defined() && tangent.defined(), "make_dual: the primal and the tangent must be defined");
  REMAT_CHECK(primal.shape() == tangent.shape(), "make_dual: tangent of shape {} for a primal of shape {}",
              tangent.shape(), primal.shape());
  REMAT_CHECK(!detail::has_tangent(primal), "make_dual: the primal of shape {} already has a tangent at this level",
              primal.shape());
  BasicTensor<T> dual(primal.storage(), primal.shape());
  if (detail::grad_needed(primal))
    detail::record<T>("make_dual", {primal}, {&dual}, {}, [](detail::BackwardContext<T>& ctx) {
      ctx.create_graph();  // dy passes to the primal as it is, with or without a graph
      ctx.accumulate(0, ctx.grad_output());
    });
  detail::set_tangent(dual, tangent.detach());
  return dual;
}

/// t's tangent at the open dual level, or an undefined tensor (PyTorch's unpack_dual(t).tangent).
template <class T>
BasicTensor<T> tangent(const BasicTensor<T>& t) {
  return detail::tangent_of(t);
}

/// The outputs of f(primals) and their Jacobian-vector products along `tangents` (one per primal,
/// each of its shape), as torch.func.jvp: every op f runs carries the tangents forward by its
/// rule as it runs, and nothing is kept for a backward. f takes the primals as a
/// vector and returns a tensor or a vector of tensors; an output that does not depend on them
/// gets a zero tangent. The outputs keep their graphs (gradients pass through to the primals).
template <class T, class F>
std::pair<std::vector<BasicTensor<T>>, std::vector<BasicTensor<T>>> jvp(F&& f, const std::vector<BasicTensor<T>>& primals,
                                                                      const std::vector<BasicTensor<T>>& tangents) {
  REMAT_CHECK(primals.size() == tangents.size(), "jvp: {} primals but {} tangents", primals.size(), tangents.size());
  for (std::size_t i = 0; i < primals.size(); ++i)
    REMAT_CHECK(primals[i].defined() && tangents[i].defined() && primals[i].shape() == tangents[i].shape(),
                "jvp: tangent {} has shape {}, its primal {}", i, tangents[i].shape(), primals[i].shape());
  dual_level level;
  std::vector<BasicTensor<T>> duals;
  for (std::size_t i = 0; i < primals.size(); ++i) duals.push_back(make_dual(primals[i], tangents[i]));
  std::vector<BasicTensor<T>> outputs;
  if constexpr (std::is_same_v<std::decay_t<std::invoke_result_t<F&, const std::vector<BasicTensor<T>>&>>,
                               BasicTensor<T>>)
    outputs.push_back(f(duals));
  else
    outputs = f(duals);
  std::vector<BasicTensor<T>> out_tangents;
  for (const BasicTensor<T>& y : outputs) {
    out_tangents.push_back(detail::tangent_of(y));
    if (!out_tangents.back().defined()) {
      out_tangents.back() = BasicTensor<T>(y.shape());
      detail::flat(out_tangents.back()).setZero();
    }
  }
  return {std::move(outputs), std::move(out_tangents)};
}

/// jvp of a function of one tensor: {f(x), J·v}.
template <class T, class F, class = std::enable_if_t<std::is_invocable_v<F&, const BasicTensor<T>&>>>
std::pair<BasicTensor<T>, BasicTensor<T>> jvp(F&& f, const BasicTensor<T>& x, const BasicTensor<T>& v) {
  auto [outputs, tangents] =
      jvp([&](const std::vector<BasicTensor<T>>& xs) { return BasicTensor<T>(f(xs[0])); }, std::vector<BasicTensor<T>>{x},
          std::vector<BasicTensor<T>>{v});
  return {outputs[0], tangents[0]};
}

}  // namespace remat
