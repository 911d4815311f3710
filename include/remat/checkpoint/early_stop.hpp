#pragma once
// Early stop: a replay computes the op outputs its backward reads and no further. Past the last
// one (SegmentReads::last_needed, learnt in forward) the ops still run and record their nodes —
// the graph must route gradients through them — but produce their outputs without computing them:
// in a GPT block that is the MLP's output projection, its dropout and the residual add. A segment
// whose ops save nothing computes nothing when replayed. PyTorch stops its (non-reentrant)
// recomputation at the same point; this is the same saving for a replay that builds its own graph.
//
// The rule's one assumption: a backward reads only tensors reported as saved (an op's saved list,
// or report_saved_for_backward). Code that holds tensors for later in another way runs under
// ComputeAll (the chain executor does, for its snapshots); checking replayed values
// (CheckpointChecking, check_values) turns early stop off, since it reads every output.

#include <cstddef>
#include <vector>

#include "remat/core/op_output.hpp"
#include "remat/core/session.hpp"

namespace remat {
namespace detail {

inline EarlyStopStats& early_stop_stats() { return session().early_stop_stats; }

/// Early stop for a replay, for the decider of its scope (run_parts.hpp): from position
/// last_needed + 1 on, ops skip their compute.
class EarlySkip {
 public:
  explicit EarlySkip(std::ptrdiff_t last_needed, bool on = true) : last_needed_(on ? last_needed : kNever) {}

  bool skip(const OpOutput& out) {
    if (static_cast<std::ptrdiff_t>(out.position) <= last_needed_) return false;
    ++skipped_;
    skipped_flops_ += out.flops;
    ++early_stop_stats().ops;
    early_stop_stats().flops += out.flops;
    return true;
  }

  std::size_t skipped() const { return skipped_; }
  double skipped_flops() const { return skipped_flops_; }

 private:
  static constexpr std::ptrdiff_t kNever = static_cast<std::ptrdiff_t>(~std::size_t{0} >> 1);
  std::ptrdiff_t last_needed_;
  std::size_t skipped_ = 0;
  double skipped_flops_ = 0;
};

/// A barrier scope: every op in it computes, whatever an enclosing replay would skip; for code
/// that keeps tensors for later outside any saved list (the chain executor's snapshots).
class ComputeAll {
 private:
  RunScope scope_{nullptr, true};
};

}  // namespace detail

/// RAII: checkpoints and chains whose forward runs while it lives will stop their replays early
/// (on, the default) or replay every op (off) — PyTorch's set_checkpoint_early_stop, which is
/// also read when the forward runs.
class CheckpointEarlyStop {
 public:
  /// on: stop replays early (the default); off: replay every op.
  explicit CheckpointEarlyStop(bool on) : guard_(on) {}

 private:
  detail::Install<&detail::Session::early_stop> guard_;
};

/// Op outputs skipped by early stop on this thread since the start (count and their flops).
inline detail::EarlyStopStats early_stop_stats() { return detail::early_stop_stats(); }

}  // namespace remat
