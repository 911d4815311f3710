#pragma once
// Mixed precision: remat::autocast, PyTorch's torch.autocast("cpu", dtype=torch.bfloat16). While a
// guard lives on a thread, float32 matrix products take bfloat16 copies of their operands on the
// bfloat16 GEMM (core/gemm.hpp's gemm_bf16) and sum in float32; their outputs are float32 tensors
// holding bfloat16 values (rounded once, as PyTorch's bfloat16 outputs), and what their nodes save
// for backward is the bfloat16 copies (half the bytes). Any node that saves such an output — GELU
// after a linear layer, say — keeps it in 16 bits too, at no loss (pack_saved). Backward multiplies
// in bfloat16 too (the output gradient narrowed, float32 sums), as PyTorch's autocast backward does.
//
// The ops it changes: matmul (every form: 2-D, batched, transposed operands), linear, and the
// fused attention's products (causal_attention, causal_self_attention: q kᵀ and P v, and in
// backward dY Vᵀ, Pdᵀ dY, dS K, dSᵀ Q; their softmax and its backward stay float32).
// Everything else runs in float32 as before — layer norm, softmax, log-softmax, cross-entropy,
// reductions, element-wise ops — which is PyTorch's CPU list for the numerically delicate ops. Double tensors never change (gradient checks stay exact). Parameters,
// their gradients and the optimizer's state stay float32: only the products' operands are cast.
//
// A checkpointed segment and a chain step replay under the autocast state their forward ran
// under, whatever is in force when backward runs (backward outside the guard, as in PyTorch, is
// the usual pattern), so their gradients are bitwise those of the run without checkpointing.
//
// Parameters are cast once per step. The outermost guard owns a cache of the bfloat16 copies of
// the leaves that require grad and existed before it (the parameters; PyTorch's autocast caches
// the leaves that require grad): a weight
// used by several products, by a chain's every step, or again by each replay of a checkpointed
// segment is narrowed once, and a replay reads the very copy its forward read. The cache lives as
// long as the outermost guard and every segment or chain that will replay under it, so with
// backward outside the guard it goes when the step's backward has released the last of them; the
// copies are ordinary tensors, in the memory books on the parameters' side (half the float32
// parameters' bytes at most; memory_stats().saved_parameter_bytes when nodes save them). A parameter written in place (an optimizer step inside a long-lived guard) is
// narrowed again at its next use: an entry is reused only while its storage's version is unchanged.
// The price is memory: under checkpointing, where a segment's forward keeps nothing, the copies are
// held from the forward to the segment's replay, which can be more than the activations a fine
// policy keeps. autocast(true, /*cache_enabled=*/false) trades them for a cast at every use (what
// PyTorch does in a recompute, since its cache ends with the autocast region).

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>

#include "remat/core/bfloat16.hpp"
#include "remat/core/cast.hpp"
#include "remat/core/gemm.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/session.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

namespace detail {

/// The bfloat16 copies of one autocast scope's parameters, one per storage, each reused while
/// that storage lives unchanged (same version, same shape).
class AutocastCache {
 public:
  /// What the cache holds and has done.
  struct Stats {
    std::size_t entries = 0;  ///< copies held
    std::size_t bytes = 0;    ///< their bytes
    std::size_t casts = 0;    ///< copies made
    std::size_t reuses = 0;   ///< uses served by a copy made before
  };

  /// Whether t is a parameter to this cache: a leaf that requires grad, made before the scope
  /// began. (A checkpointed forward's outputs also look like leaves that require grad, since it
  /// records no nodes; they are made inside the scope.)
  bool caches(const BasicTensor<float>& t) const {
    return t.requires_grad() && t.is_leaf() && t.storage()->serial() < born_;
  }

  /// The bfloat16 copy of the parameter t: the held one if t is unchanged since it was made.
  BasicTensor<bfloat16> copy_of(const BasicTensor<float>& t) {
    const std::shared_ptr<Storage>& storage = t.storage();
    Entry& e = entries_[storage.get()];
    // An expired source is another storage at a recycled address: never its copy.
    if (!e.source.expired() && e.version == storage->version() && e.copy.shape() == t.shape()) {
      ++stats_.reuses;
      return e.copy;
    }
    e = Entry{storage, storage->version(), cast_copy<bfloat16>(t)};
    e.copy.storage()->mark_parameter();  // alive with the scope, as its parameter is
    ++stats_.casts;
    return e.copy;
  }

