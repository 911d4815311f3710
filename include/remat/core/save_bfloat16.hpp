#pragma once
// SaveInBFloat16: activations saved for backward in 16 bits while the forward computes in float32
// — a saved-tensor store on the one seam every way of keeping an activation goes through
// (core/saved_tensor_hooks.hpp), not a hook bolted onto ops.
//
// While a scope lives on a thread, each float32 tensor a recorded node saves (a checkpoint's
// boundary included; a chain's snapshots, the states its replays start from, not) is kept as its
// bfloat16 rounding, and backward reads it widened back to
// float32: half the bytes, at a relative error of at most 2⁻⁸ per saved element (round to nearest
// even). That is lossy, unlike autocast's saved product operands, which are the very values the
// forward multiplied: here the forward computed with the float32 value and the backward computes
// with its rounding, so gradients move (README's Mixed precision section gives the measured
// figures). Tensors that existed before the scope began — parameters, the step's inputs — are
// alive anyway and kept as they are (a copy would add bytes, not save them), and so are tensors
// of other element types and those the predicate turns down: the pack declines them, and their
// nodes hold them in the saved-for-backward books as without the scope.
//
// The rounded copies are ordinary tensors, in memory_stats()'s live bytes; like every packed
// tensor they are out of the saved-for-backward books (saved_bytes), which count what nodes hold
// themselves. Each widened float32 tensor lives while its node's backward runs.

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "remat/core/bfloat16.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/saved_tensor_hooks.hpp"

namespace remat {

/// RAII: float32 tensors saved for backward on this thread are kept in bfloat16 while it lives.
class SaveInBFloat16 {
 public:
  /// Which tensors to round, among the float32 ones made inside the scope (all, by default).
  using Predicate = std::function<bool(const AnyTensor&)>;

  /// What the scope has done.
  struct Stats {
    std::size_t packed = 0;        ///< tensors kept in bfloat16
    std::size_t float32_bytes = 0; ///< their float32 bytes
    std::size_t kept = 0;          ///< saved tensors it left as they were
  };

  /// Rounds every float32 tensor made inside the scope, or those `only` accepts.
  explicit SaveInBFloat16(Predicate only = {})
      : state_(std::make_shared<State>(State{std::move(only), detail::next_storage_serial(false), {}})),
        hooks_([s = state_](const AnyTensor& t, const SaveContext& c) { return pack(*s, t, c); }, unpack) {}

  /// The counts so far (nodes recorded while the scope lived).
  Stats stats() const { return state_->stats; }

 private:
  struct State {
    Predicate only;
    std::uint64_t born;  // storages with lower serials existed before the scope
    Stats stats;
  };

  static std::any pack(State& s, const AnyTensor& t, const SaveContext& context) {
    // A chain's snapshots are the states its replays start from: rounding them would change what
    // the replays compute, not only what backward reads.
    const bool round = context.by != SavedBy::chain && t.is<float>() && t.ref().storage->serial() >= s.born &&
                       (!s.only || s.only(t));
    if (!round) {
      ++s.stats.kept;
      return {};  // declined: the node keeps it as it is, in the books
    }
    ++s.stats.packed;
    s.stats.float32_bytes += t.nbytes();
    return to<bfloat16>(t.as<float>("SaveInBFloat16"));
  }

  static AnyTensor unpack(const std::any& packed) {
    return to<float>(std::any_cast<const BasicTensor<bfloat16>&>(packed));
  }

  std::shared_ptr<State> state_;
  SavedTensorHooks hooks_;
};

}  // namespace remat
