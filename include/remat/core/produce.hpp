#pragma once
// How an op makes its outputs: through produce(), which is a plain call when no run scope is
// installed and no observer listens, and otherwise asks the scope's decider (it may hand back
// stored tensors, or skip the compute), then tells the scope and the observers what was made —
// offering observers how to compute it again (core/op_output.hpp). Every op in ops/ makes its
// outputs this way.

#include <algorithm>
#include <array>
#include <limits>
#include <type_traits>
#include <cstddef>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/error.hpp"
#include "remat/core/forward_ad.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/tensor.hpp"
#include "remat/core/timeline.hpp"

namespace remat::detail {

template <class... Ts, std::size_t... I>
std::tuple<BasicTensor<Ts>...> tensors_from_refs(const std::vector<TensorRef>& refs, const char* op,
                                                std::index_sequence<I...>) {
  return {BasicTensor<Ts>::from_ref(refs[I], op)...};
}

template <class T>
BasicTensor<T> unread_tensor(const Shape& shape) {
  BasicTensor<T> t(shape);
  if constexpr (is_floating_dtype<T>) std::fill_n(t.data(), t.numel(), std::numeric_limits<T>::quiet_NaN());
  else std::fill_n(t.data(), t.numel(), T(0));
  return t;
}

template <class... Ts, std::size_t... I>
std::tuple<BasicTensor<Ts>...> make_unread(const std::array<Shape, sizeof...(Ts)>& shapes, std::index_sequence<I...>) {
  return {unread_tensor<Ts>(shapes[I])...};
}

/// An op's outputs (a tuple of tensors) as type-erased references, for deciders and listeners.
template <class... Ts>
std::vector<TensorRef> refs_of(const std::tuple<BasicTensor<Ts>...>& outputs) {
  return std::apply([](const auto&... t) { return std::vector<TensorRef>{t.ref()...}; }, outputs);
}

/// The tensors an op's compute reads (undefined ones are ignored): whoever recomputes the op later
/// keeps them, and makes them resident first. Holds pointers into the caller's tensors, so it
/// lives only as long as the produce() call it is passed to.
class OpReads {
 public:
  template <class... Us>
  OpReads(const BasicTensor<Us>&... ts) {  // NOLINT: implicit, so ops write {x, w}
    static_assert(sizeof...(Us) <= kInline, "OpReads: pass more tensors as a std::vector");
    (add(ts.storage()), ...);
    if (tangents_active()) tangent_ = (has_tangent(ts) || ...);
  }
  template <class U>
  OpReads(const std::vector<BasicTensor<U>>& ts) {  // NOLINT
    for (const BasicTensor<U>& t : ts) more_.push_back(&t.storage());
    if (tangents_active())
      for (const BasicTensor<U>& t : ts) tangent_ = tangent_ || has_tangent(t);
  }
  /// Whether a read tensor carries a tangent (forward mode): the op must have a tangent rule.
  bool tangent() const { return tangent_; }
  /// Calls f(storage) for each read tensor's (defined) storage.
  template <class F>
  void for_each(F f) const {
    for (std::size_t i = 0; i < n_; ++i) f(*inline_[i]);
    for (const std::shared_ptr<Storage>* p : more_)
      if (*p) f(*p);
  }

 private:
  static constexpr std::size_t kInline = 4;
  void add(const std::shared_ptr<Storage>& s) {
    if (s) inline_[n_++] = &s;
  }
  // Pointers into the caller's tensors: no copies, no allocation on an op's path when nobody listens.
  std::array<const std::shared_ptr<Storage>*, kInline> inline_{};
  std::size_t n_ = 0;
  bool tangent_ = false;
  std::vector<const std::shared_ptr<Storage>*> more_;
};

template <class Compute>
Recompute make_recompute(const OpReads& reads, const Compute& compute, std::uint64_t first_new_serial) {
  Recompute how;
  how.first_new_serial = first_new_serial;
  std::vector<long> before;
  reads.for_each([&](const std::shared_ptr<Storage>& s) {
    if (std::find(how.reads.begin(), how.reads.end(), s) != how.reads.end()) return;
    how.reads.push_back(s);
    before.push_back(s.use_count());
  });
  how.compute = [c = compute]() {
    return refs_of(c());
  };
  for (std::size_t i = 0; i < how.reads.size(); ++i)
    how.held_by_compute.push_back(static_cast<int>(how.reads[i].use_count() - before[i]));
  return how;
}

/// The Recompute of one op invocation, made only if an observer takes it.
template <class Compute>
class OfferedRecompute final : public RecomputeOffer {
 public:
  OfferedRecompute(const OpReads& reads, const Compute& compute, std::uint64_t first_new_serial)
      : reads_(reads), compute_(compute), first_new_serial_(first_new_serial) {}
  Recompute take() const override { return make_recompute(reads_, compute_, first_new_serial_); }

