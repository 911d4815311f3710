#pragma once
// The test every user of checkpointing should write: the same step with and without it must give
// the same loss and the same gradient for every parameter, bit for bit (every kernel is
// deterministic on the CPU and replays restore the generator). compare_gradients runs both and
// reports the first tensor that differs, where, and by how much.
//
//   auto r = remat::testing::compare_checkpointing(gpt, remat::policy::parse("sqrt"),
//                                                  [&] { return gpt.loss(idx, targets); });
//   REQUIRE(r.equal);  // r.message names the first differing gradient
//
// When what must agree is not a model's parameter gradients — an input's gradient, an output, a
// generator's state after backward, a counter — compare_runs takes two runs that each do the whole
// step themselves and return a RunRecord of what they left; it compares the records entry by entry
// (tensors bit for bit, counts exactly) and reports the first difference the same way.
//
//   auto run = [&](bool checkpointed) {
//     Tensor x = data.detach().requires_grad_();
//     Tensor y = checkpointed ? checkpoint(block, x) : block(x);
//     sum(y * y).backward();
//     return remat::testing::RunRecord().tensor("output", y).grad("x", x).state("generator", mine.state());
//   };
//   auto r = remat::testing::compare_runs([&] { return run(false); }, [&] { return run(true); });
//   REQUIRE(r.equal);  // r.message: "gradient of x (shape (2, 6, 16)): 3 of 192 elements differ; ..."

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

/// Whether two runs agreed, bit for bit (compare_runs, compare_gradients, compare_checkpointing).
struct GradientComparison {
  /// Whether every compared entry was equal: tensors bitwise, counts exactly.
  bool equal = true;
  /// The entries compared, up to and including the first difference (compare_gradients: the loss
  /// and every parameter).
  std::size_t tensors_compared = 0;
  std::string message;  ///< the first difference, or a summary when there is none
  /// equal.
  explicit operator bool() const { return equal; }
};

/// What one run of compare_runs leaves to be compared, in the order added: named tensors (copied
/// when added, compared bit for bit) and named counts (compared exactly).
class RunRecord {
 public:
  /// One thing a run left.
  struct Entry {
    std::string name;   ///< what the messages call it
    /// A tensor entry's values, copied, of any element type (undefined: the run had none).
    detail::TensorRef tensor;
    std::string count;  ///< a count entry's value, as text
    bool is_tensor = true;   ///< a tensor entry (else a count)
    bool required = false;   ///< a gradient both runs must give (grad())
  };

  /// `t`'s values as they are now, of any element type (an undefined `t` is allowed, e.g. a
  /// gradient that may not arrive: then the other run's must be undefined too).
  template <class T>
  RunRecord& tensor(std::string name, const BasicTensor<T>& t) {
    detail::TensorRef copy;
    if (t.defined()) {
      const BasicTensor<T> c = detail::copy_of(t.detach());
      copy = {c.storage(), c.shape(), c.dtype()};
    }
    entries_.push_back({std::move(name), std::move(copy), {}, true, false});
    return *this;
  }
  /// `t`'s gradient, named "gradient of <name>"; a run that gave `t` none differs, even from a run
  /// that gave none either.
  template <class T>
  RunRecord& grad(const std::string& name, const BasicTensor<T>& t) {
    tensor("gradient of " + name, t.grad());
    entries_.back().required = true;
    return *this;
  }
  /// Every parameter gradient of `model`, in named_parameters order, named "gradient of
  /// <parameter name>" (a parameter no gradient reached: undefined, as tensor()).
  RunRecord& grads(nn::Module& model) {
    for (auto& [name, p] : model.named_parameters()) tensor("gradient of " + name, p->grad());
    return *this;
  }
  /// A count the run leaves (calls, recomputations, replays).
  RunRecord& count(std::string name, long long value) {
    entries_.push_back({std::move(name), detail::TensorRef(), std::to_string(value), false, false});
    return *this;
  }
  /// Where a generator stands after the run (Generator::state()).
  RunRecord& state(std::string name, const Generator::State& s) {
    entries_.push_back({std::move(name), detail::TensorRef(), fmt::format("seed {}, offset {}", s.seed, s.offset), false, false});
    return *this;
  }
  /// The entries, in the order added.
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;
};

}  // namespace testing

namespace detail {

/// Runs `run` from generator seed `seed` on the thread's default generator, which is put back as
/// it was afterwards (also when `run` throws); returns what the run recorded.
inline testing::RunRecord recorded_run(const std::function<testing::RunRecord()>& run, std::uint64_t seed) {
  struct Restore {
    Generator::State before = default_generator().state();
    ~Restore() { default_generator().set_state(before); }
  } restore;
  default_generator().manual_seed(seed);
  return run();
}

/// The first difference between two tensors of element type T and the same shape, or an empty string.
template <class T>
std::string first_difference_of(const std::string& what, const TensorRef& a, const TensorRef& b) {
  const auto* pa = static_cast<const T*>(a.storage->data());
  const auto* pb = static_cast<const T*>(b.storage->data());
  const std::int64_t n = a.shape.numel();
  std::int64_t first = -1, count = 0;
  double worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::memcmp(pa + i, pb + i, sizeof(T)) == 0) continue;
    if (first < 0) first = i;
    ++count;
    worst = std::max(worst, std::abs(static_cast<double>(pa[i]) - static_cast<double>(pb[i])));
  }
  if (first < 0) return {};
  // float32 unnamed (what models train in); every digit that tells two values of the type apart.
  const std::string type = std::is_same_v<T, float> ? std::string() : fmt::format(", {}", a.dtype);
  const int digits = std::is_same_v<T, double> ? 17 : 9;
  return fmt::format("{} (shape {}{}): {} of {} elements differ; first at flat index {}: {:.{}g} (reference) vs "
                     "{:.{}g} (checkpointed); largest difference {:.3g}", what, a.shape, type, count, n, first,
                     static_cast<double>(pa[first]), digits, static_cast<double>(pb[first]), digits, worst);
}

