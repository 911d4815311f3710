#pragma once
// Mixed precision: remat::autocast, PyTorch's torch.autocast("cpu", dtype=torch.bfloat16). While a
// guard lives on a thread, float32 matrix products take bfloat16 copies of their operands on the
// bfloat16 GEMM (core/gemm.hpp's gemm_bf16) and sum in float32; their outputs stay float32, and
// what their nodes save for backward is the bfloat16 copies (half the bytes). Backward multiplies
// in bfloat16 too (the output gradient narrowed, float32 sums), as PyTorch's autocast backward does.
//
// The ops it changes, today: matmul (every form: 2-D, batched, transposed operands) and linear.
// Everything else runs in float32 as before — layer norm, softmax, log-softmax, cross-entropy,
// reductions, element-wise ops, the fused attention — which is PyTorch's CPU list for the
// numerically delicate ops. Double tensors never change (gradient checks stay exact). Parameters,
// their gradients and the optimizer's state stay float32: only the products' operands are cast.
//
// A checkpointed segment and a chain step replay under the autocast state their forward ran
// under, whatever is in force when backward runs (backward outside the guard, as in PyTorch, is
// the usual pattern), so their gradients are bitwise those of the run without checkpointing.

#include <type_traits>

#include "remat/core/bfloat16.hpp"
#include "remat/core/gemm.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

/// RAII: matrix products of float32 tensors run in bfloat16 with float32 sums while it lives
/// (enabled), or in float32 (disabled: a region inside an autocast scope that needs full precision).
class autocast {
 public:
  /// Sets this thread's autocast state to `enabled` until the guard goes (then puts it back).
  explicit autocast(bool enabled = true) : guard_(enabled) {}

 private:
  detail::Install<&detail::Session::autocast> guard_;
};

/// Whether float32 matrix products run in bfloat16 on this thread now.
inline bool is_autocast_enabled() { return detail::session().autocast; }

namespace detail {

/// Whether products of T tensors are autocast at all: float32 only (double stays exact).
template <class T>
inline constexpr bool kAutocasts = std::is_same_v<T, float>;

/// The bfloat16 copy of a float32 tensor (round to nearest even), without history: the operand a
/// product under autocast multiplies and saves.
inline BasicTensor<bfloat16> bfloat16_copy(const BasicTensor<float>& t) {
  BasicTensor<bfloat16> out(t.shape());
  convert_elements(t.cdata(), out.data(), t.numel(), narrow_to_bfloat16);
  return out;
}

/// A product's operand in element type E: the tensor itself, or its bfloat16 copy.
template <class E, class T>
BasicTensor<E> as_operand(const BasicTensor<T>& t) {
  if constexpr (std::is_same_v<E, T>) return t;
  else {
    static_assert(std::is_same_v<E, bfloat16> && std::is_same_v<T, float>, "autocast narrows float32 to bfloat16");
    return bfloat16_copy(t);
  }
}

/// gemm over bfloat16 operands: float32 sums into a float32 C (gemm_bf16), so products written
/// once over an operand type E serve both precisions.
inline void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a,
                 std::int64_t lda, const bfloat16* b, std::int64_t ldb, float* c, std::int64_t ldc,
                 bool accumulate = false) {
  gemm_bf16(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace detail
}  // namespace remat
