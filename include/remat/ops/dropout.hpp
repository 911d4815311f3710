#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "remat/core/random.hpp"
#include "remat/core/threads.hpp"
#include "remat/core/produce.hpp"
#include "remat/ops/detail/dropout_draw.hpp"
#include "remat/ops/detail/dtype.hpp"

namespace remat {
namespace op {
/// The id of dropout(x, p): elements zeroed with probability p, the rest scaled by 1 / (1 - p).
inline const OpId dropout = register_op("dropout", tangent_rule);
}  // namespace op

namespace detail {

/// out_i = in_i * scale where the i-th uniform of the draw at `state` is ≥ p, else 0, following
/// the generator's element rule (detail::for_each_uniform24): pieces of the mask are independent,
/// so it is computed in parallel, is the same on any thread count, and the same state rebuilds it.
template <class T>
void apply_dropout_mask(const T* in, T* out, std::int64_t n, float p, T scale, Generator::State state) {
  const auto blocks = static_cast<std::int64_t>(uniform24_blocks(static_cast<std::uint64_t>(n)));
  parallel_for(blocks, kDropoutGrain / 4, [&](std::int64_t b0, std::int64_t b1) {
    for_each_uniform24_run(state, static_cast<std::uint64_t>(4 * b0), static_cast<std::uint64_t>(std::min(4 * b1, n)),
                           [in, out, p, scale](std::uint64_t i, const float* u, std::uint64_t m) {
                             const T* x = in + i;
                             T* y = out + i;
                             // x[j] is read whether kept or not, and p and scale are copies: a
                             // load under the condition, or through a reference a store to y
                             // might change, keeps the compiler from vectorising the loop.
                             for (std::uint64_t j = 0; j < m; ++j) {
                               const T kept = x[j] * scale;
                               y[j] = u[j] >= p ? kept : T(0);
                             }
                           });
  });
}

/// Which elements the last draw kept, inside a dual level on this thread: forward mode applies a
/// mask to a value and to its tangent, and hvp's backward applies attention's to two values and
/// their tangents, so one draw, rebuilt once and read from here, serves each of them (the bits of
/// apply_dropout_mask). Draws above kKeepCacheElements are rebuilt each time instead.
struct DropoutKeepCache {
  static constexpr std::int64_t kKeepCacheElements = std::int64_t{1} << 22;  // 4 MB of flags at most
  Generator::State state{};
  float threshold = -1.0f;
  std::int64_t n = -1;
  std::vector<std::uint8_t> keep;
};

inline DropoutKeepCache& dropout_keep_cache() {
  thread_local DropoutKeepCache cache;
  return cache;
}

/// apply_dropout_mask through this thread's DropoutKeepCache.
template <class T>
void apply_dropout_mask_cached(const T* in, T* out, std::int64_t n, float p, T scale, Generator::State state) {
  DropoutKeepCache& c = dropout_keep_cache();
  if (c.n != n || c.threshold != p || !(c.state == state)) {
    c.keep.resize(static_cast<std::size_t>(n));
    std::uint8_t* keep = c.keep.data();
    const auto blocks = static_cast<std::int64_t>(uniform24_blocks(static_cast<std::uint64_t>(n)));
    parallel_for(blocks, kDropoutGrain / 4, [&](std::int64_t b0, std::int64_t b1) {
      for_each_uniform24_run(state, static_cast<std::uint64_t>(4 * b0), static_cast<std::uint64_t>(std::min(4 * b1, n)),
                             [keep, p](std::uint64_t i, const float* u, std::uint64_t m) {
                               for (std::uint64_t j = 0; j < m; ++j) keep[i + j] = u[j] >= p;
                             });
    });
    c.n = n;
    c.threshold = p;
    c.state = state;
  }
  const std::uint8_t* keep = c.keep.data();
  parallel_for(n, kElementGrain, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const T kept = in[i] * scale;
      out[i] = keep[i] ? kept : T(0);
    }
  });
}

/// x with `draw`'s mask applied, kept elements scaled: dropout's forward and, the map being
/// linear, its backward too, which a backward that records its ops (create_graph) records as
/// this same op (its gradient, again the mask).
template <class T>
BasicTensor<T> apply_dropout(const BasicTensor<T>& x, const DropoutDraw<T>& draw) {
  const std::int64_t n = x.numel();
  BasicTensor<T> y = produce<T>(op::dropout, x.shape(), static_cast<double>(n), {x}, [=] {
    BasicTensor<T> out(x.shape());
    if (session().dual_level != nullptr && n <= DropoutKeepCache::kKeepCacheElements)
      apply_dropout_mask_cached(x.data(), out.data(), n, draw.threshold, draw.scale, draw.at_entry);
    else
      apply_dropout_mask(x.data(), out.data(), n, draw.threshold, draw.scale, draw.at_entry);
    return out;
  });
  if (grad_needed(x))
    record<T>(op::dropout, {x}, {&y}, {}, [draw, n](BackwardContext<T>& ctx) {
      if (ctx.create_graph()) return ctx.accumulate(0, apply_dropout(ctx.grad_output(), draw));
      BasicTensor<T> dx(ctx.grad_output().shape());
      apply_dropout_mask(ctx.grad_output().data(), dx.data(), n, draw.threshold, draw.scale, draw.at_entry);
      ctx.accumulate(0, std::move(dx));
    });
  push_tangent(y, [&](const BasicTensor<T>& t) { return apply_dropout(t, draw); }, x);  // the same mask, no new draw
  return y;
}

}  // namespace detail

/// Training: y = x ⊙ m / (1 - p), m_i ~ Bernoulli(1 - p) drawn from `gen`; evaluation or p = 0:
/// y = x.  dx = dy ⊙ m / (1 - p).
/// Saves: only the generator state at entry (two integers): backward regenerates the mask, and a
/// checkpoint replay that restores the state draws the very same mask.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> dropout(const BasicTensor<T>& x, double p, bool training = true, Generator& gen = default_generator()) {
  if constexpr (detail::routed<T>()) return detail::route([&](const auto& a) { return remat::dropout(a, p, training, gen); }, x);
  else {
    REMAT_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got {}", p);
    if (!training || p == 0.0) return x;
    return detail::apply_dropout(x, detail::DropoutDraw<T>(p, static_cast<std::uint64_t>(x.numel()), gen));
  }
}

}  // namespace remat
