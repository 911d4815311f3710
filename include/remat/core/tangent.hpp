#pragma once
// Where a tensor's tangent lives (forward mode): in its autograd metadata, set inside an open dual
// level, which clears every tangent set in it when it ends. The graph code carries a tangent
// across a metadata swap (record() making an op's outputs require grad), and drops before a
// backward the tangents no backward will read (DualLevelState::drop_unread); core/forward_ad.hpp
// builds dual levels, tangent rules and jvp on this.

#include <algorithm>
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

/// An open dual level: the tensor identities given a tangent inside it, whose tangents go when it
/// ends. Entries of identities already gone are dropped as the list grows, so a long loop inside
/// one level (a chain of 10^5 steps, each op's output given a tangent) holds only about twice the
/// living ones, not one per op ever run.
///
/// A backward carrying tangents reads a tensor's tangent only through a node that saved something
/// (its formulas run on saved tensors' identities). A tangent whose tensor only nodes hold (its
/// strong references are all their input slots: no user handle, nothing else) and none of them
/// reads is bytes nobody will read: drop_unread() drops it before the walk and before each node of
/// it (a replay's intermediates: a projection's output that a residual sum consumes, say), and marks
/// it, so that a read of it after all is an error, not a zero tangent.
class DualLevelState {
 public:
  /// Notes that `meta` was given a tangent inside this level.
  template <class T>
  void note(const std::shared_ptr<AutogradMeta<T>>& meta) {
    if (set_.size() >= prune_at_) {
      std::size_t kept = 0, kept_swept = 0;
      for (std::size_t i = 0; i < set_.size(); ++i) {
        if (set_[i].meta.expired()) continue;
        if (i < swept_) ++kept_swept;
        if (kept != i) set_[kept] = std::move(set_[i]);
        ++kept;
      }
      set_.resize(kept);
      swept_ = kept_swept;
      prune_at_ = std::max(kFirstPrune, 2 * set_.size());
    }
    set_.push_back({meta,
                    [](void* p) {
                      auto* m = static_cast<AutogradMeta<T>*>(p);
                      m->tangent = BasicTensor<T>();
                      m->tangent_dropped = false;  // a read outside the level finds no tangent, as any
                    },
                    [](void* p, long strong) {
                      auto* m = static_cast<AutogradMeta<T>*>(p);
                      if (!m->tangent.defined() || m->tangent_readers > 0 || strong != m->tangent_holders) return;
                      m->tangent = BasicTensor<T>();
                      m->tangent_dropped = true;
                    }});
  }
  /// Drops the tangents no backward reads (above): of every entry (`all`), or of those noted since
  /// the last call (each looked at once: one a user still held then keeps its tangent).
  void drop_unread(bool all) {
    for (std::size_t i = all ? 0 : swept_; i < set_.size(); ++i)
      if (const std::shared_ptr<void> m = set_[i].meta.lock()) set_[i].drop_unread(m.get(), m.use_count() - 1);
    swept_ = set_.size();
  }
  /// Runs f when the level ends, before its tangents are cleared: what keeps tangents outside any
  /// tensor's metadata (a chain's snapshots of its states' tangents, which may be files) lets
  /// them go then, since no backward after the level reads a tangent.
  void at_end(std::function<void()> f) { at_end_.push_back(std::move(f)); }
  /// Clears every tangent noted (the level ends).
  void clear_all() {
    for (const std::function<void()>& f : at_end_) f();
    at_end_.clear();
    for (const Entry& e : set_)
      if (const std::shared_ptr<void> m = e.meta.lock()) e.clear(m.get());
    set_.clear();
  }
  /// Entries held now (for tests).
  std::size_t size() const { return set_.size(); }

 private:
  static constexpr std::size_t kFirstPrune = 1024;
  struct Entry {
    std::weak_ptr<void> meta;
    void (*clear)(void*);
    void (*drop_unread)(void*, long strong_references);
  };
  std::vector<Entry> set_;
  std::vector<std::function<void()>> at_end_;
  std::size_t swept_ = 0;  // entries before it were looked at by drop_unread
  std::size_t prune_at_ = kFirstPrune;
};

template <class T>
bool has_tangent(const BasicTensor<T>& t) {
  if (!t.meta()) return false;
  REMAT_CHECK(!t.meta()->tangent_dropped, "forward mode: the tangent of a tensor of shape {} was dropped as one no "
              "backward reads (only nodes held it, none saving anything), and is read now: a node that reads an "
              "input's tangent must save something (core/tangent.hpp)", t.shape());
  return t.meta()->tangent.defined();
}

/// Sets the tangent of the tensors sharing `meta` (inside the open dual level, which clears it
/// when it ends).
template <class T>
void set_tangent(const std::shared_ptr<AutogradMeta<T>>& meta, BasicTensor<T> tangent) {
  Session& s = session();
  REMAT_ASSERT(s.dual_level != nullptr);
  meta->tangent = std::move(tangent);
  meta->tangent_dropped = false;
  s.dual_level->note(meta);
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

/// t cut from the graph, its tangent kept: forward mode carries on through the cut (a checkpoint's
/// outputs, a chain's states).
template <class T>
BasicTensor<T> detach_keeping_tangent(const BasicTensor<T>& t) {
  BasicTensor<T> cut = t.detach();
  if (has_tangent(t)) set_tangent(cut, t.meta()->tangent);
  return cut;
}

}  // namespace remat::detail
