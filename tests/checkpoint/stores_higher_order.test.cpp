// Second order (a gradient penalty's gradients through create_graph, and hvp) with saved-tensor
// stores in force: a MemoryBudget discarding and recomputing, Offload writing files, a store of
// the user's own, SaveInBFloat16. A backward takes its saved tensors' identities from its node and
// only their values from the store, so the results are the in-RAM run's, bit for bit, except
// under the lossy 16-bit store.
#include "checkpoint/support_checkpoint.hpp"

#include <functional>
#include <optional>

#include <remat/checkpoint/runtime_budget.hpp>
#include <remat/io/offload.hpp>

using namespace remat;

namespace stores_second_order {

constexpr int kLayers = 5;
constexpr std::int64_t kWidth = 32;

/// The inputs both quantities differentiate: x, then each layer's weight and bias.
std::vector<Tensor> inputs() {
  Generator g(21);
  std::vector<Tensor> in{randn({48, kWidth}, g)};
  for (int i = 0; i < kLayers; ++i) {
    in.push_back(randn({kWidth, kWidth}, g) * 0.2f);
    in.push_back(randn({kWidth}, g) * 0.1f);
  }
  for (Tensor& t : in) t = t.detach().requires_grad_();
  return in;
}

std::vector<Tensor> direction() {
  Generator g(22);
  std::vector<Tensor> v;
  for (const Tensor& t : inputs()) v.push_back(randn(t.shape(), g));
  return v;
}

/// A residual stack with dropout, of the inputs above; its loss.
Tensor loss_of(const std::vector<Tensor>& in) {
  Tensor h = in[0];
  for (int i = 0; i < kLayers; ++i) {
    const auto k = static_cast<std::size_t>(1 + 2 * i);
    h = h + dropout(tanh(linear(h, in[k], in[k + 1])), 0.1);
  }
  return mean(h * h);
}

struct Run {
  std::vector<Tensor> values;  // the penalty's gradients, or H·v: one per input
  std::size_t peak_saved = 0;
  BudgetLog log;
};

enum class Quantity { penalty, hvp };

/// One second-order computation (fixed dropout seed) with `store` installed around it (nothing when
/// empty); a budget's log when `budget` is given.
Run second_order(Quantity q, const std::function<std::any()>& store = {},
                 std::optional<std::size_t> budget = std::nullopt) {
  test::FreshTape fresh;
  manual_seed(5);
  Run r;
  MemoryScope scope;
  {
    std::optional<MemoryBudget> guard;
    if (budget) guard.emplace(*budget);
    const std::any installed = store ? store() : std::any();
    const std::vector<Tensor> in = inputs();
    if (q == Quantity::penalty) {
      const Tensor loss = loss_of(in);
      GradOptions recorded;
      recorded.create_graph = true;
      Tensor penalty = loss;
      for (const Tensor& g : grad(loss, in, recorded)) penalty = penalty + sum(g * g) * 0.5f;
      penalty.backward();
      for (const Tensor& t : in) r.values.push_back(t.grad());
    } else {
      r.values = hvp(loss_of, in, direction()).second;
    }
    if (guard) r.log = guard->last_log();
  }
  r.peak_saved = scope.peak_saved_activation_bytes();
  return r;
}

/// ‖a − b‖ / ‖a‖ over all tensors together.
double relative_gap(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (detail::flat(a[i]).cast<double>() - detail::flat(b[i]).cast<double>()).square().sum();
    norm += detail::flat(a[i]).cast<double>().square().sum();
  }
  return std::sqrt(diff / norm);
}

}  // namespace stores_second_order

using namespace stores_second_order;

TEST_CASE("second order under a memory budget: bitwise the unbudgeted results, every moment within the budget",
          "[budget][higher_order]") {
  for (const Quantity q : {Quantity::penalty, Quantity::hvp}) {
    const Run free_run = second_order(q);
    // The penalty's walk records a graph of its own (counted and capped with the forward's); hvp's
    // tangent walk records nothing, and its tangents live outside the books.
    for (const int percent : {100, 75, 50}) {
      const std::size_t budget = free_run.peak_saved * static_cast<std::size_t>(percent) / 100;
      std::string error;
      Run r;
      try {
        r = second_order(q, {}, budget);
      } catch (const Error& e) {
        error = e.what();
      }
      INFO((q == Quantity::penalty ? "penalty" : "hvp") << ": budget " << budget << " B of the free peak "
           << free_run.peak_saved << " B: peak " << r.peak_saved << " B, " << r.log.discards << " discards, "
           << r.log.recomputes << " recomputes; " << error);
      if (percent == 50) {
        // Below what the step must hold (its inputs are leaves, never discarded): as at first
        // order, the step completes and the error names the least budget.
        CHECK(error.find("smallest budget that works for this step is") != std::string::npos);
        continue;
      }
      REQUIRE(error.empty());
      CHECK(r.peak_saved <= budget);
      test::require_bitwise(r.values, free_run.values, "result");
      if (percent < 100) CHECK(r.log.recomputes > 0);
    }
  }
}

TEST_CASE("second order with Offload: bitwise the in-RAM results, files written and gone", "[offload][higher_order]") {
  test::TempDir dir;
  for (const Quantity q : {Quantity::penalty, Quantity::hvp}) {
    const Run in_ram = second_order(q);
    std::size_t written = 0;
    const Run offloaded = second_order(q, [&] {
      OffloadOptions options;
      options.directory = dir.path;
      options.min_bytes = 0;
      options.wait_for_writes = true;  // every tensor on disk before backward reads it
      auto offload = std::make_shared<Offload>(options);
      // Counted when the scope ends (the store's tensors all read back by then).
      return std::shared_ptr<void>(nullptr, [offload, &written](void*) { written = offload->stats().files_written; });
    });
    CHECK(written > 0);
    test::require_bitwise(offloaded.values, in_ram.values, "result");
    CHECK(offloaded.peak_saved < in_ram.peak_saved);
  }
  CHECK(dir.files().empty());
}

TEST_CASE("second order with a store of the user's own, and with SaveInBFloat16", "[higher_order]") {
  for (const Quantity q : {Quantity::penalty, Quantity::hvp}) {
    const Run in_ram = second_order(q);
    std::size_t packed = 0;
    const Run copied = second_order(q, [&] {
      return std::make_shared<SavedTensorHooks>(
          [&packed](const AnyTensor& t) -> std::any {
            ++packed;
            return Tensor(detail::copy_of(t.as<float>()));
          },
          [](const std::any& p) -> AnyTensor { return std::any_cast<const Tensor&>(p); });
    });
    CHECK(packed > 0);
    test::require_bitwise(copied.values, in_ram.values, "result");
    // Lossy by design: saved activations rounded to 16 bits.
    const Run rounded = second_order(q, [] { return std::make_shared<SaveInBFloat16>(); });
    const double gap = relative_gap(in_ram.values, rounded.values);
    INFO("relative gap under SaveInBFloat16: " << gap);
    CHECK(gap > 0);
    CHECK(gap < 1e-2);
  }
}
