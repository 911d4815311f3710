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
// pack and unpack run outside any graph (no grad, no run scopes or observers, no hooks),
// so the ops they call are not part of the model. A pack that returns an empty std::any declines,
// and the hooks outside it are asked next (unlike PyTorch, where a hook must return something to
// unpack): a store that takes only some tensors — large ones, activations but not parameters —
// says no to the rest this way, and stores nest (an Offload inside a MemoryBudget: what the
// offload declines the budget keeps). A tensor every store declines stays with its node, in
// remat's books, as without hooks. unpack must give back a tensor of the saved
// shape and element type (a remat::Error naming the op otherwise), with the values a correct
// gradient needs: remat checks only that an unpack returning the very storage it was given has not
// been written in place since. What pack keeps is out of remat's books (memory_stats() counts
// tensor bytes in RAM only), and a checkpointed forward records no nodes, so packs nothing.
//
// A store that chooses by who saves (selective checkpointing's question: which op, how many bytes,
// which element type) takes a pack of two arguments, the tensor and a SaveContext; a third,
// optional function describes a packed tensor for print_saved_tensors() ("on disk at …").

#include <any>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/core/session.hpp"

namespace remat {

/// What keeps a tensor for backward.
enum class SavedBy {
  op,          ///< an op's node (its inputs, outputs or intermediates)
  checkpoint,  ///< a checkpoint's node: the segment's boundary and the outputs selective saving keeps
  chain,       ///< a chain executor's snapshot of a step's state (held in RAM)
};

/// Who is saving the tensor a pack hook is handed.
struct SaveContext {
  std::string_view op;          ///< the op's name; a checkpoint's name; "chain snapshot"
  SavedBy by = SavedBy::op;     ///< what kind of holder keeps it (an op's node, a checkpoint, a chain)
};

namespace detail {

/// One pack/unpack pair, shared with every node that packed through it (so unpack outlives the
/// scope that installed it).
struct SavedTensorHooksPair {
  std::function<std::any(const AnyTensor&, const SaveContext&)> pack;
  std::function<AnyTensor(const std::any&)> unpack;
  std::function<std::string(const std::any&)> describe;  // may be empty
  // A store's two further answers (PackedTensor: pin, state), for stores remat builds on the seam.
  std::function<std::shared_ptr<void>(const std::any&)> pin;  // may be empty
  std::function<PackedState(const std::any&)> state;         // may be empty
};

/// The pairs a node recorded now asks to pack, innermost last; none inside a pack or an unpack.
inline const std::vector<std::shared_ptr<const SavedTensorHooksPair>>* active_saved_tensor_hooks() {
  const Session& s = session();
  return s.saved_tensor_hooks_off == 0 && !s.saved_tensor_hooks.empty() ? &s.saved_tensor_hooks : nullptr;
}

}  // namespace detail

/// RAII: while it lives, the tensors recorded nodes save on this thread go through pack and unpack.
class SavedTensorHooks {
 public:
  /// What a node keeps instead of the tensor (a copy, a file name, anything).
  using Pack = std::function<std::any(const AnyTensor&)>;
  /// The same, told who saves the tensor.
  using PackWithContext = std::function<std::any(const AnyTensor&, const SaveContext&)>;
  /// The tensor again, from what pack returned.
  using Unpack = std::function<AnyTensor(const std::any&)>;
  /// Where a packed tensor is, in words, for print_saved_tensors().
  using Describe = std::function<std::string(const std::any&)>;
  /// The pair as installed.
  using Pair = detail::SavedTensorHooksPair;

  /// Installs pack and unpack on this thread until destroyed (innermost hooks in force pack).
  SavedTensorHooks(Pack pack, Unpack unpack)
      : installed_(make_pair(pack ? PackWithContext([p = std::move(pack)](const AnyTensor& t, const SaveContext&) {
                               return p(t);
                             })
                                  : PackWithContext(),
                             std::move(unpack), {})) {}
  /// The same with a pack told who saves, and (optionally) a description of what it packed.
  SavedTensorHooks(PackWithContext pack, Unpack unpack, Describe describe = {})
      : installed_(make_pair(std::move(pack), std::move(unpack), std::move(describe))) {}
  /// A store built on the seam with every answer it gives (a memory budget: pin and state too).
  explicit SavedTensorHooks(Pair pair)
      : installed_(make_pair(std::move(pair.pack), std::move(pair.unpack), std::move(pair.describe), std::move(pair.pin),
                             std::move(pair.state))) {}
  SavedTensorHooks(const SavedTensorHooks&) = delete;
  SavedTensorHooks& operator=(const SavedTensorHooks&) = delete;

 private:
  static std::shared_ptr<const Pair> make_pair(PackWithContext pack, Unpack unpack, Describe describe,
                                               decltype(Pair::pin) pin = {}, decltype(Pair::state) state = {}) {
    REMAT_CHECK(pack && unpack, "SavedTensorHooks: both pack and unpack must be callable");
    return std::make_shared<const Pair>(
        Pair{std::move(pack), std::move(unpack), std::move(describe), std::move(pin), std::move(state)});
  }

  detail::Install<&detail::Session::saved_tensor_hooks> installed_;
};

}  // namespace remat
