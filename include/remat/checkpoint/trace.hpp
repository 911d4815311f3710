#pragma once
// The debug op trace (PyTorch's checkpoint debug=True): the sequence of ops a segment ran in its
// forward and in its replay, each with its output shapes. When a replay is found to differ from
// its forward, the error says where the two sequences first part — which op, at which position,
// with which shapes — instead of only which output came out different.

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "remat/core/observer.hpp"
#include "remat/core/op_output.hpp"

namespace remat::detail {

struct TracedOp {
  OpId op;
  std::vector<Shape> shapes;
  friend bool operator==(const TracedOp& a, const TracedOp& b) { return a.op == b.op && a.shapes == b.shapes; }
};

inline std::string describe(const TracedOp& t) {
  return fmt::format("'{}' -> {}", t.op.name(), fmt::join(t.shapes, ", "));
}

/// Appends every op of its scope to a trace. An observer: it hears every op whatever the deciders
/// decide (a nested segment's forward too), so forward and replay traces cover the same ops.
class DebugOpTrace final : public Observer {
 public:
  explicit DebugOpTrace(std::vector<TracedOp>& into) : into_(into) {}
  void op(const OpOutput& out, const OpValues&) override {
    into_.push_back({out.op, std::vector<Shape>(out.shapes, out.shapes + out.count)});
  }

 private:
  std::vector<TracedOp>& into_;
};

/// Where a replay's trace first departs from the forward's, in words (with the ops just before).
inline std::string trace_difference(const std::vector<TracedOp>& forward, const std::vector<TracedOp>& replay) {
  const std::size_t n = std::min(forward.size(), replay.size());
  std::size_t k = 0;
  while (k < n && forward[k] == replay[k]) ++k;
  std::string context;
  for (std::size_t i = k >= 3 ? k - 3 : 0; i < k; ++i) context += fmt::format("\n    #{} {}", i, describe(forward[i]));
  if (!context.empty()) context = "; the ops before it, alike in both:" + context;
  if (k < n)
    return fmt::format("op trace: forward and replay first differ at op #{}: the forward ran {}, the replay ran {}{}", k,
                       describe(forward[k]), describe(replay[k]), context);
  if (forward.size() != replay.size())
    return fmt::format("op trace: the replay {} at op #{} ({} op(s) in forward){}",
                       replay.size() < forward.size() ? fmt::format("stopped before {}", describe(forward[k]))
                                                      : fmt::format("ran the extra op {}", describe(replay[k])),
                       k, forward.size(), context);
  return fmt::format("op trace: forward and replay ran the same {} ops with the same shapes; the difference is in "
                     "values (state the segment reads changed between forward and backward)", n);
}

}  // namespace remat::detail
