#pragma once
// y = x Wᵀ + b, fused: one GEMM against W as stored (out, in), as torch.nn.functional.linear.

#include "remat/core/gemm.hpp"
#include "remat/core/produce.hpp"
#include "remat/ops/detail/reduce.hpp"

namespace remat {
namespace op {
/// The id of linear(x, weight, bias): x Wᵀ + b.
inline const OpId linear = register_op("linear");
}  // namespace op


/// x (..., in), weight (out, in), bias (out,) or undefined  ->  y (..., out).
/// dx = dy W,  dW = Σ_rows dyᵀ x,  db = Σ_rows dy.
/// Saves: W if x needs a gradient, x if W does.
template <class T>
BasicTensor<T> linear(const BasicTensor<T>& x, const BasicTensor<T>& weight, const BasicTensor<T>& bias = {}) {
  REMAT_CHECK(weight.dim() == 2, "linear: weight must be 2-D (out_features, in_features), got shape {}", weight.shape());
  REMAT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
              "linear: input {} has {} features in its last dim, weight {} expects {}", x.shape(),
              x.dim() ? x.size(-1) : 0, weight.shape(), weight.size(1));
  const std::int64_t in = weight.size(1), out = weight.size(0);
  REMAT_CHECK(!bias.defined() || bias.shape() == Shape{out}, "linear: bias has shape {}, expected ({},)",
              bias.shape(), out);
  std::vector<std::int64_t> s = x.shape().vec();
  s.back() = out;
  const double flops = 2.0 * static_cast<double>(x.numel() / std::max<std::int64_t>(in, 1)) * static_cast<double>(in * out);
  BasicTensor<T> y = detail::produce<T>(op::linear, Shape(s), flops, {x, weight, bias}, [=] {
    BasicTensor<T> result{Shape(s)};
    const std::int64_t rows = x.numel() / std::max<std::int64_t>(in, 1);
    detail::gemm(false, true, rows, out, in, x.data(), in, weight.data(), in, result.data(), out);
    if (bias.defined()) detail::matrix(result, out).rowwise() += detail::flat(bias).matrix().transpose();
    return result;
  });
  if (detail::grad_needed(x, weight, bias)) {
    const bool dx = x.requires_grad(), dw = weight.requires_grad();
    std::vector<detail::SavedTensor> saved;
    if (dx) saved.emplace_back(weight);
    if (dw) saved.emplace_back(x);
    detail::record<T>(op::linear, {x, weight, bias}, {&y}, std::move(saved),
                      [dx, dw, in, out, xs = x.shape()](detail::BackwardContext<T>& ctx) {
                        const BasicTensor<T>& g = ctx.grad_output();
                        const std::int64_t rows = xs.numel() / std::max<std::int64_t>(in, 1);
                        if (dx) {
                          BasicTensor<T> gx(xs);
                          detail::gemm(false, false, rows, in, out, g.data(), out, ctx.saved(0).cdata(), in, gx.data(), in);
                          ctx.accumulate(0, std::move(gx));
                        }
                        if (dw) {
                          BasicTensor<T> gw(Shape{out, in});
                          detail::gemm(true, false, out, in, rows, g.data(), out, ctx.saved(dx ? 1 : 0).cdata(), in, gw.data(), in);
                          ctx.accumulate(1, std::move(gw));
                        }
                        if (ctx.needs_grad(2)) {
                          BasicTensor<T> gb(Shape{out});
                          const T* pdy = g.data();
                          detail::column_sums(rows, out, gb.data(), [&](std::int64_t i, T* acc) {
                            detail::ArrayMap<T>(acc, out) += detail::ConstArrayMap<T>(pdy + i * out, out);
                          });
                          ctx.accumulate(2, std::move(gb));
                        }
                      });
  }
  return y;
}

}  // namespace remat
