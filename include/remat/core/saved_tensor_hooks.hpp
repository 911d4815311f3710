#pragma once
// Saved-tensor hooks: PyTorch's torch.autograd.graph.saved_tensors_hooks. While a
// SavedTensorHooks lives on a thread, every tensor a recorded node saves for backward is handed to
// `pack`, the node keeps what pack returns instead of the tensor, and backward reads
// `unpack(that)`. A store of your own — compress, cast to 16 bits, offload, count — is these two
// functions:
//
//   remat::SavedTensorHooks hooks(
//       [](const remat::AnyTensor& t) -> std::any { return remat::detail::copy_of(t.as<float>()); },
//       [](const std::any& p) -> remat::AnyTensor { return std::any_cast<const remat::Tensor&>(p); });
//
// The rules, as PyTorch's: the innermost hooks in force when a node is recorded pack its tensors
// (checkpoint boundaries and selectively kept outputs included: a checkpoint's node is a node);
// the node keeps its unpack for as long as it lives, so backward may run after the scope ended;
// pack and unpack run outside any graph (no grad, no op-output handlers or observers, no hooks),
// so the ops they call are not part of the model. unpack must give back a tensor of the saved
// shape and element type (a remat::Error naming the op otherwise), with the values a correct
// gradient needs: remat checks only that an unpack returning the very storage it was given has not
// been written in place since. What pack keeps is out of remat's books (memory_stats() counts
// tensor bytes in RAM only), and a checkpointed forward records no nodes, so packs nothing.

#include <any>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/saved_tensor.hpp"

namespace remat {

/// RAII: while it lives, the tensors recorded nodes save on this thread go through pack and unpack.
class SavedTensorHooks {
 public:
  /// What a node keeps instead of the tensor (a copy, a file name, anything).
  using Pack = std::function<std::any(const AnyTensor&)>;
  /// The tensor again, from what pack returned.
  using Unpack = std::function<AnyTensor(const std::any&)>;

  /// Installs pack and unpack on this thread until destroyed (innermost hooks in force pack).
  SavedTensorHooks(Pack pack, Unpack unpack);
  ~SavedTensorHooks();
  SavedTensorHooks(const SavedTensorHooks&) = delete;
  SavedTensorHooks& operator=(const SavedTensorHooks&) = delete;

  /// The pair, shared with every node that packed through it (so unpack outlives the scope).
  struct Pair {
    Pack pack;      ///< as given
    Unpack unpack;  ///< as given
  };

 private:
  std::shared_ptr<const Pair> pair_;
};

namespace detail {

/// This thread's hooks, innermost last, and whether they are off (inside a pack or unpack).
struct SavedTensorHooksStack {
  std::vector<std::shared_ptr<const SavedTensorHooks::Pair>> pairs;
  int disabled = 0;
  const std::shared_ptr<const SavedTensorHooks::Pair>* active() const {
    return disabled == 0 && !pairs.empty() ? &pairs.back() : nullptr;
  }
};

inline SavedTensorHooksStack& saved_tensor_hooks() {
  thread_local SavedTensorHooksStack stack;
  return stack;
}

}  // namespace detail

inline SavedTensorHooks::SavedTensorHooks(Pack pack, Unpack unpack) {
  REMAT_CHECK(pack && unpack, "SavedTensorHooks: both pack and unpack must be callable");
  pair_ = std::make_shared<const Pair>(Pair{std::move(pack), std::move(unpack)});
  detail::saved_tensor_hooks().pairs.push_back(pair_);
}

inline SavedTensorHooks::~SavedTensorHooks() {
  auto& pairs = detail::saved_tensor_hooks().pairs;
  for (auto it = pairs.end(); it != pairs.begin();)
    if (*--it == pair_) {
      pairs.erase(it);
      break;
    }
}

}  // namespace remat
