#pragma once
// The op-output handlers of a replayed computation, installed in one order for checkpoint() and
// for chain steps alike, in both runs (the first, in forward, and each replay). The innermost
// handler hears each op first; the order, outermost to innermost, is
//
//   first run:  SelectiveHook (stash)  ->  SegmentReadsObserver  ->  CompactRecorder
//   replay:     SelectiveHook (reuse) or CompactRebuilder  ->  ReplaySkipper
//
// and why: the selective hook owns its segment's outputs (it passes none outward), so the reads
// observer, which counts op positions, sits inside it; the reads observer passes outward only the
// saves of tensors from outside the segment, and the compact recorder must hear every save, so it
// is innermost. In a replay the owner of the outputs hands kept ones back by the positions the
// first run counted, and the skipper, inside it, counts the same positions. The debug trace is an
// observer (DebugOpTrace): it hears every op whatever the handlers decide, so it has no place here.
//
// Slots are filled outermost first (an assertion says so); what is not filled is not installed.

#include <optional>
#include <utility>

#include "remat/checkpoint/compact_records.hpp"
#include "remat/checkpoint/early_stop.hpp"
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/checkpoint/selective.hpp"
#include "remat/checkpoint/trace.hpp"
#include "remat/core/error.hpp"

namespace remat::detail {

class RunHandlers {
 public:
  RunHandlers() = default;
  RunHandlers(const RunHandlers&) = delete;
  RunHandlers& operator=(const RunHandlers&) = delete;

  template <class... A>
  SelectiveHook& selective(A&&... a) {
    in_order(0);
    return selective_.emplace(std::forward<A>(a)...);
  }
  template <class... A>
  CompactRebuilder& rebuilder(A&&... a) {
    in_order(1);
    return rebuilder_.emplace(std::forward<A>(a)...);
  }
  SegmentReadsObserver& reads(SegmentReads& into) {
    in_order(2);
    return reads_.emplace(into);
  }
  ReplaySkipper& skipper(std::ptrdiff_t last_needed, bool on = true) {
    in_order(3);
    return skipper_.emplace(last_needed, on);
  }
  CompactRecorder& recorder(const Storage* input) {
    in_order(4);
    return recorder_.emplace(input);
  }
  /// The debug trace of this run into `into` (an observer, so any time).
  void trace(std::vector<TracedOp>& into) { trace_.emplace(into); }

 private:
  void in_order(int slot) {
    REMAT_ASSERT(slot > filled_);  // outermost first: a handler installed later is inside
    filled_ = slot;
  }

  // Declared outermost first: constructed in this order, destroyed innermost first.
  std::optional<SelectiveHook> selective_;
  std::optional<CompactRebuilder> rebuilder_;
  std::optional<SegmentReadsObserver> reads_;
  std::optional<ReplaySkipper> skipper_;
  std::optional<CompactRecorder> recorder_;
  std::optional<DebugOpTrace> trace_;
  int filled_ = -1;
};

}  // namespace remat::detail
