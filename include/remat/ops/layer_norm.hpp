#pragma once
// layer_norm over the last dim.
//
// Derivation (one row x of length C; μ = mean(x), v = mean((x − μ)²), r = (v + eps)^{−1/2},
// x̂ = (x − μ) r, y = x̂ ⊙ w + b; write g = dy ⊙ w, the gradient arriving at x̂):
//   ∂μ/∂x_j = 1/C,   ∂v/∂x_j = 2 (x_j − μ)/C,   ∂r/∂x_j = −½ r³ · 2 (x_j − μ)/C = −r² x̂_j / C
//   ∂x̂_i/∂x_j = r (δ_ij − 1/C) + (x_i − μ) ∂r/∂x_j = r (δ_ij − 1/C − x̂_i x̂_j / C)
//   dx_j = Σ_i g_i ∂x̂_i/∂x_j = r (g_j − mean(g) − x̂_j mean(g ⊙ x̂))
//   dw = Σ_rows dy ⊙ x̂,   db = Σ_rows dy.
// Saves: x, w and two scalars per row (μ and r): x̂ is rebuilt from them in backward, which costs
// one pass over x but not the (rows, C) x̂ itself.
#include <cmath>

#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/detail/reduce.hpp"

namespace remat {
namespace op {
inline const OpId layer_norm = register_op("layer_norm");
}  // namespace op


/// Over the last dim of size C, per row:  μ = mean(x), r = 1/√(var(x) + eps) (biased variance),
/// x̂ = (x - μ) r,  y = x̂ ⊙ w + b  (w, b of shape (C,), either may be undefined).
/// Backward, with g = dy ⊙ w:
///   dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy,  dx = r (g - mean(g) - x̂ mean(g ⊙ x̂)).
/// Saves: x, w, and per row μ and r (two scalars a row); x̂ is recomputed from them.
template <class T>
BasicTensor<T> layer_norm(const BasicTensor<T>& x, const BasicTensor<T>& weight, const BasicTensor<T>& bias,
                          double eps = 1e-5) {
  REMAT_CHECK(x.dim() >= 1, "layer_norm: needs a tensor of rank >= 1, got shape {}", x.shape());
  const std::int64_t c = x.size(-1);
  REMAT_CHECK(!weight.defined() || weight.shape() == Shape{c},
              "layer_norm: weight has shape {}, expected ({},) for input {}", weight.shape(), c, x.shape());
  REMAT_CHECK(!bias.defined() || bias.shape() == Shape{c},
              "layer_norm: bias has shape {}, expected ({},) for input {}", bias.shape(), c, x.shape());
  REMAT_CHECK(c > 0, "layer_norm: the normalised dim of shape {} is empty", x.shape());
  const std::int64_t n = x.numel() / c;
  // The per-row statistics are outputs too: whoever keeps y keeps what its backward needs.
  auto [y, mean, rstd] = detail::produce_all<T, T, T>(
      op::layer_norm, {x.shape(), Shape{n}, Shape{n}}, 8.0 * static_cast<double>(x.numel()), [&] {
        BasicTensor<T> out_y(x.shape()), out_mean(Shape{n}), out_rstd(Shape{n});
        const T* px = x.data();
        T* py = out_y.data();
        T* pm = out_mean.data();
        T* pr = out_rstd.data();
        parallel_for(n, std::max<std::int64_t>(1, kElementGrain / c), [&](std::int64_t r0, std::int64_t r1) {
          const std::int64_t rows = r1 - r0;
          detail::ConstRowArrayMap<T> in(px + r0 * c, rows, c);
          detail::RowArrayMap<T> out(py + r0 * c, rows, c);
          detail::ArrayMap<T> mu(pm + r0, rows), r(pr + r0, rows);
          mu = in.rowwise().mean();
          out = in.colwise() - mu;
          r = ((out.square().rowwise().sum() / static_cast<T>(c)) + static_cast<T>(eps)).rsqrt();
          out.colwise() *= r;
          if (weight.defined()) out.rowwise() *= detail::flat(weight).transpose();
          if (bias.defined()) out.rowwise() += detail::flat(bias).transpose();
        });
        return std::make_tuple(out_y, out_mean, out_rstd);
      });

  if (detail::grad_needed(x, weight, bias)) {
    std::vector<detail::SavedTensor> saved{x, mean, rstd};
    if (weight.defined()) saved.emplace_back(weight);
    detail::record<T>(
        op::layer_norm, {x, weight, bias}, {&y}, std::move(saved),
        [c, has_weight = weight.defined()](detail::BackwardContext<T>& ctx) {
          const BasicTensor<T> xv = ctx.saved(0), mv = ctx.saved(1), rv = ctx.saved(2);
          const T* px = xv.data();
          const T* pm = mv.data();
          const T* pr = rv.data();
          const T* pdy = ctx.grad_output().data();
          const std::int64_t n = c ? xv.numel() / c : 0;
          using Vec = detail::ConstArrayMap<T>;
          // x̂ = (x - mean) · rstd, recomputed per row where it is needed (never stored whole).
          auto xhat = [&](std::int64_t i) { return (Vec(px + i * c, c) - pm[i]) * pr[i]; };
          if (ctx.needs_grad(1)) {
            BasicTensor<T> dw(Shape{c});
            detail::column_sums(n, c, dw.data(), [&](std::int64_t i, T* acc) {
              detail::ArrayMap<T>(acc, c) += Vec(pdy + i * c, c) * xhat(i);
            });
            ctx.accumulate(1, std::move(dw));
          }
          if (ctx.needs_grad(2)) {
            BasicTensor<T> db(Shape{c});
            detail::column_sums(n, c, db.data(), [&](std::int64_t i, T* acc) {
              detail::ArrayMap<T>(acc, c) += Vec(pdy + i * c, c);
            });
            ctx.accumulate(2, std::move(db));
          }
          if (ctx.needs_grad(0)) {
            // Per row: dx = ((g - mean(g)) - x̂ · mean(g · x̂)) · rstd, with g = dy · weight.
            const BasicTensor<T> wv = has_weight ? ctx.saved(3) : BasicTensor<T>();
            const T* pw = has_weight ? wv.data() : nullptr;
            const auto inv_c = T(1) / static_cast<T>(c);
            BasicTensor<T> dx(xv.shape());
            T* pdx = dx.data();
            parallel_for(n, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                         [&](std::int64_t r0, std::int64_t r1) {
                           Eigen::Array<T, Eigen::Dynamic, 1> g(c), xh(c);
                           for (std::int64_t i = r0; i < r1; ++i) {
                             g = Vec(pdy + i * c, c);
                             if (pw) g *= Vec(pw, c);
                             xh = xhat(i);
                             const T mean_g = g.sum() * inv_c, mean_gx = (g * xh).sum() * inv_c;
                             detail::ArrayMap<T>(pdx + i * c, c) = ((g - mean_g) - xh * mean_gx) * pr[i];
                           }
                         });
            ctx.accumulate(0, std::move(dx));
          }
        });
  }
  return y;
}

}  // namespace remat