/// The first difference between two tensors of the same role, or an empty string.
inline std::string first_difference(const std::string& what, const TensorRef& a, const TensorRef& b) {
  if (a.defined() != b.defined())
    return fmt::format("{}: {} has a gradient and {} has none", what, a.defined() ? "reference" : "checkpointed",
                       a.defined() ? "checkpointed" : "reference");
  if (!a.defined()) return {};
  if (a.shape != b.shape) return fmt::format("{}: shape {} vs {}", what, a.shape, b.shape);
  if (std::strcmp(a.dtype, b.dtype) != 0) return fmt::format("{}: {} vs {}", what, a.dtype, b.dtype);
  const std::string type = a.dtype;
  if (type == dtype_name<float>()) return first_difference_of<float>(what, a, b);
  if (type == dtype_name<double>()) return first_difference_of<double>(what, a, b);
  if (type == dtype_name<bfloat16>()) return first_difference_of<bfloat16>(what, a, b);
  if (type == dtype_name<std::int64_t>()) return first_difference_of<std::int64_t>(what, a, b);
  return first_difference_of<bool>(what, a, b);
}

/// The first difference between two entries of the same name, or an empty string.
inline std::string first_difference(const testing::RunRecord::Entry& a, const testing::RunRecord::Entry& b) {
  if (a.is_tensor != b.is_tensor)
    return fmt::format("{}: a {} in the reference run, a {} in the checkpointed one", a.name,
                       a.is_tensor ? "tensor" : "count", b.is_tensor ? "tensor" : "count");
  if (!a.is_tensor)
    return a.count == b.count ? std::string()
                              : fmt::format("{}: {} (reference) vs {} (checkpointed)", a.name, a.count, b.count);
  if ((a.required || b.required) && !a.tensor.defined() && !b.tensor.defined())
    return fmt::format("{}: neither run gave a gradient", a.name);
  return first_difference(a.name, a.tensor, b.tensor);
}

/// Compares two records entry by entry: the loop compare_runs and compare_gradients share.
inline testing::GradientComparison compare_records(const testing::RunRecord& reference,
                                                   const testing::RunRecord& checkpointed) {
  const auto& a = reference.entries();
  const auto& b = checkpointed.entries();
  testing::GradientComparison out;
  std::size_t tensors = 0;
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    std::string d;
    if (i >= a.size() || i >= b.size())
      d = fmt::format("the reference run recorded {} entries and the checkpointed run {}; the first unmatched is {}",
                      a.size(), b.size(), i < a.size() ? a[i].name : b[i].name);
    else if (a[i].name != b[i].name)
      d = fmt::format("entry {}: '{}' in the reference run, '{}' in the checkpointed one", i, a[i].name, b[i].name);
    else
      d = first_difference(a[i], b[i]);
    ++out.tensors_compared;
    if (!d.empty()) {
      out.equal = false;
      out.message = d;
      return out;
    }
    tensors += a[i].is_tensor;
  }
  out.message = fmt::format("{} tensors bitwise equal and {} counts equal", tensors, a.size() - tensors);
  return out;
}

}  // namespace detail

namespace testing {

/// Runs `reference()` and `checkpointed()`, each from generator seed `seed` (the thread's default
/// generator is put back after each), and compares what they recorded entry by entry: the same
/// names in the same order, tensors bit for bit, counts exactly. Each run does its whole step —
/// builds the loss, backpropagates, then records what must agree (RunRecord: outputs, input and
/// parameter gradients, counters, generator states). The message names the first difference.
inline GradientComparison compare_runs(const std::function<RunRecord()>& reference,
                                       const std::function<RunRecord()>& checkpointed, std::uint64_t seed = 0) {
  const RunRecord a = detail::recorded_run(reference, seed);
  const RunRecord b = detail::recorded_run(checkpointed, seed);
  return detail::compare_records(a, b);
}

/// Runs `reference()` and `checkpointed()` (each builds the loss of one step on `model`) from the
/// same generator seed, backpropagates each, and compares the losses and every parameter gradient
/// bit for bit (compare_runs). Gradients are zeroed before each run and left as the checkpointed
/// run made them.
inline GradientComparison compare_gradients(nn::Module& model, const std::function<Tensor()>& reference,
                                            const std::function<Tensor()>& checkpointed, std::uint64_t seed = 0) {
  auto step = [&model](const std::function<Tensor()>& loss_fn) {
    return [&model, &loss_fn] {
      model.zero_grad();
      Tensor loss = loss_fn();
      loss.backward();
      return RunRecord().tensor("loss", loss).grads(model);
    };
  };
  GradientComparison out = compare_runs(step(reference), step(checkpointed), seed);
  if (out.equal)
    out.message = fmt::format("the loss and {} parameter gradients are bitwise equal", out.tensors_compared - 1);
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
