#pragma once
// The dtype rules every op follows, in one place (PyTorch's CPU semantics):
//
// 1. bfloat16 inputs: the op computes in float32 on exact float32 copies of them and rounds its
//    result to bfloat16 (nearest even), so op(x) is bitwise to<bfloat16>(op(to<float>(x))); sums
//    and statistics (reductions, layer norm, softmax, log-softmax, cross-entropy) accumulate in
//    float32. Both casts are recorded, so gradients come back to x in bfloat16 through the same
//    rule. Ops that only move elements (reshape, permute, narrow, cat, masked_fill, max) run on
//    bfloat16 directly instead: the same bits, without the float32 copies.
// 2. Tensors of two floating element types promote, bfloat16 < float32 < float64
//    (torch.promote_types), through the differentiable cast, so each input's gradient comes back
//    in its own element type. The result type follows from the element types alone: C++ knows it
//    at compile time, where PyTorch's rank-0 exception (a 0-dim tensor does not promote a
//    dimensioned one) depends on runtime shapes, so that exception is not followed.
// 3. An element type with no rule (an integer or bool tensor given to an op that computes, or
//    mixed with a floating tensor) is a compile-time error (static_assert) naming the rule; the
//    compiler's instantiation note names the op and both types. Types here are static, so an
//    error at run time could only report what the compiler already knew.
//
// An op applies the rules with one line at the top of its public function:
//   if constexpr (detail::routed<A, B>())
//     return detail::route([](const auto& x, const auto& y) { return op(x, y); }, a, b);
//   else ...its own body, over one floating type other than bfloat16...

#include <type_traits>

#include "remat/core/bfloat16.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

template <class T>
inline constexpr bool is_bfloat16 = std::is_same_v<T, bfloat16>;

/// The order floating types promote in: bfloat16 < float32 < float64 (0: no rule).
template <class T>
inline constexpr int promotion_rank =
    is_bfloat16<T> ? 1 : std::is_same_v<T, float> ? 2 : std::is_same_v<T, double> ? 3 : 0;

template <class T, class... Ts>
struct highest {
  using type = T;
};
template <class T, class U, class... Ts>
struct highest<T, U, Ts...> : highest<std::conditional_t<(promotion_rank<U> > promotion_rank<T>), U, T>, Ts...> {};

/// The common element type of an op's inputs (torch.promote_types over floating types).
template <class... Ts>
struct promote {
  static_assert(((promotion_rank<Ts> > 0) && ...),
                "remat: tensors of these element types cannot meet in one op: ops compute on floating tensors "
                "(float32, float64, bfloat16) and promote among them; integer and bool tensors are indices and "
                "masks (convert one with to<float>(t) to compute on it)");
  using type = typename highest<Ts...>::type;
};
template <class... Ts>
using promote_t = typename promote<Ts...>::type;

/// Whether an op that computes on tensors of these element types takes the dtype route (route())
/// rather than its own body: when the types differ, or are bfloat16. Refuses (static_assert)
/// integer and bool element types, for which a computing op has no rule.
template <class T, class... Ts>
constexpr bool routed() {
  static_assert(is_floating_dtype<T> && (is_floating_dtype<Ts> && ...),
                "remat: this op computes on floating tensors only (float32, float64, bfloat16); integer and bool "
                "tensors are indices and masks (convert with to<float>(t) to compute on one)");
  return !(std::is_same_v<T, Ts> && ...) || is_bfloat16<T>;
}

/// t as element type U: t itself when it already is, else the differentiable cast to<U>(t); an
/// undefined tensor (an absent weight or bias) stays undefined.
template <class U, class T>
BasicTensor<U> as_dtype(const BasicTensor<T>& t) {
  if constexpr (std::is_same_v<U, T>) return t;
  else return t.defined() ? to<U>(t) : BasicTensor<U>();
}

/// A bfloat16 tensor widened to float32 (exact, differentiable); any other argument as it is.
inline BasicTensor<float> widened(const BasicTensor<bfloat16>& t) { return as_dtype<float>(t); }
template <class A>
const A& widened(const A& a) {
  return a;
}

/// Rule 1: f (an op over float32 tensors) on the widened arguments, its result rounded to
/// bfloat16 — to<bfloat16>(f(to<float>(x)...)), every cast recorded.
template <class F, class... Args>
BasicTensor<bfloat16> in_float32(F f, const Args&... args) {
  return as_dtype<bfloat16>(f(widened(args)...));
}

/// Rules 1 and 2 for an op's tensors of (floating) element types Ts: promoted to their common
/// type, which if bfloat16 is computed in float32 (in_float32), and f applied.
template <class F, class... Ts>
auto route(F f, const BasicTensor<Ts>&... xs) {
  using P = promote_t<Ts...>;
  if constexpr (is_bfloat16<P>) return in_float32(f, xs...);
  else return f(as_dtype<P>(xs)...);
}

/// A scalar as an element of a T tensor: to bfloat16 through float, rounding to nearest even as
/// to<bfloat16> does (so an op on bfloat16 directly gives the float32 route's bits).
template <class T, class S>
T element_of(S s) {
  if constexpr (is_bfloat16<T>) return to_bfloat16(static_cast<float>(s));
  else return static_cast<T>(s);
}

}  // namespace remat::detail
