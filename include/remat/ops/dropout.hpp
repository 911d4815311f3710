#pragma once
#include "remat/core/random.hpp"
#include "remat/core/threads.hpp"
#include "remat/core/tape.hpp"

namespace remat {
namespace detail {

/// out_i = in_i * scale where the i-th uniform of the stream at `state` is ≥ p, else 0. Element i
/// uses block state.offset + i/4 of the counter-based stream, so blocks are independent: the mask
/// is computed in parallel and is the same on any thread count, and the same state rebuilds it.
template <class T>
void apply_dropout_mask(const T* in, T* out, std::int64_t n, float p, T scale, Generator::State state) {
  const std::int64_t blocks = (n + 3) / 4;
  const std::array<std::uint32_t, 2> key{static_cast<std::uint32_t>(state.seed), static_cast<std::uint32_t>(state.seed >> 32)};
  REMAT_PRAGMA_OMP(omp parallel for schedule(static) if (blocks > 8192))
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::uint64_t c = state.offset + static_cast<std::uint64_t>(b);
    const auto bits = philox4x32_10({static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32), 0u, 0u}, key);
    for (std::int64_t k = 0; k < 4 && 4 * b + k < n; ++k) {
      const std::int64_t i = 4 * b + k;
      const float u = static_cast<float>(bits[static_cast<std::size_t>(k)] >> 8) * 0x1.0p-24f;
      out[i] = u >= p ? in[i] * scale : T(0);
    }
  }
}

}  // namespace detail

/// Training: y = x ⊙ m / (1 - p), m_i ~ Bernoulli(1 - p) drawn from `gen`; evaluation or p = 0:
/// y = x.  dx = dy ⊙ m / (1 - p).
/// Saves: only the generator state at entry (two integers): backward regenerates the mask, and a
/// checkpoint replay that restores the state draws the very same mask.
template <class T>
BasicTensor<T> dropout(const BasicTensor<T>& x, double p, bool training = true, Generator& gen = default_generator()) {
  REMAT_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got {}", p);
  if (!training || p == 0.0) return x;
  const Generator::State at_entry = gen.state();
  const T scale = p < 1.0 ? static_cast<T>(1.0 / (1.0 - p)) : T(0);
  const auto pf = static_cast<float>(p);
  const std::int64_t n = x.numel();
  BasicTensor<T> y(x.shape());
  detail::apply_dropout_mask(x.data(), y.data(), n, p < 1.0 ? pf : 2.0f, scale, at_entry);
  gen.set_state({gen.seed(), gen.state().offset + static_cast<std::uint64_t>((n + 3) / 4)});
  if (detail::grad_needed(x))
    detail::record<T>("dropout", {x}, {&y}, {}, [at_entry, pf, p, scale, n](detail::BackwardContext<T>& ctx) {
      BasicTensor<T> dx(ctx.grad_output().shape());
      detail::apply_dropout_mask(ctx.grad_output().data(), dx.data(), n, p < 1.0 ? pf : 2.0f, scale, at_entry);
      ctx.accumulate(0, std::move(dx));
    });
  return y;
}

}  // namespace remat
