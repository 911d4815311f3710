// fit_in_memory: the setting it chooses fits the cap when it is run as training runs it (the books'
// peak over an optimizer step's micro-batches), a roomy cap takes the whole batch at once, and bad
// input names what would work. Which setting wins on speed is the benchmark's to report, not a test's.

#include "checkpoint/support_checkpoint.hpp"

#include <thread>

using namespace remat;

namespace {

/// A GPT of 4 blocks and a fixed batch of 8 rows of 12 tokens; loss_of(rows) takes the first rows.
struct FitModel {
  Generator gen{11};
  nn::GPT gpt{test::gpt_config(23, 12, 4, 2, 32, 0.1), gen};
  std::vector<std::int64_t> x, y;
  static constexpr std::int64_t kRows = 8, kContext = 12;

  FitModel() {
    for (std::int64_t i = 0; i < kRows * kContext; ++i) {
      x.push_back((i * 7 + 3) % 23);
      y.push_back((i * 5 + 1) % 23);
    }
  }
  LongTensor rows(const std::vector<std::int64_t>& v, std::int64_t first, std::int64_t n) const {
    return tensor<std::int64_t>(std::vector<std::int64_t>(v.begin() + first * kContext, v.begin() + (first + n) * kContext),
                                {n, kContext});
  }
  Tensor loss(std::int64_t first, std::int64_t n) { return gpt.loss(rows(x, first, n), rows(y, first, n)); }
  std::size_t parameter_bytes() {
    std::size_t b = 0;
    for (const Tensor* p : gpt.parameters()) b += p->nbytes();
    return b;
  }

  /// The training memory of one optimizer step run as the choice says, as training runs it: the
  /// parameters, AdamW's two moments, and the peak of its micro-batches on top — accumulated into
  /// the gradients an earlier micro-batch left, or, for a single one, making its own after
  /// zero_grad(), as an optimizer step leaves them.
  std::size_t step_bytes(const FitChoice& c) {
    std::optional<MemoryBudget> budget;
    if (c.activation_budget) budget.emplace(*c.activation_budget);
    auto micro_batches = [&] {
      for (std::int64_t k = 0; k < c.accumulation; ++k) loss(k * c.micro_batch, c.micro_batch).backward();
    };
    micro_batches();  // the gradients, and a budget's plan
    if (c.accumulation == 1) gpt.zero_grad();
    const std::size_t gradients = c.accumulation == 1 ? 0 : parameter_bytes();
    MemoryScope scope;
    micro_batches();
    gpt.zero_grad();
    return 3 * parameter_bytes() + gradients + (scope.peak_bytes() - scope.start_bytes());
  }
};

}  // namespace

TEST_CASE("fit_in_memory: a roomy cap runs the whole batch at once, and the choice fits as training runs it",
          "[fit]") {
  FitModel m;
  FitOptions o;
  o.memory_bytes = std::size_t{1} << 30;
  o.global_batch = FitModel::kRows;
  o.repeats = 1;
  const Generator::State rng = default_generator().state();
  const FitChoice c = fit_in_memory(m.gpt, [&](std::int64_t rows) { return m.loss(0, rows); }, o);
  INFO(c.str());
  CHECK(c.micro_batch == FitModel::kRows);
  CHECK(c.accumulation == 1);
  CHECK(c.state_bytes == 4 * m.parameter_bytes());  // parameters, gradients, AdamW's two moments
  CHECK(c.measured_bytes <= o.memory_bytes);
  CHECK(c.candidates.size() >= o.policies.size());
  // What the measurement dirtied is put back: the dropout stream and the gradients.
  CHECK(default_generator().state() == rng);
  for (const Tensor* p : m.gpt.parameters()) CHECK_FALSE(p->grad().defined());
  CHECK(c.str().find("choice: ") != std::string::npos);
}

