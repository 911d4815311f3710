#pragma once
// What a chain notes about each step at its first execution — the generator state, the output
// shape, how far an early-stopped replay must go — stored as runs, so a chain of a million equal
// steps holds a handful of entries instead of a million. A run is a stretch of steps whose values
// follow one rule: equal (shapes, stop positions), or an arithmetic progression (the generator's
// offset advances by the same count each step when every step draws the same random numbers).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/random.hpp"
#include "remat/core/shape.hpp"

namespace remat::detail {

/// Values indexed by step, appended in step order, as runs of steps sharing one value.
template <class T>
class Runs {
 public:
  /// Appends a step that starts a run of its own.
  void start(T v) { runs_.push_back({size_++, std::move(v)}); }
  /// Appends a step with the value of the one before.
  void extend() {
    REMAT_ASSERT(!runs_.empty());
    ++size_;
  }
  const T& operator[](std::size_t i) const {
    auto it = std::upper_bound(runs_.begin(), runs_.end(), i, [](std::size_t k, const Run& r) { return k < r.first; });
    return std::prev(it)->value;
  }
  std::size_t size() const { return size_; }
  std::size_t runs() const { return runs_.size(); }

 protected:
  const T* last() const { return runs_.empty() ? nullptr : &runs_.back().value; }

 private:
  struct Run {
    std::size_t first;
    T value;
  };
  std::vector<Run> runs_;
  std::size_t size_ = 0;
};

/// Runs of equal values: each appended value extends the run when it equals the last.
template <class T>
class EqualRuns : public Runs<T> {
 public:
  void push_back(const T& v) {
    if (const T* l = this->last(); l && *l == v) this->extend();
    else this->start(v);
  }
};

/// Generator states by step: runs with one seed whose offsets advance by a fixed stride.
class StateRuns {
 public:
  void push_back(const Generator::State& s) {
    if (!runs_.empty()) {
      Run& r = runs_.back();
      const std::size_t n = size_ - r.first;  // states in the run so far
      const std::uint64_t expected = r.offset + r.stride * n;
      if (s.seed == r.seed && (n == 1 ? s.offset >= r.offset : s.offset == expected)) {
        if (n == 1) r.stride = s.offset - r.offset;
        ++size_;
        return;
      }
    }
    runs_.push_back({size_, s.seed, s.offset, 0});
    ++size_;
  }
  Generator::State operator[](std::size_t i) const {
    auto it = std::upper_bound(runs_.begin(), runs_.end(), i, [](std::size_t k, const Run& r) { return k < r.first; });
    const Run& r = *std::prev(it);
    return {r.seed, r.offset + r.stride * (i - r.first)};
  }
  std::size_t size() const { return size_; }
  std::size_t runs() const { return runs_.size(); }

 private:
  struct Run {
    std::size_t first;
    std::uint64_t seed, offset, stride;
  };
  std::vector<Run> runs_;
  std::size_t size_ = 0;
};

}  // namespace remat::detail
