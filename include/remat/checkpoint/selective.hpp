#pragma once
// Selective checkpointing: inside a checkpoint, a save policy chooses the op outputs that are kept
// rather than recomputed (PyTorch's selective activation checkpointing, JAX's checkpoint_dots).
// It listens on the op-output hook of core: during the segment's forward it stashes the outputs
// the policy keeps; during the replay it hands them back, in the same order, instead of letting
// the ops compute them again. Any op that reports through the hook can be kept.

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "remat/checkpoint/error.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/ops/linear.hpp"
#include "remat/ops/matmul.hpp"

namespace remat {

/// Which op outputs a checkpoint keeps instead of recomputing; an empty policy keeps none.
using SavePolicy = std::function<bool(const OpOutput& output)>;

namespace save_policy {

/// Keep nothing inside the segment: full recompute (the default).
inline SavePolicy nothing() { return {}; }

/// Keep the outputs of the listed ops.
inline SavePolicy ops(std::vector<OpId> keep) {
  return [keep = std::move(keep)](const OpOutput& out) {
    for (const OpId& op : keep)
      if (op == out.op) return true;
    return false;
  };
}

/// Keep the outputs of the ops with these names; a name no op has is a remat::Error listing the
/// known ones (so a typo cannot silently keep nothing).
inline SavePolicy ops(const std::vector<std::string>& names) {
  std::vector<OpId> keep;
  for (const std::string& n : names) keep.push_back(find_op(n, "save_policy::ops"));
  return ops(std::move(keep));
}
inline SavePolicy ops(std::initializer_list<const char*> names) {
  return ops(std::vector<std::string>(names.begin(), names.end()));
}

/// Keep the outputs of the matrix products (matmul, linear): the expensive ops; element-wise ops,
/// softmax and norms are recomputed. JAX calls this checkpoint_dots.
inline SavePolicy matmuls() { return ops(std::vector<OpId>{op::matmul, op::linear}); }

}  // namespace save_policy

namespace detail {

/// The selective-checkpointing handler of one segment, installed for a forward (stash) or a replay
/// (reuse). It owns the op outputs of its scope: nothing reaches an enclosing segment's handler,
/// so a nested segment's ops never touch the outer segment's stash.
class SelectiveHook final : public OpOutputHook {
 public:
  enum class Mode { off, stash, reuse };
  SelectiveHook(Mode mode, const SavePolicy& policy, std::vector<SavedTensor>& kept, const std::string& segment)
      : mode_(policy ? mode : Mode::off), policy_(policy), kept_(kept), segment_(segment) {}

  TensorRef reuse(const OpOutput& out) override {
    if (mode_ != Mode::reuse || !policy_(out)) return {};
    if (next_ >= kept_.size())
      throw CheckpointError(fmt::format("checkpoint '{}': replay asks for a kept '{}' output beyond the {} kept in "
                                        "forward; the segment ran different ops when replayed", segment_,
                                        out.op.name(), kept_.size()));
    const SavedTensor& kept = kept_[next_++];
    if (kept.shape() != out.shape)
      throw CheckpointError(fmt::format("checkpoint '{}': replay of '{}' expects shape {} but forward kept {}; the "
                                        "segment ran differently when replayed", segment_, out.op.name(), out.shape,
                                        kept.shape()));
    return kept.ref(out.op.name());
  }
  void produced(const OpOutput& out, const TensorRef& value) override {
    if (mode_ == Mode::stash && policy_(out)) kept_.emplace_back(value);
  }

 private:
  Mode mode_;
  const SavePolicy& policy_;
  std::vector<SavedTensor>& kept_;
  const std::string& segment_;
  std::size_t next_ = 0;
};

}  // namespace detail
}  // namespace remat