TEST_CASE("fit_in_memory: under a cap the whole batch without checkpointing does not fit, the choice does",
          "[fit]") {
  FitModel m;
  // What the whole batch costs without checkpointing, measured as fit measures it.
  FitChoice plain;
  plain.micro_batch = FitModel::kRows;
  plain.accumulation = 1;
  const std::size_t whole = m.step_bytes(plain);
  const std::size_t model_state = 3 * m.parameter_bytes();  // parameters and AdamW's moments
  FitOptions o;
  o.global_batch = FitModel::kRows;
  o.repeats = 1;
  o.memory_bytes = model_state + (whole - model_state) * 6 / 10;
  const FitChoice c = fit_in_memory(m.gpt, [&](std::int64_t rows) { return m.loss(0, rows); }, o);
  INFO(c.str());
  CHECK(c.micro_batch * c.accumulation == FitModel::kRows);
  CHECK(c.measured_bytes <= o.memory_bytes);
  CHECK_FALSE((c.setting == "none" && c.micro_batch == FitModel::kRows));
  // Run as training runs it (each micro-batch a different slice of the batch), it stays within the cap.
  CHECK(m.step_bytes(c) <= o.memory_bytes);
  CHECK(m.step_bytes(c) == c.measured_bytes);  // fit measured what training runs
  // Every candidate said to fit was measured within the cap.
  for (const FitCandidate& k : c.candidates)
    if (k.fits) CHECK(k.measured_bytes <= o.memory_bytes);
}

TEST_CASE("fit_in_memory: bad input names what would work", "[fit][errors]") {
  FitModel m;
  FitOptions o;
  o.global_batch = FitModel::kRows;
  o.repeats = 1;
  auto loss_of = [&](std::int64_t rows) { return m.loss(0, rows); };
  const std::size_t state = 4 * m.parameter_bytes();

  o.memory_bytes = state - 1;
  REQUIRE_ERROR(fit_in_memory(m.gpt, loss_of, o), "fit_in_memory", "below the model state", "optimizer state");

  o.memory_bytes = state + 1024;  // the state fits, no micro-batch does
  REQUIRE_ERROR(fit_in_memory(m.gpt, loss_of, o), "fit_in_memory: nothing fits", "would work");

  o.memory_bytes = std::size_t{1} << 30;
  // A batch shape the model rejects: its context is longer than the model's.
  REQUIRE_ERROR(fit_in_memory(m.gpt, [&](std::int64_t rows) {
                  const LongTensor long_rows = zeros<std::int64_t>({rows, 2 * FitModel::kContext});
                  return m.gpt.loss(long_rows, long_rows);
                }, o),
                "fit_in_memory: a micro-batch of 1 rows under none failed");
  REQUIRE_ERROR(fit_in_memory(m.gpt, [&](std::int64_t rows) { return m.gpt.forward(m.rows(m.x, 0, rows)); }, o),
                "a scalar loss was expected");
  o.policies = {"blocks", "every other"};
  REQUIRE_ERROR(fit_in_memory(m.gpt, loss_of, o), "policy::parse", "every other");
  o.policies = {"none"};
  o.global_batch = 0;
  REQUIRE_ERROR(fit_in_memory(m.gpt, loss_of, o), "global batch must be positive");
}

TEST_CASE("memory budget: one ended on another thread than its own leaves its own thread free for the next",
          "[memory][budget]") {
  FitModel m;
  auto budget = std::make_unique<MemoryBudget>(std::size_t{1} << 30);
  m.loss(0, 2).backward();
  m.gpt.zero_grad();
  std::thread other([&] { budget.reset(); });  // handed over in a holder, ended there
  other.join();
  // This thread is not left pointing at the freed budget: a new one starts and governs its steps.
  MemoryBudget next(std::size_t{1} << 30);
  m.loss(0, 2).backward();
  CHECK(next.last_log().budget == std::size_t{1} << 30);
  CHECK(next.last_log().peak_saved_bytes > 0);
}
