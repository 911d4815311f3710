#pragma once
// gelu(x + bias) in one pass each way: the bias add of a linear layer and the activation after it
// (the Transformer MLP's first layer), as Megatron's bias_gelu fusion. Unfused, the biased
// pre-activation is written, read back by gelu, and its gradient read again for the bias sum.

#include <utility>
#include <vector>

#include "remat/ops/add.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/reduce.hpp"
#include "remat/ops/gelu.hpp"

namespace remat {
namespace op {
/// The id of bias_gelu(x, bias): gelu(x + bias), fused.
inline const OpId bias_gelu = register_op("bias_gelu", tangent_rule);
}  // namespace op


namespace detail {
/// Row i of a = x + bias (c values) and of its tangent tx + tb (either may be undefined), as
/// bias_gelu's forward-mode rule and its backward carrying tangents rebuild them.
template <class T>
std::pair<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Array<T, Eigen::Dynamic, 1>> bias_gelu_row_and_tangent(
    const BasicTensor<T>& x, const BasicTensor<T>& bias, const BasicTensor<T>& tx, const BasicTensor<T>& tb,
    std::int64_t i, std::int64_t c) {
  using Vec = ConstArrayMap<T>;
  Eigen::Array<T, Eigen::Dynamic, 1> a = Vec(x.cdata() + i * c, c) + Vec(bias.cdata(), c);
  Eigen::Array<T, Eigen::Dynamic, 1> ta = Eigen::Array<T, Eigen::Dynamic, 1>::Zero(c);
  if (tx.defined()) ta = Vec(tx.cdata() + i * c, c);
  if (tb.defined()) ta += Vec(tb.cdata(), c);
  return {std::move(a), std::move(ta)};
}
}  // namespace detail

/// y = gelu(x + bias) over the last dim: x (..., C), bias (C,); exact or tanh GELU as gelu().
/// With a = x + bias and g = dy ⊙ gelu'(a):  dx = g,  dbias = Σ_rows g, in one pass over the rows.
/// Saves: x and bias (a is rebuilt row by row in backward; no (..., C) tensor beyond x is kept).
/// Recorded (create_graph), the backward is its unfused composition: a = x + bias, the GELU
/// derivative's formula on tensors, and sum_to_size for dbias. Carrying tangents (hvp's backward),
/// it is the fused backward, bit for bit, with its gradients' tangents from one more pass.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> bias_gelu(const BasicTensor<T>& x, const BasicTensor<T>& bias,
                         GeluApproximation approximate = GeluApproximation::none) {
  if constexpr (detail::routed<T>()) return detail::route([=](const auto& a, const auto& b) { return remat::bias_gelu(a, b, approximate); }, x, bias);
  else {
    REMAT_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1),
                "bias_gelu: bias must have shape (C,) for input (..., C); got bias {} for input {}", bias.shape(),
                x.shape());
    const std::int64_t c = bias.size(0), rows = c ? x.numel() / c : 0;
    using F = detail::Gelu<T>;
    const bool tanh = approximate == GeluApproximation::tanh;
    BasicTensor<T> y = detail::produce<T>(op::bias_gelu, x.shape(), 2.0 * static_cast<double>(x.numel()), {x, bias}, [=] {
      BasicTensor<T> out(x.shape());
      const T* px = x.cdata();
      T* py = out.data();
      const detail::ConstArrayMap<T> b(bias.cdata(), c);
      parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                   [&](std::int64_t r0, std::int64_t r1) {
                     for (std::int64_t i = r0; i < r1; ++i) {
                       const auto a = detail::ConstArrayMap<T>(px + i * c, c) + b;  // never stored
                       detail::ArrayMap<T> yi(py + i * c, c);
                       if (tanh) yi = F::tanh(a);
                       else yi = F::exact(a);
                     }
                   });
      return out;
    });
    if (detail::grad_needed(x, bias))
      detail::record<T>(op::bias_gelu, {x, bias}, {&y}, {x, bias}, [c, rows, tanh](detail::BackwardContext<T>& ctx) {
        const BasicTensor<T> xs = ctx.saved(0), bs = ctx.saved(1);
        // Carrying tangents (hvp): the first-order kernel's gradients, bit for bit, each with its
        // tangent t(g) = t(dy) GELU'(a) + dy GELU''(a) (tx + tb) from one fused pass.
        BasicTensor<T> tg, tdb;
        if (ctx.create_graph() && detail::session().tangent_walk) {
          const BasicTensor<T> tdy = detail::tangent_of(ctx.grad_output());
          const BasicTensor<T> tx = ctx.needs_grad(0) ? detail::tangent_of(ctx.as_input(0, xs)) : BasicTensor<T>();
          const BasicTensor<T> tb = ctx.needs_grad(1) ? detail::tangent_of(ctx.as_input(1, bs)) : BasicTensor<T>();
          if (tdy.defined() || tx.defined() || tb.defined()) {
            // Into t(dy)'s own bytes when nothing else can read them (the incoming gradient's
            // identity and its tangent held here only): element by element, each read before it
            // is written. The backward's peak, where it falls on this op, holds one buffer less.
            const bool reuse = tdy.defined() && ctx.grad_output().meta().use_count() == 1 &&
                               tdy.storage().use_count() == 2;  // the gradient's tangent, and tdy
            tg = reuse ? tdy : BasicTensor<T>(xs.shape());
            using Vec = detail::ConstArrayMap<T>;
            using Row = Eigen::Array<T, Eigen::Dynamic, 1>;
            const T* pdy = ctx.grad_output().cdata();
            auto row = [&](std::int64_t i) {
              const std::int64_t o = i * c;
              const auto [a, ta] = detail::bias_gelu_row_and_tangent(xs, bs, tx, tb, i, c);
              detail::ArrayMap<T> out(tg.data() + o, c);
              if (tdy.defined()) out = tanh ? Row(F::tanh_grad(Vec(tdy.cdata() + o, c), a))
                                            : Row(F::exact_grad(Vec(tdy.cdata() + o, c), a));
              else out.setZero();
              if (tx.defined() || tb.defined())
                out += Vec(pdy + o, c) * (tanh ? F::tanh_second(a) : F::exact_second(a)) * ta;
            };
            if (ctx.needs_grad(1)) {
              tdb = BasicTensor<T>(Shape{c});
              detail::column_sums(rows, c, tdb.data(), [&](std::int64_t i, T* acc) {
                row(i);
                detail::ArrayMap<T>(acc, c) += Vec(tg.cdata() + i * c, c);
              });
            } else {
              parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                           [&](std::int64_t r0, std::int64_t r1) {
                             for (std::int64_t i = r0; i < r1; ++i) row(i);
                           });
            }
          }
        } else if (ctx.create_graph()) {
          const BasicTensor<T> a = ctx.as_input(0, xs) + ctx.as_input(1, bs);
          const BasicTensor<T> g = tanh ? F::tanh_grad(ctx.grad_output(), a) : F::exact_grad(ctx.grad_output(), a);
          if (ctx.needs_grad(1)) ctx.accumulate(1, sum_to_size(g, Shape{c}));
          if (ctx.needs_grad(0)) ctx.accumulate(0, g);
          return;
        }
        const T* px = xs.cdata();
        const T* pdy = ctx.grad_output().cdata();
        const detail::ConstArrayMap<T> b(bs.cdata(), c);
        BasicTensor<T> dx(xs.shape());
        T* pdx = dx.data();
        // g for row i, written into dx (the input gradient is g itself). The exact form in
        // stages, each a short expression Eigen inlines (one reading an unstored a several times
        // recomputed it at each read and called exp out of line): a = x + bias into a scratch row,
        // the density term a φ(a) into the dx row, then g over it. Every stage's destination is
        // the dx row, whose alignment decides which elements take Eigen's scalar exp and erf (a
        // scratch row's would vary with its address, and so would the bits). Element-wise, g may
        // overwrite what it reads.
        auto row_grad = [&](std::int64_t i) {
          detail::ArrayMap<T> g(pdx + i * c, c);
          const detail::ConstArrayMap<T> dy(pdy + i * c, c);
          if (tanh) {
            g = detail::ConstArrayMap<T>(px + i * c, c) + b;
            g = F::tanh_grad(dy, detail::ConstArrayMap<T>(pdx + i * c, c));
            return;
          }
          thread_local std::vector<T> a_row;  // one row per thread, kept between calls
          a_row.resize(static_cast<std::size_t>(c));
          detail::ArrayMap<T> a(a_row.data(), c);
          a = detail::ConstArrayMap<T>(px + i * c, c) + b;
          g = F::exact_density(a);
          g = F::exact_grad_given(dy, a, detail::ConstArrayMap<T>(pdx + i * c, c));
        };
        if (ctx.needs_grad(1)) {
          // Each row's g is summed into the bias gradient while it is still in cache.
          BasicTensor<T> db(Shape{c});
          detail::column_sums(rows, c, db.data(), [&](std::int64_t i, T* acc) {
            row_grad(i);
            detail::ArrayMap<T>(acc, c) += detail::ConstArrayMap<T>(pdx + i * c, c);
          });
          if (tdb.defined()) detail::set_tangent(db, tdb);
          ctx.accumulate(1, std::move(db));
        } else {
          parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                       [&](std::int64_t r0, std::int64_t r1) {
                         for (std::int64_t i = r0; i < r1; ++i) row_grad(i);
                       });
        }
        if (ctx.needs_grad(0)) {
          if (tg.defined()) detail::set_tangent(dx, tg);
          ctx.accumulate(0, std::move(dx));
        }
      });
    // The tangent: GELU's derivative at a = x + bias times a's tangent, tx + tb on every row.
    // One pass over the rows, a rebuilt as the forward's.
    detail::push_tangent(y, [&](const BasicTensor<T>& tx, const BasicTensor<T>& tb) {
      BasicTensor<T> t(x.shape());
      using Row = Eigen::Array<T, Eigen::Dynamic, 1>;
      parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(c, 1)),
                   [&](std::int64_t r0, std::int64_t r1) {
                     for (std::int64_t i = r0; i < r1; ++i) {
                       const auto [a, ta] = detail::bias_gelu_row_and_tangent(x, bias, tx, tb, i, c);
                       detail::ArrayMap<T>(t.data() + i * c, c) = tanh ? Row(F::tanh_grad(ta, a)) : Row(F::exact_grad(ta, a));
                     }
                   });
      return t;
    }, x, bias);
    return y;
  }
}

}  // namespace remat
