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
//
// Recorded (create_graph), the backward is the same formula in tensor ops, with μ and r computed
// again from x by mean, sub, mul, sqrt and rdiv (the saved ones are values without a graph, and
// a second derivative must reach x through them): equal to the fused backward to rounding, not bit
// for bit (its row sums are Eigen's, in another order). Carrying tangents (hvp's backward), it is
// the fused backward, bit for bit, and its gradients' tangents come from one more pass over the
// rows (layer_norm_backward_tangents); the forward's tangent reuses the forward's μ and r.
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/add.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/reduce.hpp"
#include "remat/ops/div.hpp"
#include "remat/ops/mean.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sqrt.hpp"
#include "remat/ops/sub.hpp"

namespace remat {
namespace op {
/// The id of layer_norm(x, weight, bias): normalisation over the last dim, then scale and shift.
inline const OpId layer_norm = register_op("layer_norm", tangent_rule);
}  // namespace op

namespace detail {
/// Whether layer_norm takes parameters of element type P for an input of element type T.
template <class T, class P>
inline constexpr bool layer_norm_params = std::is_same_v<P, T> || (is_bfloat16<T> && std::is_same_v<P, float>);

/// x̂'s tangent on one row, r (tx − mean(tx) − x̂ mean(x̂ tx)), and mean(x̂ tx) (which t(r) needs).
template <class T, class Xhat>
Eigen::Array<T, Eigen::Dynamic, 1> xhat_tangent(const ConstArrayMap<T>& tx, const Xhat& xhat, T r, T inv_c, T& mean_xt) {
  mean_xt = (xhat * tx).sum() * inv_c;
  return ((tx - tx.sum() * inv_c) - xhat * mean_xt) * r;
}

/// The tangents of layer_norm's gradients in a backward carrying tangents (hvp), in one pass over
/// the rows: x (n, c) with its rows' μ and r, w (null: none), dy, and the tangents tdy, tx, tw
/// (null: zero). Per row, with g = dy w, h = g − mean(g) − x̂ mean(g x̂) (so dx = r h):
///   t(x̂) = r (tx − mean(tx) − x̂ mean(x̂ tx)),   t(r) = −r² mean(x̂ tx),   t(g) = tdy w + dy tw,
///   t(dx) = t(r) h + r (t(g) − mean(t(g)) − t(x̂) mean(g x̂) − x̂ (mean(t(g) x̂) + mean(g t(x̂)))),
///   t(dw) = Σ_rows tdy x̂ + dy t(x̂),   t(db) = Σ_rows tdy.
/// The same formulas the backward's ops carry tangents through, without a tensor per term. Each
/// output pointer may be null (not wanted); tdw and tdb are c values each.
template <class T>
void layer_norm_backward_tangents(std::int64_t n, std::int64_t c, const T* x, const T* mean, const T* rstd, const T* w,
                                  const T* dy, const T* tdy, const T* tx, const T* tw, T* tdx, T* tdw, T* tdb) {
  using Vec = ConstArrayMap<T>;
  using Row = Eigen::Array<T, Eigen::Dynamic, 1>;
  const T inv_c = T(1) / static_cast<T>(c);
  auto row = [&](std::int64_t i, T* acc_w, T* acc_b) {
    const std::int64_t o = i * c;
    const T r = rstd[i];
    const Row xhat = (Vec(x + o, c) - mean[i]) * r;
    const Vec d(dy + o, c);
    Row txhat;
    T tr = 0;
    if (tx) {
      T m_xt = 0;
      txhat = xhat_tangent<T>(Vec(tx + o, c), xhat, r, inv_c, m_xt);
      tr = -r * r * m_xt;
    }
    if (acc_w) {
      if (tdy) ArrayMap<T>(acc_w, c) += Vec(tdy + o, c) * xhat;
      if (tx) ArrayMap<T>(acc_w, c) += d * txhat;
    }
    if (acc_b && tdy) ArrayMap<T>(acc_b, c) += Vec(tdy + o, c);
    if (!tdx) return;
    ArrayMap<T> out(tdx + o, c);
    const Row g = w ? Row(d * Vec(w, c)) : Row(d);
    const T m_gx = (g * xhat).sum() * inv_c;
    out.setZero();
    if (tx) {
      const Row h = (g - g.sum() * inv_c) - xhat * m_gx;
      out = tr * h - r * (txhat * m_gx + xhat * ((g * txhat).sum() * inv_c));
    }
    if (tdy || tw) {
      Row tg = Row::Zero(c);
      if (tdy) tg = w ? Row(Vec(tdy + o, c) * Vec(w, c)) : Row(Vec(tdy + o, c));
      if (tw) tg += d * Vec(tw, c);
      out += r * ((tg - tg.sum() * inv_c) - xhat * ((tg * xhat).sum() * inv_c));
    }
  };
  if (tdw || tdb) {
    const std::int64_t width = (tdw ? c : 0) + (tdb ? c : 0);
    std::vector<T> sums(static_cast<std::size_t>(width));
    column_sums(n, width, sums.data(), [&](std::int64_t i, T* acc) {
      row(i, tdw ? acc : nullptr, tdb ? acc + (tdw ? c : 0) : nullptr);
    });
    if (tdw) std::copy(sums.begin(), sums.begin() + c, tdw);
    if (tdb) std::copy(sums.begin() + (tdw ? c : 0), sums.end(), tdb);
  } else if (tdx) {
    parallel_for(n, std::max<std::int64_t>(1, kElementGrain / c), [&](std::int64_t r0, std::int64_t r1) {
      for (std::int64_t i = r0; i < r1; ++i) row(i, nullptr, nullptr);
    });
  }
}

/// The tangent of y = x̂ w + b (forward mode) from the forward's μ and r, in one pass over the rows:
/// t(y) = r (tx − mean(tx) − x̂ mean(x̂ tx)) w + x̂ tw + tb, each term where its tangent is given.
template <class T>
void layer_norm_tangent(std::int64_t n, std::int64_t c, const T* x, const T* mean, const T* rstd, const T* w,
                        const T* tx, const T* tw, const T* tb, T* ty) {
  using Vec = ConstArrayMap<T>;
  using Row = Eigen::Array<T, Eigen::Dynamic, 1>;
  const T inv_c = T(1) / static_cast<T>(c);
  parallel_for(n, std::max<std::int64_t>(1, kElementGrain / c), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t i = r0; i < r1; ++i) {
      const std::int64_t o = i * c;
      const T r = rstd[i];
      const Row xhat = (Vec(x + o, c) - mean[i]) * r;
      ArrayMap<T> out(ty + o, c);
      out.setZero();
      if (tx) {
        T m_xt = 0;
        const Row txhat = xhat_tangent<T>(Vec(tx + o, c), xhat, r, inv_c, m_xt);
        out = w ? Row(txhat * Vec(w, c)) : txhat;
      }
      if (tw) out += xhat * Vec(tw, c);
      if (tb) out += Vec(tb, c);
    }
  });
}
}  // namespace detail

