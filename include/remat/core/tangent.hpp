#pragma once
// Where a tensor's tangent lives (forward mode): in its autograd metadata, set inside an open dual
// level, which clears every tangent set in it when it ends. The graph code carries a tangent
// across a metadata swap (record() making an op's outputs require grad); core/forward_ad.hpp
// builds dual levels, tangent rules and jvp on this.

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

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

/// Sets y's tangent.
template <class T>
void set_tangent(BasicTensor<T>& y, BasicTensor<T> tangent) {
  REMAT_ASSERT(tangent.shape() == y.shape());
  if (!y.meta()) y.set_meta(std::make_shared<AutogradMeta<T>>());
  set_tangent(y.meta(), std::move(tangent));
}

}  // namespace remat::detail
