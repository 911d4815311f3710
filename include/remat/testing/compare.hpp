#pragma once
// The test every user of checkpointing should write: the same step with and without it must give
// the same loss and the same gradient for every parameter, bit for bit (every kernel is
// deterministic on the CPU and replays restore the generator). compare_gradients runs both and
// reports the first tensor that differs, where, and by how much.
//
//   auto r = remat::testing::compare_checkpointing(gpt, remat::policy::parse("sqrt"),
//                                                  [&] { return gpt.loss(idx, targets); });
//   REQUIRE(r.equal);  // r.message names the first differing gradient

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "remat/checkpoint/apply.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/random.hpp"
#include "remat/nn/module.hpp"

namespace remat {
/// Test helpers: bit-for-bit comparison of runs with and without checkpointing, and gradient checks.
namespace testing {

/// Whether two runs gave the same loss and parameter gradients, bit for bit (compare_gradients).
struct GradientComparison {
  /// Whether every compared tensor was bitwise equal.
  bool equal = true;
  std::size_t tensors_compared = 0;  ///< the loss and every parameter
  std::string message;               ///< the first difference, or a summary when there is none
  /// equal.
  explicit operator bool() const { return equal; }
};

}  // namespace testing

namespace detail {

/// Zeroes the gradients, seeds the thread's generator, runs loss_fn and backward; returns the loss
/// and every parameter's gradient (undefined where none arrived).
inline std::pair<Tensor, std::vector<Tensor>> comparison_step(nn::Module& model, const std::function<Tensor()>& loss_fn,
                                                       std::uint64_t seed) {
  model.zero_grad();
  const Generator::State before = default_generator().state();
  default_generator().manual_seed(seed);
  Tensor loss = loss_fn();
  loss.backward();
  default_generator().set_state(before);
  std::vector<Tensor> grads;
  for (auto& [name, p] : model.named_parameters()) grads.push_back(p->grad().defined() ? copy_of(p->grad()) : Tensor());
  return {copy_of(loss.detach()), grads};
}

/// The first difference between two tensors of the same role, or an empty string.
inline std::string first_difference(const std::string& what, const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined())
    return fmt::format("{}: {} has a gradient and {} has none", what, a.defined() ? "reference" : "checkpointed",
                       a.defined() ? "checkpointed" : "reference");
  if (!a.defined()) return {};
  if (a.shape() != b.shape()) return fmt::format("{}: shape {} vs {}", what, a.shape(), b.shape());
  const float* pa = a.data();
  const float* pb = b.data();
  std::int64_t first = -1, count = 0;
  double worst = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i, pb + i, sizeof(float)) == 0) continue;
    if (first < 0) first = i;
    ++count;
    worst = std::max(worst, std::abs(static_cast<double>(pa[i]) - static_cast<double>(pb[i])));
  }
  if (first < 0) return {};
  return fmt::format("{} (shape {}): {} of {} elements differ; first at flat index {}: {:.9g} (reference) vs {:.9g} "
                     "(checkpointed); largest difference {:.3g}", what, a.shape(), count, a.numel(), first, pa[first],
                     pb[first], worst);
}

}  // namespace detail

namespace testing {

/// Runs `reference()` and `checkpointed()` (each builds the loss of one step on `model`) from the
/// same generator seed, backpropagates each, and compares the losses and every parameter gradient
/// bit for bit. Gradients are zeroed before each run and left as the checkpointed run made them.
inline GradientComparison compare_gradients(nn::Module& model, const std::function<Tensor()>& reference,
                                            const std::function<Tensor()>& checkpointed, std::uint64_t seed = 0) {
  const auto [loss_a, grads_a] = detail::comparison_step(model, reference, seed);
  const auto [loss_b, grads_b] = detail::comparison_step(model, checkpointed, seed);
  GradientComparison out;
  std::vector<std::string> names{"loss"};
  std::vector<std::pair<Tensor, Tensor>> pairs{{loss_a, loss_b}};
  const auto params = model.named_parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    names.push_back("gradient of " + params[i].first);
    pairs.emplace_back(grads_a[i], grads_b[i]);
  }
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    ++out.tensors_compared;
    if (std::string d = detail::first_difference(names[i], pairs[i].first, pairs[i].second); !d.empty()) {
      out.equal = false;
      out.message = d;
      return out;
    }
  }
  out.message = fmt::format("the loss and {} parameter gradients are bitwise equal", params.size());
  return out;
}

/// compare_gradients for a model that runs a stack of blocks (nn::GPT, nn::Sequential): the
/// reference runs its blocks plainly, the other under `how`; the model's runner is put back after.
template <class Stack>
GradientComparison compare_checkpointing(Stack& model, const Checkpointing& how, const std::function<Tensor()>& loss_fn,
                                         std::uint64_t seed = 0) {
  struct Restore {
    Stack& m;
    std::decay_t<decltype(model.block_runner())> runner;  // a copy of the runner installed now
    ~Restore() { m.set_block_runner(runner); }
  } restore{model, model.block_runner()};
  return compare_gradients(
      model,
      [&] {
        apply_checkpointing(model, Checkpointing::none());
        return loss_fn();
      },
      [&] {
        apply_checkpointing(model, how);
        return loss_fn();
      },
      seed);
}

}  // namespace testing
}  // namespace remat
