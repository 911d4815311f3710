#pragma once
// What remat::grad() needs from the backward walk: leave every .grad as it was. Gradients reach
// leaves by accumulate_grad, as in backward(), because replays and chain steps read what reached
// their own inputs; a capture notes each leaf the walk touches, with its .grad before, and puts it
// back when the walk is over; computed tensors among grad()'s inputs keep what reaches them.

#include <algorithm>
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
    for (auto it = notes_.rbegin(); it != notes_.rend(); ++it) it->restore();
  }

  /// Before the walk first accumulates into leaf `m`: its .grad set aside (the walk starts it from
  /// nothing), to be put back by the destructor.
  template <class T>
  void set_aside(AutogradMeta<T>& m) {
    if (!noted_.insert(&m).second) return;
    std::weak_ptr<AutogradMeta<T>> weak = m.weak_from_this();
    add(weak, &m, [weak, before = std::move(m.grad)] {
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
    add(weak, &m, [weak, before = std::move(m.retained)] {
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
  /// Notes held now (for tests).
  std::size_t size() const { return notes_.size(); }

 private:
  // A walk through a long chain touches a leaf of its own per step reversed (each step's input),
  // gone right after: notes of tensors gone are dropped as the list grows, so it holds about
  // twice the living ones, not one per step.
  static constexpr std::size_t kFirstPrune = 1024;
  struct Note {
    std::weak_ptr<const void> alive;
    const void* key;
    std::function<void()> restore;
  };
  void add(std::weak_ptr<const void> alive, const void* key, std::function<void()> restore) {
    if (notes_.size() >= prune_at_) {
      const auto gone = [this](const Note& n) {
        if (!n.alive.expired()) return false;
        noted_.erase(n.key);  // a new tensor may take its address
        kept_.erase(n.key);
        return true;
      };
      notes_.erase(std::remove_if(notes_.begin(), notes_.end(), gone), notes_.end());
      prune_at_ = std::max(kFirstPrune, 2 * notes_.size());
    }
    notes_.push_back({std::move(alive), key, std::move(restore)});
  }

  std::unordered_set<const void*> noted_;
  std::unordered_set<const void*> kept_;
  std::vector<Note> notes_;
  std::size_t prune_at_ = kFirstPrune;
};

}  // namespace remat::detail
