#pragma once
// Tensor factories: empty, zeros, ones, full, from data, arange, rand, randn, and *_like forms;
// and to<U>(t), the element-type cast.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "remat/core/autograd.hpp"  // Tensor::backward, for every program that makes tensors
#include "remat/core/bfloat16.hpp"
#include "remat/core/cast.hpp"
#include "remat/core/produce.hpp"
#include "remat/core/random.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

/// A tensor of `shape` with uninitialised contents.
template <class T = float>
BasicTensor<T> empty(const Shape& shape) {
  return BasicTensor<T>(shape);
}

/// A tensor of `shape` with every element `value`.
template <class T = float>
BasicTensor<T> full(const Shape& shape, T value) {
  BasicTensor<T> t(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

/// A tensor of `shape` filled with 0.
template <class T = float>
BasicTensor<T> zeros(const Shape& shape) {
  return full<T>(shape, T(0));
}

/// A tensor of `shape` filled with 1.
template <class T = float>
BasicTensor<T> ones(const Shape& shape) {
  return full<T>(shape, T(1));
}

/// Zeros of the shape and element type of `t`.
template <class T>
BasicTensor<T> zeros_like(const BasicTensor<T>& t) {
  return zeros<T>(t.shape());
}
/// Ones of the shape and element type of `t`.
template <class T>
BasicTensor<T> ones_like(const BasicTensor<T>& t) {
  return ones<T>(t.shape());
}

/// A scalar (rank-0) tensor.
template <class T = float>
BasicTensor<T> scalar(T value) {
  return full<T>(Shape{}, value);
}

///@{
/// Copies `values` into a tensor of `shape` (1-D of their count when no shape is given).
template <class T = float>
BasicTensor<T> tensor(const std::vector<T>& values, const Shape& shape) {
  REMAT_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(),
              "tensor: {} values cannot fill shape {} ({} elements expected)", values.size(), shape,
              shape.numel());
  BasicTensor<T> t(shape);
  std::copy(values.begin(), values.end(), t.data());
  return t;
}
template <class T = float>
BasicTensor<T> tensor(const std::vector<T>& values) {
  return tensor<T>(values, Shape{static_cast<std::int64_t>(values.size())});
}
template <class T = float>
BasicTensor<T> tensor(std::initializer_list<T> values, const Shape& shape) {
  return tensor<T>(std::vector<T>(values), shape);
}
template <class T = float>
BasicTensor<T> tensor(std::initializer_list<T> values) {
  return tensor<T>(std::vector<T>(values));
}
///@}

///@{
/// start, start + step, ... up to but excluding end (as torch.arange); arange(end) starts at 0
/// with step 1.
template <class T = float>
BasicTensor<T> arange(T start, T end, T step = T(1)) {
  REMAT_CHECK(step != T(0), "arange: step must be non-zero");
  const double count = std::ceil((static_cast<double>(end) - static_cast<double>(start)) / static_cast<double>(step));
  const auto n = static_cast<std::int64_t>(std::max(0.0, count));
  BasicTensor<T> t(Shape{n});
  T* p = t.data();
  for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(start + static_cast<T>(i) * step);
  return t;
}
template <class T = float>
BasicTensor<T> arange(T end) {
  return arange<T>(T(0), end, T(1));
}
///@}

/// Uniform on [0, 1), drawn from `gen` (the thread's default generator when omitted).
template <class T = float>
BasicTensor<T> rand(const Shape& shape, Generator& gen = default_generator()) {
  BasicTensor<T> t(shape);
  gen.uniform(t.data(), static_cast<std::size_t>(t.numel()));
  return t;
}

/// Standard normal, drawn from `gen` (the thread's default generator when omitted).
template <class T = float>
BasicTensor<T> randn(const Shape& shape, Generator& gen = default_generator()) {
  BasicTensor<T> t(shape);
  gen.normal(t.data(), static_cast<std::size_t>(t.numel()));
  return t;
}

/// Uniform integers in [low, high), e.g. token ids.
inline LongTensor randint(std::int64_t low, std::int64_t high, const Shape& shape,
                          Generator& gen = default_generator()) {
  REMAT_CHECK(low < high, "randint: needs low < high, got [{}, {})", low, high);
  BasicTensor<double> u(shape);
  gen.uniform(u.data(), static_cast<std::size_t>(u.numel()));
  LongTensor t(shape);
  const double span = static_cast<double>(high - low);
  std::int64_t* out = t.data();
  const double* draws = u.cdata();
  for (std::int64_t i = 0; i < t.numel(); ++i)
    out[i] = std::min(high - 1, low + static_cast<std::int64_t>(draws[i] * span));
  return t;
}

namespace op {
/// The id of to<U>(t): the element type converted (PyTorch's .to(dtype)).
inline const OpId to = register_op("to", tangent_rule);
}  // namespace op

/// Converts the element type (float <-> double, float <-> bfloat16, to and from integers), always
/// into a new tensor. To bfloat16 rounds to nearest even (core/bfloat16.hpp), from other types
/// than float through float as PyTorch does (a double rounds twice); from bfloat16 is exact.
/// Differentiable between floating types (float32, float64, bfloat16), as PyTorch's .to(dtype):
/// when t needs a gradient the result does, and backward converts the gradient back to T by the
/// same rules (to float32 from bfloat16 exactly, to bfloat16 rounding to nearest even). A cast to
/// or from an integer or bool type has no history (such tensors take no gradient).
/// Saves: nothing.
template <class U, class T>
BasicTensor<U> to(const BasicTensor<T>& t) {
  BasicTensor<U> y = detail::produce<U>(op::to, t.shape(), static_cast<double>(t.numel()), {t},
                                        [=] { return detail::cast_copy<U>(t); });
  if constexpr (detail::is_floating_dtype<T> && detail::is_floating_dtype<U>) {
    if (detail::grad_needed(t))
      detail::record<T, U>(op::to, {t}, {&y}, {}, [](detail::BackwardContext<T, U>& ctx) {
        if (ctx.create_graph()) return ctx.accumulate(0, to<T>(ctx.grad_output()));  // the same cast, recorded
        ctx.accumulate(0, detail::cast_copy<T>(ctx.grad_output()));
      });
    detail::push_tangent(y, [](const BasicTensor<T>& dt) { return to<U>(dt); }, t);  // the tangent cast alike
  }
  return y;
}

}  // namespace remat
