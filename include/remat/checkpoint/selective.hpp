#pragma once
// Selective checkpointing: inside a checkpoint, a save policy chooses the op outputs that are kept
// rather than recomputed (PyTorch's selective activation checkpointing, JAX's checkpoint_dots).
// During the segment's forward a listener of its run scope stashes the outputs the policy keeps;
// during the replay the scope's decider hands them back, at the same positions, instead of letting
// the ops compute them again. Every op reports to its scope, so every op can be kept (with what
// its backward needs: layer_norm's statistics, attention's log-sum-exp).

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "remat/checkpoint/error.hpp"
#include "remat/core/op_output.hpp"
#include "remat/ops/attention.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/ops/linear.hpp"
#include "remat/ops/matmul.hpp"

namespace remat {

/// Which op outputs a checkpoint keeps instead of recomputing; an empty policy keeps none.
using SavePolicy = std::function<bool(const OpOutput& output)>;

/// Save policies for selective checkpointing: which op outputs a checkpoint keeps instead of recomputing.
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

///@{
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
///@}

/// Keep the outputs of the matrix products (matmul, linear): the expensive ops; element-wise ops,
/// softmax and norms are recomputed. JAX calls this checkpoint_dots.
inline SavePolicy matmuls() { return ops(std::vector<OpId>{op::matmul, op::linear}); }

/// Keep what production policies keep most: the matrix products and the fused attention (whose
/// output and log-sum-exp are a small fraction of its cost to recompute).
inline SavePolicy matmuls_and_attention() {
  return ops(std::vector<OpId>{op::matmul, op::linear, op::causal_attention, op::causal_self_attention});
}

}  // namespace save_policy

namespace detail {

/// One op invocation whose outputs a segment's forward kept: its position among the op outputs
/// the segment reported, which op it was, and how many tensors it made.
struct KeptOp {
  std::size_t position;
  OpId op;
  std::size_t count;
};

/// Listens to a segment's forward: stashes the outputs its policy keeps, with their positions. The
/// policy is asked once, here; the replay follows these decisions by position.
class SelectiveStash final : public ScopeListener {
 public:
  SelectiveStash(const SavePolicy& policy, std::vector<KeptOp>& ops, std::vector<SavedTensor>& values)
      : policy_(policy), ops_(ops), values_(values) {}

  void produced(const OpOutput& out, const std::vector<TensorRef>& values) override {
    if (!policy_(out)) return;
    ops_.push_back({out.position, out.op, values.size()});
    for (const TensorRef& v : values) values_.emplace_back(v);
  }
  void saved(const std::vector<SavedTensor>&) override {}

 private:
  const SavePolicy& policy_;
  std::vector<KeptOp>& ops_;
  std::vector<SavedTensor>& values_;
};

/// A segment's replay, for the decider of its scope (run_parts.hpp): hands back what the forward
/// kept, at the positions it kept them, and checks that the op there is the op the forward kept.
class SelectiveReuse {
 public:
  SelectiveReuse(const std::vector<KeptOp>& ops, const std::vector<SavedTensor>& values, const std::string& segment)
      : ops_(ops), values_(values), segment_(segment) {}

  std::vector<TensorRef> reuse(const OpOutput& out) {
    if (next_op_ >= ops_.size() || ops_[next_op_].position != out.position) return {};
    const KeptOp& kept = ops_[next_op_];
    if (kept.op != out.op || kept.count != out.count)
      throw CheckpointError(fmt::format("checkpoint '{}': the replay's op #{} is '{}' (output {}), but the forward kept "
                                        "the outputs of '{}' (output {}) there; the segment ran different ops when "
                                        "replayed", segment_, out.position, out.op.name(), out.shape, kept.op.name(),
                                        values_[next_value_].shape()));
    std::vector<TensorRef> refs;
    for (std::size_t i = 0; i < kept.count; ++i) refs.push_back(values_[next_value_ + i].ref(out.op.name()));
    if (refs[0].shape != out.shape)
      throw CheckpointError(fmt::format("checkpoint '{}': replay of '{}' (op #{}) expects shape {} but forward kept {}; "
                                        "the segment ran differently when replayed", segment_, out.op.name(),
                                        out.position, out.shape, refs[0].shape));
    ++next_op_;
    next_value_ += kept.count;
    return refs;
  }
  /// Kept positions the replay never reached (it made `ops` ops): it ran fewer ops than the forward.
  void check_all_used(std::size_t ops) const {
    if (next_op_ < ops_.size())
      throw CheckpointError(fmt::format("checkpoint '{}': the forward kept the outputs of '{}' at op #{}, but the replay "
                                        "ran only {} ops; the segment ran different ops when replayed", segment_,
                                        ops_[next_op_].op.name(), ops_[next_op_].position, ops));
  }

 private:
  const std::vector<KeptOp>& ops_;
  const std::vector<SavedTensor>& values_;
  const std::string& segment_;
  std::size_t next_op_ = 0, next_value_ = 0;
};

}  // namespace detail
}  // namespace remat
