#pragma once
// Finite-difference gradient checking, public so users can check their own ops and modules.

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/core/factory.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/grad.hpp"
#include "remat/core/tensor.hpp"
#include "remat/ops/add.hpp"
#include "remat/ops/mul.hpp"
#include "remat/ops/sum.hpp"

namespace remat::testing {

/// How gradcheck compares analytic gradients with central differences.
struct GradcheckOptions {
  double eps = 1e-6;   ///< central-difference step
  double atol = 1e-7;  ///< |analytic - numeric| <= atol + rtol * |numeric|
  /// The relative part of the tolerance.
  double rtol = 1e-5;
  std::uint64_t seed = 1234;  ///< for the random projection of non-scalar outputs
};

/// gradcheck's verdict, with the largest error and the first failure.
struct GradcheckResult {
  /// Whether every element was within tolerance.
  bool ok = true;
  double max_abs_error = 0;  ///< the largest |analytic - numeric| over all checked elements
  std::string message;       ///< the first failure, naming input, element and both values
  /// ok.
  explicit operator bool() const { return ok; }
};

/// Compares the tape's gradients of f with central differences, in double. Inputs that require
/// grad are checked (all inputs when none does). A non-scalar output y is reduced to Σ y ⊙ w with
/// a fixed random w, so every output element takes part.
inline GradcheckResult gradcheck(const std::function<DoubleTensor(const std::vector<DoubleTensor>&)>& f,
                                 const std::vector<DoubleTensor>& inputs, GradcheckOptions opt = {}) {
  std::vector<DoubleTensor> xs;
  bool any = false;
  for (const DoubleTensor& x : inputs) any = any || x.requires_grad();
  std::vector<bool> checked;
  for (const DoubleTensor& x : inputs) {
    const bool check = any ? x.requires_grad() : true;
    DoubleTensor leaf = detail::copy_of(x);
    if (check) leaf.requires_grad_();
    xs.push_back(leaf);
    checked.push_back(check);
  }

  DoubleTensor y = f(xs);
  Generator gen(opt.seed);
  const DoubleTensor w = randn<double>(y.shape(), gen);
  REMAT_CHECK(y.requires_grad(), "gradcheck: the function's output does not require grad; no input reached it");
  y.backward(w);

  auto projected = [&]() {
    no_grad guard;
    const DoubleTensor out = f(xs);
    return (detail::flat(out) * detail::flat(w)).sum();
  };

  GradcheckResult result;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    if (!checked[i]) continue;
    const DoubleTensor analytic = xs[i].grad();
    for (std::int64_t j = 0; j < xs[i].numel(); ++j) {
      double* p = xs[i].data() + j;
      const double saved = *p;
      *p = saved + opt.eps;
      const double plus = projected();
      *p = saved - opt.eps;
      const double minus = projected();
      *p = saved;
      const double numeric = (plus - minus) / (2 * opt.eps);
      const double a = analytic.defined() ? analytic.data()[j] : 0.0;
      const double err = std::abs(a - numeric);
      result.max_abs_error = std::max(result.max_abs_error, err);
      if (result.ok && !(err <= opt.atol + opt.rtol * std::abs(numeric))) {
        result.ok = false;
        result.message = fmt::format("gradcheck: input {} (shape {}), element {}: analytic {:.10g} vs numeric {:.10g}",
                                     i, xs[i].shape(), j, a, numeric);
      }
    }
  }
  return result;
}

/// Compares second derivatives (a backward recorded with create_graph, then differentiated) with
/// central differences of first derivatives, in double. With fixed random w of the output's shape
/// and u_i of each checked input's, it checks the gradient of S(x) = Σ_i ⟨∂⟨f(x), w⟩/∂x_i, u_i⟩,
/// which is the Hessian of ⟨f, w⟩ applied to u: every second partial takes part. Inputs are chosen
/// as in gradcheck.
inline GradcheckResult gradgradcheck(const std::function<DoubleTensor(const std::vector<DoubleTensor>&)>& f,
                                     const std::vector<DoubleTensor>& inputs, GradcheckOptions opt = {}) {
  bool any = false;
  for (const DoubleTensor& x : inputs) any = any || x.requires_grad();
  std::vector<DoubleTensor> xs, checked;
  std::vector<std::size_t> index;  // checked[k] is xs[index[k]]
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    DoubleTensor leaf = detail::copy_of(inputs[i]);
    if (any ? inputs[i].requires_grad() : true) {
      leaf.requires_grad_();
      checked.push_back(leaf);
      index.push_back(i);
    }
    xs.push_back(leaf);
  }
  Generator gen(opt.seed);
  DoubleTensor y = f(xs);
  REMAT_CHECK(y.requires_grad(), "gradgradcheck: the function's output does not require grad; no input reached it");
  const DoubleTensor w = randn<double>(y.shape(), gen);
  std::vector<DoubleTensor> us;
  for (const DoubleTensor& x : checked) us.push_back(randn<double>(x.shape(), gen));

  GradOptions recorded;
  recorded.create_graph = true;
  recorded.allow_unused = true;
  const std::vector<DoubleTensor> first = grad(std::vector<DoubleTensor>{y}, checked, {w}, recorded);
  DoubleTensor s;  // S(x), recorded: undefined when no first derivative depends on x (f is linear)
  for (std::size_t k = 0; k < checked.size(); ++k) {
    if (!first[k].defined() || !first[k].requires_grad()) continue;
    DoubleTensor term = sum(mul(first[k], us[k]));
    s = s.defined() ? add(s, term) : term;
  }
  GradOptions unused;
  unused.allow_unused = true;
  std::vector<DoubleTensor> analytic(checked.size());
  if (s.defined()) analytic = grad(std::vector<DoubleTensor>{s}, checked, {}, unused);

  auto projected = [&]() {  // S(x) from first derivatives computed without create_graph
    const DoubleTensor out = f(xs);
    const std::vector<DoubleTensor> g = grad(std::vector<DoubleTensor>{out}, checked, {w}, unused);
    double total = 0;
    for (std::size_t k = 0; k < checked.size(); ++k)
      if (g[k].defined()) total += (detail::flat(g[k]) * detail::flat(us[k])).sum();
    return total;
  };
  GradcheckResult result;
  for (std::size_t k = 0; k < checked.size(); ++k) {
    for (std::int64_t j = 0; j < checked[k].numel(); ++j) {
      double* p = checked[k].data() + j;
      const double saved = *p;
      *p = saved + opt.eps;
      const double plus = projected();
      *p = saved - opt.eps;
      const double minus = projected();
      *p = saved;
      const double numeric = (plus - minus) / (2 * opt.eps);
      const double a = analytic[k].defined() ? analytic[k].data()[j] : 0.0;
      const double err = std::abs(a - numeric);
      result.max_abs_error = std::max(result.max_abs_error, err);
      if (result.ok && !(err <= opt.atol + opt.rtol * std::abs(numeric))) {
        result.ok = false;
        result.message = fmt::format(
            "gradgradcheck: input {} (shape {}), element {}: analytic second derivative {:.10g} vs numeric {:.10g}",
            index[k], checked[k].shape(), j, a, numeric);
      }
    }
  }
  return result;
}

}  // namespace remat::testing