/// Over the last dim of size C, per row:  μ = mean(x), r = 1/√(var(x) + eps) (biased variance),
/// x̂ = (x - μ) r,  y = x̂ ⊙ w + b  (w, b of shape (C,), either may be undefined).
/// Backward, with g = dy ⊙ w:
///   dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy,  dx = r (g - mean(g) - x̂ mean(g ⊙ x̂)).
/// Saves: x, w, and per row μ and r (two scalars a row); x̂ is recomputed from them.
/// Dtype: weight and bias have x's element type, or float32 for a bfloat16 x (PyTorch's mixed-type
/// layer norm); a bfloat16 x computes in float32 (statistics too) and y is rounded to bfloat16.
template <class T, class W = T, class B = W>
BasicTensor<T> layer_norm(const BasicTensor<T>& x, const BasicTensor<W>& weight, const BasicTensor<B>& bias,
                          double eps = 1e-5) {
  static_assert(detail::layer_norm_params<T, W> && detail::layer_norm_params<T, B>,
                "layer_norm: weight and bias must have the input's element type, or float32 for a bfloat16 input "
                "(PyTorch's mixed-type layer norm); convert them with to<T>(weight)");
  if constexpr (detail::routed<T>())
    return detail::in_float32([eps](const auto& a, const auto& w, const auto& b) { return remat::layer_norm(a, w, b, eps); },
                              x, weight, bias);
  else {
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
        op::layer_norm, {x.shape(), Shape{n}, Shape{n}}, 8.0 * static_cast<double>(x.numel()), {x, weight, bias}, [=] {
          BasicTensor<T> out_y(x.shape()), out_mean(Shape{n}), out_rstd(Shape{n});
          const T* px = x.data();
          T* py = out_y.data();
          T* pm = out_mean.data();
          T* pr = out_rstd.data();
          // Row by row: the row is read from memory once, and its later passes hit the L1 cache.
          const T* pw = weight.defined() ? weight.cdata() : nullptr;
          const T* pb = bias.defined() ? bias.cdata() : nullptr;
          parallel_for(n, std::max<std::int64_t>(1, kElementGrain / c), [&](std::int64_t r0, std::int64_t r1) {
            for (std::int64_t i = r0; i < r1; ++i) {
              const detail::ConstArrayMap<T> in(px + i * c, c);
              detail::ArrayMap<T> out(py + i * c, c);
              const T mu = in.mean();
              const T r = T(1) / std::sqrt((in - mu).square().sum() / static_cast<T>(c) + static_cast<T>(eps));
              pm[i] = mu;
              pr[i] = r;
              if (pw && pb) out = (in - mu) * r * detail::ConstArrayMap<T>(pw, c) + detail::ConstArrayMap<T>(pb, c);
              else if (pw) out = (in - mu) * r * detail::ConstArrayMap<T>(pw, c);
              else if (pb) out = (in - mu) * r + detail::ConstArrayMap<T>(pb, c);
              else out = (in - mu) * r;
            }
          });
          return std::make_tuple(out_y, out_mean, out_rstd);
        });

    if (detail::grad_needed(x, weight, bias)) {
      std::vector<detail::SavedTensor> saved{x, mean, rstd};
      if (weight.defined()) saved.emplace_back(weight);
      detail::record<T>(
          op::layer_norm, {x, weight, bias}, {&y}, std::move(saved),
          [c, eps, has_weight = weight.defined()](detail::BackwardContext<T>& ctx) {
            const BasicTensor<T> xv = ctx.saved(0), mv = ctx.saved(1), rv = ctx.saved(2);
            // Carrying tangents (hvp): the first-order kernel's gradients, bit for bit, each with
            // its tangent from one fused pass (the formulas in ops give the same to rounding).
            std::array<BasicTensor<T>, 3> tangents;
            if (ctx.create_graph() && detail::session().tangent_walk) {
              const BasicTensor<T> tdy = detail::tangent_of(ctx.grad_output());
              const BasicTensor<T> tx = ctx.needs_grad(0) ? detail::tangent_of(ctx.as_input(0, xv)) : BasicTensor<T>();
              const BasicTensor<T> tw = has_weight && ctx.needs_grad(0) && ctx.needs_grad(1)
                                            ? detail::tangent_of(ctx.as_input(1, ctx.saved(3)))
                                            : BasicTensor<T>();
              const BasicTensor<T> wv = has_weight ? ctx.saved(3) : BasicTensor<T>();
              const std::int64_t n = c ? xv.numel() / c : 0;
              const bool any = tdy.defined() || tx.defined() || tw.defined();
              for (std::size_t i = 0; i < 3; ++i)
                if (any && ctx.needs_grad(i)) tangents[i] = BasicTensor<T>(i == 0 ? xv.shape() : Shape{c});
              const auto in = [](const BasicTensor<T>& t) { return t.defined() ? t.cdata() : nullptr; };
              const auto out = [](BasicTensor<T>& t) { return t.defined() ? t.data() : nullptr; };
              if (any)
                detail::layer_norm_backward_tangents<T>(n, c, xv.cdata(), mv.cdata(), rv.cdata(), in(wv),
                                                        ctx.grad_output().cdata(), in(tdy), in(tx), in(tw),
                                                        out(tangents[0]), out(tangents[1]), out(tangents[2]));
            } else if (ctx.create_graph()) {
              const BasicTensor<T>& dy = ctx.grad_output();
              const BasicTensor<T> xs = ctx.as_input(0, xv);
              const BasicTensor<T> centred = xs - remat::mean(xs, -1, true);
              const BasicTensor<T> r = rdiv(sqrt(remat::mean(centred * centred, -1, true) + eps), 1.0);
              const BasicTensor<T> xhat = centred * r;
              if (ctx.needs_grad(1)) ctx.accumulate(1, sum_to_size(dy * xhat, Shape{c}));
              if (ctx.needs_grad(2)) ctx.accumulate(2, sum_to_size(dy, Shape{c}));
              if (ctx.needs_grad(0)) {
                const BasicTensor<T> g = has_weight ? dy * ctx.as_input(1, ctx.saved(3)) : dy;
                ctx.accumulate(0, ((g - remat::mean(g, -1, true)) - xhat * remat::mean(g * xhat, -1, true)) * r);
              }
              return;
            }
            const T* px = xv.cdata();
            const T* pm = mv.cdata();
            const T* pr = rv.cdata();
            const T* pdy = ctx.grad_output().cdata();
            const BasicTensor<T> wv = has_weight ? ctx.saved(3) : BasicTensor<T>();
            const T* pw = has_weight ? wv.cdata() : nullptr;
            const std::int64_t n = c ? xv.numel() / c : 0;
            const bool need_dx = ctx.needs_grad(0), need_dw = ctx.needs_grad(1), need_db = ctx.needs_grad(2);
            const auto inv_c = T(1) / static_cast<T>(c);
            BasicTensor<T> dx = need_dx ? BasicTensor<T>(xv.shape()) : BasicTensor<T>();
            T* pdx = need_dx ? dx.data() : nullptr;
            using Vec = detail::ConstArrayMap<T>;
            // One pass over the rows: each row's x̂ (rebuilt from the saved mean and rstd), its input
            // gradient, and its terms of the weight and bias sums, while the row is in cache.
            // Per row: dx = ((g - mean(g)) - x̂ · mean(g · x̂)) · rstd, with g = dy · weight.
            auto row = [&](std::int64_t i, T* acc_w, T* acc_b) {
              const auto xhat = (Vec(px + i * c, c) - pm[i]) * pr[i];
              const Vec dy(pdy + i * c, c);
              if (acc_w) detail::ArrayMap<T>(acc_w, c) += dy * xhat;
              if (acc_b) detail::ArrayMap<T>(acc_b, c) += dy;
              if (!pdx) return;
              detail::ArrayMap<T> g(pdx + i * c, c);  // g, then dx in place
              if (pw) g = dy * Vec(pw, c);
              else g = dy;
              const T mean_g = g.sum() * inv_c, mean_gx = (g * xhat).sum() * inv_c;
              g = ((g - mean_g) - xhat * mean_gx) * pr[i];
            };
            if (need_dw || need_db) {
              // The sums as one (dw | db) row of column_sums: fixed blocks, any thread count.
              const std::int64_t width = (need_dw ? c : 0) + (need_db ? c : 0);
              BasicTensor<T> sums(Shape{width});
              detail::column_sums(n, width, sums.data(), [&](std::int64_t i, T* acc) {
                row(i, need_dw ? acc : nullptr, need_db ? acc + (need_dw ? c : 0) : nullptr);
              });
              if (need_dw) {
                BasicTensor<T> dw(Shape{c});
                detail::ArrayMap<T>(dw.data(), c) = Vec(sums.cdata(), c);
                if (tangents[1].defined()) detail::set_tangent(dw, tangents[1]);
                ctx.accumulate(1, std::move(dw));
              }
              if (need_db) {
                BasicTensor<T> db(Shape{c});
                detail::ArrayMap<T>(db.data(), c) = Vec(sums.cdata() + (need_dw ? c : 0), c);
                if (tangents[2].defined()) detail::set_tangent(db, tangents[2]);
                ctx.accumulate(2, std::move(db));
              }
            } else if (need_dx) {
              parallel_for(n, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                           [&](std::int64_t r0, std::int64_t r1) {
                             for (std::int64_t i = r0; i < r1; ++i) row(i, nullptr, nullptr);
                           });
            }
            if (need_dx) {
              if (tangents[0].defined()) detail::set_tangent(dx, tangents[0]);
              ctx.accumulate(0, std::move(dx));
            }
          });
    }
    // The tangent: x̂ = (x − μ) r moves by r ((tx − mean tx) − x̂ mean(x̂ tx)); y = x̂ w + b.
    // One pass over the rows with the forward's μ and r (layer_norm_tangent).
    const BasicTensor<T> row_mean = mean, row_rstd = rstd;
    detail::push_tangent(y, [&](const BasicTensor<T>& tx, const BasicTensor<W>& tw, const BasicTensor<B>& tb) {
      BasicTensor<T> t(x.shape());
      const auto ptr = [](const auto& v) { return v.defined() ? v.cdata() : nullptr; };
      detail::layer_norm_tangent<T>(n, c, x.cdata(), row_mean.cdata(), row_rstd.cdata(), ptr(weight), ptr(tx), ptr(tw),
                                    ptr(tb), t.data());
      return t;
    }, x, weight, bias);
    return y;
  }
}

}  // namespace remat
