#pragma once
// The shared shape of element-wise unary ops: forward on Eigen arrays, one node whose backward is
// an element-wise formula of the output gradient and either the saved output or the saved input.

#include "remat/checkpoint/selective.hpp"
#include "remat/core/tape.hpp"
#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"

namespace remat::detail {

/// out = f(in...) element-wise over flat arrays, split across threads for large tensors.
template <class T, class F, class... In>
void map_elements(BasicTensor<T>& out, F f, const In&... in) {
  T* po = out.data();
  parallel_for(out.numel(), kElementGrain, [&](std::int64_t b, std::int64_t e) {
    ArrayMap<T>(po + b, e - b) = f(ConstArrayMap<T>(in.data() + b, e - b)...);
  });
}

/// y = forward(x); dx = backward(dy, y). Saves: y (for ops whose derivative is a function of y).
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_output(const char* op, const BasicTensor<T>& x, Forward forward,
                                   Backward backward) {
  BasicTensor<T> y = compute_or_reuse<T>(op, x.shape(), [&] {
    BasicTensor<T> out(x.shape());
    map_elements(out, forward, x);
    return out;
  });
  if (grad_needed(x))
    record<T>(op, {x}, {&y}, {y}, [backward](BackwardContext<T>& ctx) {
      const BasicTensor<T> out = ctx.template saved<T>(0);
      BasicTensor<T> dx(out.shape());
      map_elements(dx, backward, ctx.grad_output(), out);
      ctx.accumulate(0, std::move(dx));
    });
  return y;
}

/// y = forward(x); dx = backward(dy, x). Saves: x.
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_input(const char* op, const BasicTensor<T>& x, Forward forward,
                                  Backward backward) {
  BasicTensor<T> y = compute_or_reuse<T>(op, x.shape(), [&] {
    BasicTensor<T> out(x.shape());
    map_elements(out, forward, x);
    return out;
  });
  if (grad_needed(x))
    record<T>(op, {x}, {&y}, {x}, [backward](BackwardContext<T>& ctx) {
      const BasicTensor<T> in = ctx.template saved<T>(0);
      BasicTensor<T> dx(in.shape());
      map_elements(dx, backward, ctx.grad_output(), in);
      ctx.accumulate(0, std::move(dx));
    });
  return y;
}

/// y = forward(x); dx = backward(dy). Saves nothing (linear ops: negation, scalar add and scale).
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_nothing(const char* op, const BasicTensor<T>& x, Forward forward,
                                    Backward backward) {
  BasicTensor<T> y = compute_or_reuse<T>(op, x.shape(), [&] {
    BasicTensor<T> out(x.shape());
    map_elements(out, forward, x);
    return out;
  });
  if (grad_needed(x))
    record<T>(op, {x}, {&y}, {}, [backward](BackwardContext<T>& ctx) {
      const BasicTensor<T>& dy = ctx.grad_output();
      BasicTensor<T> dx(dy.shape());
      map_elements(dx, backward, dy);
      ctx.accumulate(0, std::move(dx));
    });
  return y;
}

}  // namespace remat::detail
