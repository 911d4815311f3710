#pragma once
#include <cmath>
#include <string_view>

#include <unsupported/Eigen/SpecialFunctions>

#include "remat/ops/add.hpp"
#include "remat/ops/detail/dtype.hpp"
#include "remat/ops/detail/unary.hpp"
#include "remat/ops/erf.hpp"
#include "remat/ops/exp.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sub.hpp"
#include "remat/ops/tanh.hpp"

namespace remat {
namespace op {
/// The id of gelu(x, GeluApproximation::tanh): GELU by GPT-2's tanh approximation.
inline const OpId gelu_tanh = register_op("gelu_tanh", tangent_rule);
/// The id of gelu(x): the exact GELU, x Φ(x) with erf.
inline const OpId gelu = register_op("gelu", tangent_rule);
}  // namespace op


/// How gelu computes Φ(x): exactly with erf, or with GPT-2's tanh approximation.
enum class GeluApproximation { none, tanh };

namespace detail {

/// GELU's formulas, shared by gelu and bias_gelu. The derivatives are written once for Eigen arrays
/// and tensors (erf_of, exp_of, tanh_of and operators), so a backward that records its ops
/// (create_graph) makes the same operations as the array one.
/// Exact:  y = x Φ(x), Φ(x) = ½(1 + erf(x/√2)).  dx = dy (Φ(x) + x φ(x)), φ(x) = e^{-x²/2}/√(2π).
/// Tanh:   y = ½ x (1 + tanh u), u = √(2/π)(x + 0.044715 x³).
///         dx = dy (½(1 + tanh u) + ½ x (1 - tanh² u) √(2/π)(1 + 3·0.044715 x²)).
template <class T>
struct Gelu {
  static constexpr T kInvSqrt2 = T(0.70710678118654752440);
  static constexpr T kInvSqrt2Pi = T(0.39894228040143267794);
  static constexpr T kSqrt2OverPi = T(0.79788456080286535588);
  static constexpr T kCubic = T(0.044715);

  template <class A>
  static auto exact(const A& a) {
    return a * T(0.5) * (T(1) + (a * kInvSqrt2).erf());
  }
  /// Φ(a), the first term of the exact derivative.
  template <class A>
  static auto exact_cdf(const A& a) {
    return T(0.5) * (T(1) + erf_of(a * kInvSqrt2));
  }
  /// a φ(a), the second; a kernel may store it first (the same bits: every step rounds to T).
  template <class A>
  static auto exact_density(const A& a) {
    return a * kInvSqrt2Pi * exp_of(T(-0.5) * (a * a));
  }
  /// dy (Φ(a) + a φ(a)) from the second term as computed, for a kernel that stored it.
  template <class D, class A, class Q>
  static auto exact_grad_given(const D& dy, const A& a, const Q& density) {
    return dy * (exact_cdf(a) + density);
  }
  template <class D, class A>
  static auto exact_grad(const D& dy, const A& a) {
    return exact_grad_given(dy, a, exact_density(a));
  }
  template <class A>
  static auto tanh(const A& a) {
    return T(0.5) * a * (T(1) + (kSqrt2OverPi * (a + kCubic * a.cube())).tanh());
  }
  template <class D, class A>
  static auto tanh_grad(const D& dy, const A& a) {
    const auto t = tanh_of(kSqrt2OverPi * (a + kCubic * (a * a * a)));
    return dy * (T(0.5) * (T(1) + t) + T(0.5) * a * (T(1) - t * t) * kSqrt2OverPi * (T(1) + T(3) * kCubic * (a * a)));
  }
  /// The second derivative (of arrays: a backward carrying tangents, fused): exact, φ(a)(2 − a²);
  /// tanh, with t = tanh u, u' = √(2/π)(1 + 3·0.044715 a²), u'' = 6·0.044715 √(2/π) a:
  /// (1 − t²)(u' − a t u'² + ½ a u'').
  template <class A>
  static Eigen::Array<T, Eigen::Dynamic, 1> exact_second(const A& a) {
    return kInvSqrt2Pi * (T(-0.5) * (a * a)).exp() * (T(2) - a * a);
  }
  template <class A>
  static Eigen::Array<T, Eigen::Dynamic, 1> tanh_second(const A& a) {
    const Eigen::Array<T, Eigen::Dynamic, 1> t = (kSqrt2OverPi * (a + kCubic * (a * a * a))).tanh();
    const Eigen::Array<T, Eigen::Dynamic, 1> u1 = kSqrt2OverPi * (T(1) + T(3) * kCubic * (a * a));
    return (T(1) - t * t) * (u1 - a * t * u1 * u1 + T(3) * kCubic * kSqrt2OverPi * a * a);
  }
};

}  // namespace detail

/// y = x Φ(x) (exact, with erf) or GPT-2's tanh approximation; formulas in detail::Gelu.
/// Saves: x (the derivative is not a function of y).
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> gelu(const BasicTensor<T>& x, GeluApproximation approximate = GeluApproximation::none) {
  if constexpr (detail::routed<T>()) return detail::route([approximate](const auto& a) { return remat::gelu(a, approximate); }, x);
  else {
    using F = detail::Gelu<T>;
    if (approximate == GeluApproximation::tanh)
      return detail::unary_saving_input(
          op::gelu_tanh, x, [](const auto& a) { return F::tanh(a); },
          [](const auto& dy, const auto& a) { return F::tanh_grad(dy, a); }, detail::same_formula);
    return detail::unary_saving_input(
        op::gelu, x, [](const auto& a) { return F::exact(a); },
        [](const auto& dy, const auto& a) { return F::exact_grad(dy, a); }, detail::same_formula);
  }
}

/// PyTorch's spelling: gelu(x, "tanh") or gelu(x, "none").
template <class T>
BasicTensor<T> gelu(const BasicTensor<T>& x, std::string_view approximate) {
  REMAT_CHECK(approximate == "none" || approximate == "tanh",
              "gelu: approximate must be \"none\" or \"tanh\", got \"{}\"", approximate);
  return gelu(x, approximate == "tanh" ? GeluApproximation::tanh : GeluApproximation::none);
}

}  // namespace remat