  /// The parameter a copy held here was made from, and that parameter's version then.
  struct Source {
    std::weak_ptr<Storage> storage;
    Shape shape;
    std::uint64_t version = 0;
  };
  /// The Source of `copy` if it is one of this cache's copies (a scan: a cache holds one entry per
  /// parameter, and only a checkpointed forward asks, once per product that saves a copy).
  std::optional<Source> source_of(const Storage* copy) const {
    for (const auto& [key, e] : entries_)
      if (e.copy.storage().get() == copy) return Source{e.source, e.copy.shape(), e.version};
    return std::nullopt;
  }

  Stats stats() const {
    Stats s = stats_;
    s.entries = entries_.size();
    for (const auto& [key, e] : entries_) s.bytes += e.copy.nbytes();
    return s;
  }

 private:
  struct Entry {
    std::weak_ptr<Storage> source;
    std::uint64_t version = 0;
    BasicTensor<bfloat16> copy;
  };
  std::unordered_map<const Storage*, Entry> entries_;
  Stats stats_;
  std::uint64_t born_ = next_storage_serial(false);  // storages with lower serials existed before
};

/// Autocast as a replay needs it: on or off, and the scope's parameter casts.
struct AutocastState {
  bool enabled = false;
  std::shared_ptr<AutocastCache> cache;
};

/// This thread's autocast state now.
inline AutocastState autocast_state() { return {session().autocast, session().autocast_cache}; }

/// RAII: this thread's autocast state set to `state` for the guard's lifetime (a replay's).
class InstallAutocast {
 public:
  explicit InstallAutocast(const AutocastState& state) : enabled_(state.enabled), cache_(state.cache) {}

 private:
  Install<&Session::autocast> enabled_;
  Install<&Session::autocast_cache> cache_;
};

/// The cache an autocast guard runs under: none when the guard turns caching off, else the
/// enclosing scope's, or a new one for the outermost guard that enables autocast.
inline std::shared_ptr<AutocastCache> scope_cache(bool enabled, bool cache_enabled) {
  if (!cache_enabled) return nullptr;
  if (session().autocast_cache || !enabled) return session().autocast_cache;
  return std::make_shared<AutocastCache>();
}

}  // namespace detail

/// RAII: matrix products of float32 tensors run in bfloat16 with float32 sums while it lives
/// (enabled), or in float32 (disabled: a region inside an autocast scope that needs full precision).
class autocast {
 public:
  /// Sets this thread's autocast state to `enabled` until the guard goes (then puts it back).
  /// `cache_enabled` (PyTorch's argument of the same name): parameters narrowed once and the
  /// copies kept for the step's replays; false narrows them at every use, replays included, and
  /// keeps nothing beyond what nodes save — less memory under checkpointing, for more casts.
  explicit autocast(bool enabled = true, bool cache_enabled = true)
      : state_({enabled, detail::scope_cache(enabled, cache_enabled)}) {}

 private:
  detail::InstallAutocast state_;
};

/// Whether float32 matrix products run in bfloat16 on this thread now.
inline bool is_autocast_enabled() { return detail::session().autocast; }

/// The parameter casts of this thread's autocast scope (all zero outside one): how many copies it
/// holds and their bytes, how many it made and how many uses reused one.
inline detail::AutocastCache::Stats autocast_cache_stats() {
  const auto& cache = detail::session().autocast_cache;
  return cache ? cache->stats() : detail::AutocastCache::Stats{};
}

namespace detail {

/// Whether products of T tensors are autocast at all: float32 only (double stays exact).
template <class T>
inline constexpr bool kAutocasts = std::is_same_v<T, float>;

/// A float32 operand of a product under autocast, narrowed: a parameter (a leaf that requires
/// grad, made before the scope) through the scope's cache, anything else copied afresh.
inline BasicTensor<bfloat16> autocast_operand(const BasicTensor<float>& t) {
  AutocastCache* cache = session().autocast_cache.get();
  if (cache && cache->caches(t)) return cache->copy_of(t);
  return cast_copy<bfloat16>(t);
}

/// A product's float32 output under autocast, made a bfloat16 value as PyTorch's is (its sums were
/// float32; the result is rounded once): marked so, a node saving it keeps it in 16 bits at no loss
/// (pack_saved), and what reads it computes with the values PyTorch's autocast gives.
inline void round_product_output(BasicTensor<float>& out) {
  float* p = out.data();
  convert_elements(p, p, out.numel(), round_to_bfloat16);
  out.storage()->mark_bfloat16_exact();
}

/// A product's operand in element type E: the tensor itself, or its bfloat16 copy.
template <class E, class T>
BasicTensor<E> as_operand(const BasicTensor<T>& t) {
  if constexpr (std::is_same_v<E, T>) return t;
  else {
    static_assert(std::is_same_v<E, bfloat16> && std::is_same_v<T, float>, "autocast narrows float32 to bfloat16");
    return cast_copy<bfloat16>(t);
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
