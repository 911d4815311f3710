#pragma once
// What remat::grad() needs from the backward walk: leave every .grad as it was. Gradients reach
// leaves by accumulate_grad, as in backward(), because replays and chain steps read what reached
// their own inputs; a capture notes each leaf the walk touches, with its .grad before, and puts it
// back when the walk is over; computed tensors among grad()'s inputs keep what reaches them.

#include <functional>
#include <memory>
#include <unordered_set>
#include <vector>

#include "remat/core/tensor.hpp"

namespace remat::detail {

class GradCapture {
 public:
  GradCapture() = default;
  GradCapture(const GradCapture&) = delete;
  GradCapture& operator=(const GradCapture&) = delete;
  /// Every leaf noted gets its .grad back (those still alive), newest note last undone first.
  ~GradCapture() {
    for (auto it = restores_.rbegin(); it != restores_.rend(); ++it) (*it)();
  }

  /// Before the walk first accumulates into leaf `m`: its .grad set aside (the walk starts it from
  /// nothing), to be put back by the destructor.
  template <class T>
  void set_aside(AutogradMeta<T>& m) {
    if (!noted_.insert(&m).second) return;
    std::weak_ptr<AutogradMeta<T>> weak = m.weak_from_this();
    restores_.push_back([weak, before = std::move(m.grad)] {
      if (auto alive = weak.lock()) alive->grad = before;
    });
    m.grad = BasicTensor<T>();
  }

  /// A computed tensor whose gradient grad() returns: what its node receives is kept as a retained
  /// gradient would be (from nothing; the user's retained one is put back by the destructor).
  template <class T>
  void keep(AutogradMeta<T>& m) {
    if (!kept_.insert(&m).second) return;
    std::weak_ptr<AutogradMeta<T>> weak = m.weak_from_this();
    restores_.push_back([weak, before = std::move(m.retained)] {
      if (auto alive = weak.lock()) {
        alive->retained = before;
        // What reached it but not its node (recorded on a tape the walk did not run, or a walk
        // that threw) is not sent on by a later backward.
        alive->grad = BasicTensor<T>();
      }
    });
    m.retained = BasicTensor<T>();
  }
  /// Whether a node's output `m` keeps what it receives during this walk: only grad()'s inputs do
  /// (a tensor the user retains the gradient of is left as it was).
  bool keeps(const void* m) const { return kept_.count(m) > 0; }

 private:
  std::unordered_set<const void*> noted_;
  std::unordered_set<const void*> kept_;
  std::vector<std::function<void()>> restores_;
};

}  // namespace remat::detail
