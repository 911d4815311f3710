#pragma once
// y = x Wᵀ + b, fused: one GEMM against W as stored (out, in), as torch.nn.functional.linear.

#include "remat/core/produce.hpp"

namespace remat {
namespace op {
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
  BasicTensor<T> y = detail::produce<T>(op::linear, Shape(s), flops, [&] {
    BasicTensor<T> result{Shape(s)};
    auto ym = detail::matrix(result, out);
    ym.noalias() = detail::matrix(x, in) * detail::matrix(weight, in).transpose();
    if (bias.defined()) ym.rowwise() += detail::flat(bias).matrix().transpose();
    return result;
  });
  if (detail::grad_needed(x, weight, bias)) {
    const bool dx = x.requires_grad(), dw = weight.requires_grad();
    std::vector<detail::SavedTensor> saved;
    if (dx) saved.emplace_back(weight);
    if (dw) saved.emplace_back(x);
    detail::record<T>(op::linear, {x, weight, bias}, {&y}, std::move(saved),
                      [dx, dw, in, out, xs = x.shape()](detail::BackwardContext<T>& ctx) {
                        auto dy = detail::matrix(ctx.grad_output(), out);
                        if (dx) {
                          BasicTensor<T> gx(xs);
                          detail::matrix(gx, in).noalias() = dy * detail::matrix(ctx.saved(0), in);
                          ctx.accumulate(0, std::move(gx));
                        }
                        if (dw) {
                          BasicTensor<T> gw(Shape{out, in});
                          detail::matrix(gw, in).noalias() = dy.transpose() * detail::matrix(ctx.saved(dx ? 1 : 0), in);
                          ctx.accumulate(1, std::move(gw));
                        }
                        if (ctx.needs_grad(2)) {
                          BasicTensor<T> gb(Shape{out});
                          detail::flat(gb) = dy.colwise().sum().transpose().array();
                          ctx.accumulate(2, std::move(gb));
                        }
                      });
  }
  return y;
}

}  // namespace remat
