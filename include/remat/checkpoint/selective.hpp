#pragma once
// Selective checkpointing: inside a checkpoint, a save policy names the ops whose outputs are kept
// rather than recomputed (PyTorch's selective activation checkpointing, JAX's checkpoint_dots).
// Ops that can be kept call compute_or_reuse(); during the segment's forward it stashes their
// outputs, during replay it hands them back in the same order instead of computing them again.

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/tape.hpp"

namespace remat {

/// Raised when a checkpointed segment replays differently from its forward, or is misused.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// Which op outputs a checkpoint keeps instead of recomputing; an empty policy keeps none.
using SavePolicy = std::function<bool(std::string_view op)>;

namespace save_policy {

/// Keep nothing inside the segment: full recompute (the default).
inline SavePolicy nothing() { return {}; }
/// Keep the outputs of the matrix products (matmul, linear): the expensive ops; element-wise ops,
/// softmax and norms are recomputed. JAX calls this checkpoint_dots.
inline SavePolicy matmuls() {
  return [](std::string_view op) { return op == "matmul" || op == "linear"; };
}
/// Keep the outputs of the named ops: matmul, linear, softmax and the element-wise unary ops
/// (exp, log, sqrt, pow, tanh, sigmoid, relu, gelu, gelu_tanh, ...) can be kept.
inline SavePolicy ops(std::vector<std::string> names) {
  return [names = std::move(names)](std::string_view op) {
    for (const std::string& n : names)
      if (n == op) return true;
    return false;
  };
}

}  // namespace save_policy

namespace detail {

struct SelectiveState {
  enum class Mode { off, stash, reuse };
  Mode mode = Mode::off;
  const SavePolicy* policy = nullptr;
  std::vector<SavedTensor>* kept = nullptr;  // stash: appended to; reuse: read from `next`
  std::size_t next = 0;
  const std::string* segment = nullptr;
};

inline SelectiveState& selective_state() {
  thread_local SelectiveState state;
  return state;
}

/// Installs a segment's selective state for a scope and restores the enclosing one after; every
/// checkpoint installs its own, so a nested segment's ops never touch the outer segment's stash.
class SelectiveScope {
 public:
  explicit SelectiveScope(SelectiveState state) : previous_(selective_state()) { selective_state() = state; }
  ~SelectiveScope() { selective_state() = previous_; }
  SelectiveScope(const SelectiveScope&) = delete;
  SelectiveScope& operator=(const SelectiveScope&) = delete;

 private:
  SelectiveState previous_;
};

/// Runs `compute` unless the current segment's policy keeps `op`'s output, in which case forward
/// stashes the result and replay returns the stashed tensor. Only float32 outputs are kept.
template <class T, class Compute>
BasicTensor<T> compute_or_reuse(const char* op, const Shape& shape, Compute compute) {
  SelectiveState& s = selective_state();
  if (s.mode == SelectiveState::Mode::off || !std::is_same_v<T, float> || !*s.policy || !(*s.policy)(op))
    return compute();
  if (s.mode == SelectiveState::Mode::stash) {
    BasicTensor<T> y = compute();
    s.kept->emplace_back(y);
    return y;
  }
  if (s.next >= s.kept->size())
    throw CheckpointError(fmt::format("checkpoint '{}': replay asks for a kept '{}' output beyond the {} kept in "
                                      "forward; the segment ran different ops when replayed", *s.segment, op,
                                      s.kept->size()));
  const SavedTensor& kept = (*s.kept)[s.next++];
  if (kept.shape() != shape)
    throw CheckpointError(fmt::format("checkpoint '{}': replay of '{}' expects shape {} but forward kept {}; the "
                                      "segment ran differently when replayed", *s.segment, op, shape, kept.shape()));
  return kept.template get<T>(op);
}

}  // namespace detail
}  // namespace remat
