#pragma once
// y = x Wᵀ + b, fused: one GEMM against W as stored (out, in), as torch.nn.functional.linear.

#include "remat/core/autocast.hpp"
#include "remat/core/gemm.hpp"
#include "remat/core/produce.hpp"
#include "remat/core/threads.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/reduce.hpp"
#include "remat/ops/matmul.hpp"
#include "remat/ops/reshape.hpp"

namespace remat {
namespace op {
/// The id of linear(x, weight, bias): x Wᵀ + b.
inline const OpId linear = register_op("linear", tangent_rule);
}  // namespace op


template <class T>
BasicTensor<T> linear(const BasicTensor<T>& x, const BasicTensor<T>& weight, const BasicTensor<T>& bias = {});

namespace detail {

/// linear over operands in element type E (T itself, or bfloat16 under autocast): xe and we are x
/// and weight as the GEMM reads them, and what the node saves.
template <class T, class E>
BasicTensor<T> linear_with(const BasicTensor<T>& x, const BasicTensor<T>& weight, const BasicTensor<T>& bias,
                           const BasicTensor<E>& xe, const BasicTensor<E>& we) {
  const std::int64_t in = weight.size(1), out = weight.size(0);
  std::vector<std::int64_t> s = x.shape().vec();
  s.back() = out;
  const std::int64_t rows = x.numel() / std::max<std::int64_t>(in, 1);
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(in * out);
  // The compute reads (and a memory budget's recompute keeps) the operands as the GEMM takes
  // them: under autocast the bfloat16 copies, never the float32 x and W beside them.
  BasicTensor<T> y = produce<T>(op::linear, Shape(s), flops, {xe, we, bias}, [=] {
    BasicTensor<T> result{Shape(s)};
    gemm(false, true, rows, out, in, xe.cdata(), in, we.cdata(), in, result.data(), out);
    constexpr bool rounds = !std::is_same_v<E, T>;
    if (bias.defined()) {
      // One pass for the bias and, under autocast, the rounding (round_product_output's values):
      // rows on threads, each row's sums then its rounding while it is in cache.
      T* py = result.data();
      const T* pb = bias.cdata();
      parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(out, 1)),
                   [=](std::int64_t r0, std::int64_t r1) {
                     for (std::int64_t r = r0; r < r1; ++r) {
                       T* row = py + r * out;
                       ArrayMap<T>(row, out) += ConstArrayMap<T>(pb, out);
                       if constexpr (rounds) round_to_bfloat16(row, row, out);
                     }
                   });
      if constexpr (rounds) result.storage()->mark_bfloat16_exact();
    } else if constexpr (rounds) {
      round_product_output(result);
    }
    return result;
  });
  if (grad_needed(x, weight, bias)) {
    const bool dx = x.requires_grad(), dw = weight.requires_grad();
    std::vector<SavedTensor> saved;
    if (dx) saved.emplace_back(we);
    if (dw) saved.emplace_back(xe);
    record<T>(op::linear, {x, weight, bias}, {&y}, std::move(saved),
              [dx, dw, in, out, xs = x.shape()](BackwardContext<T>& ctx) {
                const BasicTensor<T>& g = ctx.grad_output();
                if constexpr (std::is_same_v<E, T>) {
                  if (ctx.create_graph()) {
                    // The same products, recorded: each matmul makes the GEMM call the array path makes.
                    const std::int64_t rows = xs.numel() / std::max<std::int64_t>(in, 1);
                    const BasicTensor<T> g2 = reshape(g, {rows, out});
                    if (dx) ctx.accumulate(0, reshape(matmul(g2, ctx.as_input(1, ctx.saved(0)), false, false), xs.vec()));
                    if (dw)
                      ctx.accumulate(1, matmul(g2, reshape(ctx.as_input(0, ctx.saved(dx ? 1 : 0)), {rows, in}), true, false));
                    if (ctx.needs_grad(2)) ctx.accumulate(2, sum_to_size(g, Shape{out}));
                    return;
                  }
                }
                const BasicTensor<E> ge = as_operand<E>(g);
                const std::int64_t rows = xs.numel() / std::max<std::int64_t>(in, 1);
                const E* pg = ge.cdata();
                const auto input_grad = [=](const E* w, T* gx) { gemm(false, false, rows, in, out, pg, out, w, in, gx, in); };
                const auto weight_grad = [=](const E* x, T* gw) { gemm(true, false, out, in, rows, pg, out, x, in, gw, in); };
                if (dx && dw) {  // both products of rows·in·out multiply-adds: a pair, at once when small
                  BasicTensor<T> gx(xs), gw(Shape{out, in});
                  // Held while the products run: a saved-tensor store's unpack may be a fresh copy.
                  const BasicTensor<E> w = ctx.template saved<E>(0), x = ctx.template saved<E>(1);
                  const E* pw = w.cdata();
                  const E* px = x.cdata();
                  T* pgx = gx.data();
                  T* pgw = gw.data();
                  gemm_pair(rows * in * out, [&] { input_grad(pw, pgx); }, [&] { weight_grad(px, pgw); });
                  ctx.accumulate(0, std::move(gx));
                  ctx.accumulate(1, std::move(gw));
                } else if (dx) {
                  BasicTensor<T> gx(xs);
                  input_grad(ctx.template saved<E>(0).cdata(), gx.data());
                  ctx.accumulate(0, std::move(gx));
                } else if (dw) {
                  BasicTensor<T> gw(Shape{out, in});
                  weight_grad(ctx.template saved<E>(0).cdata(), gw.data());
                  ctx.accumulate(1, std::move(gw));
                }
                if (ctx.needs_grad(2)) {
                  BasicTensor<T> gb(Shape{out});
                  const T* pdy = g.data();  // the bias gradient sums in float32 (not a product)
                  column_sums(rows, out, gb.data(), [&](std::int64_t i, T* acc) {
                    ArrayMap<T>(acc, out) += ConstArrayMap<T>(pdy + i * out, out);
                  });
                  ctx.accumulate(2, std::move(gb));
                }
              });
  }
  // The tangent: bilinear in x and W, plus the bias's tangent on every row.
  push_tangent(y, [&](const BasicTensor<T>& tx, const BasicTensor<T>& tw, const BasicTensor<T>& tb) {
    if constexpr (!std::is_same_v<E, T>) {  // under autocast: the products as the forward's
      BasicTensor<T> t = tx.defined() ? remat::linear(tx, weight) : BasicTensor<T>();
      if (tw.defined()) t = tangent_sum(t, remat::linear(x, tw));
      if (tb.defined()) t = tangent_sum(t, broadcast_to(tb, y.shape()));
      return t;
    } else {
      // One buffer: tx Wᵀ, then x twᵀ added by the second GEMM, then the bias's tangent.
      BasicTensor<T> t{y.shape()};
      if (tx.defined()) gemm(false, true, rows, out, in, tx.cdata(), in, weight.cdata(), in, t.data(), out);
      if (tw.defined()) gemm(false, true, rows, out, in, x.cdata(), in, tw.cdata(), in, t.data(), out, tx.defined());
      if (tb.defined()) {
        if (tx.defined() || tw.defined()) matrix(t, out).rowwise() += flat(tb).matrix().transpose();
        else matrix(t, out).rowwise() = flat(tb).matrix().transpose();
      }
      return t;
    }
  }, x, weight, bias);
  return y;
}

}  // namespace detail

