#pragma once
// The run scope of a replayed computation, its decider and its listeners, put together in one
// place for checkpoint() and for chain steps alike, in both runs (the first, in forward, and each
// replay):
//
//   first run:  listeners  SelectiveStash (a segment's kept outputs), SegmentReadsListener (what
//               its backward reads), CompactRecorder (what a chain step's backward reads)
//   replay:     decider    reuse: SelectiveReuse (kept outputs) or CompactRebuild (held ones);
//                          skip:  CompactRebuild (everything else), or EarlySkip (past what the
//                          backward reads)
//
// One decider per scope, composed here and nowhere else (RunDecider); the listeners hear the
// scope's own ops and saves, by position, whatever nests inside (core/op_output.hpp has the
// scope rules). The debug trace is an observer (DebugOpTrace): it hears every op.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "remat/checkpoint/compact_records.hpp"
#include "remat/checkpoint/early_stop.hpp"
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/checkpoint/selective.hpp"
#include "remat/checkpoint/trace.hpp"
#include "remat/core/error.hpp"
#include "remat/core/op_output.hpp"

namespace remat::detail {

class RunParts {
 public:
  RunParts() = default;
  RunParts(const RunParts&) = delete;
  RunParts& operator=(const RunParts&) = delete;

  // --- a first run's listeners -------------------------------------------------------------------
  /// Stashes the outputs `policy` keeps (into `ops` and `values`); nothing when the policy is empty.
  void stash(const SavePolicy& policy, std::vector<KeptOp>& ops, std::vector<SavedTensor>& values) {
    if (!policy) return;
    scope_.listen(stash_.emplace(policy, ops, values));
  }
  /// Notes what the run's backward reads into `into`.
  void reads(SegmentReads& into) { scope_.listen(reads_.emplace(into)); }
  /// Notes which op outputs a chain step's backward reads, `input` being the step's input.
  const CompactRecorder& recorder(const Storage* input) {
    scope_.listen(recorder_.emplace(input));
    return *recorder_;
  }

  // --- a replay's decisions ----------------------------------------------------------------------
  /// Hands back what the forward kept, by position.
  const SelectiveReuse& reuse_kept(const std::vector<KeptOp>& ops, const std::vector<SavedTensor>& values,
                                   const std::string& segment) {
    REMAT_ASSERT(!rebuild_);
    return selective_.emplace(ops, values, segment);
  }
  /// Rebuilds a compactly held step: its held outputs handed back, every other op skipped.
  const CompactRebuild& rebuild(const CompactRecords::Step& step, std::uint64_t ops, std::string who) {
    REMAT_ASSERT(!selective_);
    scope_.listen(rebuild_.emplace(step, ops, std::move(who)));
    return *rebuild_;
  }
  /// Skips the ops past `last_needed` (when `on`).
  void stop_after(std::ptrdiff_t last_needed, bool on = true) { skip_.emplace(last_needed, on); }

  /// The debug trace of this run into `into` (an observer, so any time).
  void trace(std::vector<TracedOp>& into) { trace_.emplace(into); }

  /// Ops made in the run's scope so far.
  std::size_t ops() const { return scope_.ops(); }

 private:
  /// The one decider of the run's scope, from the parts above.
  class RunDecider final : public OpOutputHook {
   public:
    explicit RunDecider(RunParts& h) : OpOutputHook(Unscoped{}), h_(h) {}
    std::vector<TensorRef> reuse(const OpOutput& out) override {
      if (h_.selective_) return h_.selective_->reuse(out);
      if (h_.rebuild_) return h_.rebuild_->reuse(out);
      return {};
    }
    bool skip(const OpOutput& out) override {
      if (h_.rebuild_) return true;  // nothing else of a rebuilt step is read
      return h_.skip_ && h_.skip_->skip(out);
    }

   private:
    RunParts& h_;
  };

  std::optional<SelectiveReuse> selective_;
  std::optional<CompactRebuild> rebuild_;
  std::optional<EarlySkip> skip_;
  RunDecider decider_{*this};
  RunScope scope_{&decider_};
  // Listeners, after the scope: destroyed first.
  std::optional<SelectiveStash> stash_;
  std::optional<SegmentReadsListener> reads_;
  std::optional<CompactRecorder> recorder_;
  std::optional<DebugOpTrace> trace_;
};

}  // namespace remat::detail
