#pragma once
// The shared shape of element-wise unary ops: forward on Eigen arrays, one node whose backward is
// an element-wise formula of the output gradient and either the saved output or the saved input.

#include "remat/core/produce.hpp"
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

/// What an element-wise unary op keeps for its backward.
enum class UnarySaves { nothing, input, output };

/// y = forward(x); dx = backward(dy) or backward(dy, saved), with saved = x or y as `Saves` says.
template <UnarySaves Saves, class T, class Forward, class Backward>
BasicTensor<T> unary_op(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward) {
  BasicTensor<T> y = produce<T>(op, x.shape(), static_cast<double>(x.numel()), {x}, [=] {
    BasicTensor<T> out(x.shape());
    map_elements(out, forward, x);
    return out;
  });
  if (grad_needed(x)) {
    std::vector<SavedTensor> saved;
    if constexpr (Saves == UnarySaves::input) saved.emplace_back(x);
    if constexpr (Saves == UnarySaves::output) saved.emplace_back(y);
    record<T>(op, {x}, {&y}, std::move(saved), [backward](BackwardContext<T>& ctx) {
      const BasicTensor<T>& dy = ctx.grad_output();
      BasicTensor<T> dx(dy.shape());
      if constexpr (Saves == UnarySaves::nothing) map_elements(dx, backward, dy);
      else map_elements(dx, backward, dy, ctx.template saved<T>(0));
      ctx.accumulate(0, std::move(dx));
    });
  }
  return y;
}

/// y = forward(x); dx = backward(dy, y). Saves: y (for ops whose derivative is a function of y).
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_output(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward) {
  return unary_op<UnarySaves::output>(op, x, forward, backward);
}

/// y = forward(x); dx = backward(dy, x). Saves: x.
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_input(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward) {
  return unary_op<UnarySaves::input>(op, x, forward, backward);
}

/// y = forward(x); dx = backward(dy). Saves nothing (linear ops: negation, scalar add and scale).
template <class T, class Forward, class Backward>
BasicTensor<T> unary_saving_nothing(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward) {
  return unary_op<UnarySaves::nothing>(op, x, forward, backward);
}

}  // namespace remat::detail