/// x (..., in), weight (out, in), bias (out,) or undefined  ->  y (..., out).
/// dx = dy W,  dW = Σ_rows dyᵀ x,  db = Σ_rows dy.
/// Saves: W if x needs a gradient, x if W does. Under autocast (float32): the product and its
/// gradients on bfloat16 copies of x, W and dy with float32 sums, the bias added in float32, the
/// output rounded to bfloat16 values, and the bfloat16 copies saved.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> linear(const BasicTensor<T>& x, const BasicTensor<T>& weight, const BasicTensor<T>& bias) {
  if constexpr (detail::routed<T>())
    return detail::route([](const auto& a, const auto& w, const auto& b) { return remat::linear(a, w, b); }, x, weight,
                         bias);
  else {
    REMAT_CHECK(weight.dim() == 2, "linear: weight must be 2-D (out_features, in_features), got shape {}", weight.shape());
    REMAT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
                "linear: input {} has {} features in its last dim, weight {} expects {}", x.shape(),
                x.dim() ? x.size(-1) : 0, weight.shape(), weight.size(1));
    REMAT_CHECK(!bias.defined() || bias.shape() == Shape{weight.size(0)}, "linear: bias has shape {}, expected ({},)",
                bias.shape(), weight.size(0));
    if constexpr (detail::kAutocasts<T>) {
      if (is_autocast_enabled())
        return detail::linear_with<T, bfloat16>(x, weight, bias, detail::autocast_operand(x), detail::autocast_operand(weight));
    }
    return detail::linear_with<T, T>(x, weight, bias, x, weight);
  }
}

}  // namespace remat