 private:
  const OpReads& reads_;
  const Compute& compute_;
  std::uint64_t first_new_serial_;
};

/// The outputs of `op` (element types Ts..., shapes `shapes`): compute() — which returns them as a
/// tuple — unless a decider supplies them; the run scope and observers see what was made, and
/// observers are offered how to compute it again. `work` is the op's estimate of its work; `reads`
/// are the tensors compute reads. compute captures by value: an observer may keep a copy and run it
/// again later (a memory budget recomputing a discarded output).
template <class... Ts, class Compute>
std::tuple<BasicTensor<Ts>...> produce_all(OpId op, const std::array<Shape, sizeof...(Ts)>& shapes, OpWork work,
                                           const OpReads& reads, Compute&& compute) {
  if (reads.tangent()) require_tangent_rule(op);
  RunScope* scope = RunScope::current();
  if (!scope && !observers_listening()) {
    TimelineSpan span(op.name(), "forward");
    return compute();
  }
  constexpr std::size_t n = sizeof...(Ts);
  const std::array<const char*, n> dtypes{dtype_name<Ts>()...};
  const std::array<std::size_t, n> sizes{sizeof(Ts)...};
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < n; ++i) bytes += static_cast<std::size_t>(shapes[i].numel()) * sizes[i];
  OpOutput out{op, shapes[0], dtypes[0], n, bytes, work.flops, is_replaying(), shapes.data(), dtypes.data()};
  out.inner_elements = work.inner_elements;
  out.began_serial = next_storage_serial(false);
  if (scope) out.position = scope->ops();
  // The scope hears the op first, then the observers.
  auto made = [&](const std::vector<TensorRef>& values) {
    if (scope) scope->produced(out, values);
    notify([&](Observer& o) { o.op(out, values); });
  };
  notify([&](Observer& o) { o.op_begin(out); });
  if (OpOutputHook* decider = scope ? scope->decider() : nullptr) {
    if (const std::vector<TensorRef> supplied = decider->reuse(out); !supplied.empty()) {
      REMAT_CHECK(supplied.size() == n, "{}: a decider supplied {} outputs where the op makes {}", op.name(),
                  supplied.size(), n);
      for (std::size_t i = 0; i < n; ++i)
        REMAT_CHECK(supplied[i].shape == shapes[i],
                    "{}: a decider supplied output {} of shape {} where shape {} is computed", op.name(), i,
                    supplied[i].shape, shapes[i]);
      auto result = tensors_from_refs<Ts...>(supplied, op.name(), std::index_sequence_for<Ts...>{});
      made(supplied);
      return result;
    }
  }
  if (scope && scopes_skip(out, scope)) {
    // Nobody reads these values: storage of the right shapes, poisoned (NaN for floating types),
    // so a reader that was not supposed to exist shows up instead of reading stale bytes.
    auto result = make_unread<Ts...>(shapes, std::index_sequence_for<Ts...>{});
    made(refs_of(result));
    return result;
  }
  const std::uint64_t first_new_serial = next_storage_serial(false);
  std::tuple<BasicTensor<Ts>...> result = [&] {
    OpOutputHook::Suspended quiet;
    QuietObservers quiet_observers;
    TimelineSpan span(op.name(), "forward");
    return compute();
  }();
  const OfferedRecompute<std::decay_t<Compute>> offer(reads, compute, first_new_serial);
  out.recompute = &offer;
  made(refs_of(result));
  return result;
}

/// produce_all for an op with one output.
template <class T, class Compute>
BasicTensor<T> produce(OpId op, const Shape& shape, OpWork work, const OpReads& reads, Compute&& compute) {
  if (reads.tangent()) require_tangent_rule(op);
  if (!RunScope::current() && !observers_listening()) {
    TimelineSpan span(op.name(), "forward");
    return compute();
  }
  return std::get<0>(produce_all<T>(op, {shape}, work, reads, [compute] { return std::tuple<BasicTensor<T>>(compute()); }));
}

}  // namespace remat::detail
