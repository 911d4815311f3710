#pragma once
// Where a tensor's tangent lives (forward mode): in its autograd metadata, set inside an open dual
// level, which clears every tangent set in it when it ends. The graph code carries a tangent
// across a metadata swap (record() making an op's outputs require grad); core/forward_ad.hpp
// builds dual levels, tangent rules and jvp on this.

#include <atomic>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

/// Dual levels open in the process, counted so that an op reads its thread's session only while
/// one is (relaxed: a hint; the session decides).
inline std::atomic<int>& dual_levels_open() {
  static std::atomic<int> open{0};
  return open;
}

/// Whether ops on this thread propagate tangents now: a dual level is open and no rule is computing.
inline bool tangents_active() {
  if (dual_levels_open().load(std::memory_order_relaxed) == 0) return false;
  const Session& s = session();
  return s.dual_level != nullptr && s.tangents_off == 0;
}

/// An open dual level: what to clear when it ends (the tangents set inside it).
struct DualLevelState {
  std::vector<std::function<void()>> clear;
};

template <class T>
bool has_tangent(const BasicTensor<T>& t) {
  return t.meta() && t.meta()->tangent.defined();
}

/// Sets the tangent of the tensors sharing `meta` (inside the open dual level, which clears it
/// when it ends).
template <class T>
void set_tangent(const std::shared_ptr<AutogradMeta<T>>& meta, BasicTensor<T> tangent) {
  Session& s = session();
  REMAT_ASSERT(s.dual_level != nullptr);
  meta->tangent = std::move(tangent);
  s.dual_level->clear.push_back([held = std::weak_ptr<AutogradMeta<T>>(meta)] {
    if (auto m = held.lock()) m->tangent = BasicTensor<T>();
  });
}

/// a + b for two terms of a tangent, either of which may be undefined (an input without one).
template <class T>
BasicTensor<T> tangent_sum(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  REMAT_ASSERT(a.shape() == b.shape());
  BasicTensor<T> sum(a.shape());
  flat(sum) = flat(a) + flat(b);
  return sum;
}

/// t's tangent, or an undefined tensor.
template <class T>
BasicTensor<T> tangent_of(const BasicTensor<T>& t) {
  return has_tangent(t) ? t.meta()->tangent : BasicTensor<T>();
}

/// Sets y's tangent.
template <class T>
void set_tangent(BasicTensor<T>& y, BasicTensor<T> tangent) {
  REMAT_ASSERT(tangent.shape() == y.shape());
  if (!y.meta()) y.set_meta(std::make_shared<AutogradMeta<T>>());
  set_tangent(y.meta(), std::move(tangent));
}

}  // namespace remat::detail
