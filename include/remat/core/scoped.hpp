#pragma once
// A value guard for state outside the thread's session (a generator's state during a replay, a
// wrapper's own flag): set on entry, put back on exit, also when an exception leaves the scope.
// The session's slots have their own guard, detail::Install (core/session.hpp).

#include <utility>

namespace remat {

/// Sets `slot` to `value` for the guard's lifetime and restores the previous value after.
template <class T>
class ScopedValue {
 public:
  /// Saves slot's value and sets it to `value`.
  ScopedValue(T& slot, T value) : slot_(slot), previous_(std::move(slot)) { slot_ = std::move(value); }
  ~ScopedValue() { slot_ = std::move(previous_); }
  ScopedValue(const ScopedValue&) = delete;
  ScopedValue& operator=(const ScopedValue&) = delete;

 private:
  T& slot_;
  T previous_;
};

}  // namespace remat
