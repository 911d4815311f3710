#pragma once
// fit_in_memory: what to run so that training fits in a number of bytes, at the most rows a second.
//
//   remat::FitOptions o;
//   o.memory_bytes = 64 << 20;  // the whole training memory: model state and a micro-batch's share
//   o.global_batch = 16;        // rows per optimizer step, kept by gradient accumulation
//   remat::FitChoice c = remat::fit_in_memory(gpt, [&](std::int64_t rows) { return gpt.loss(x.head(rows), ...); }, o);
//   fmt::print("{}", c.str());  // installed on gpt: c.checkpointing; each optimizer step runs
//                               // c.accumulation micro-batches of c.micro_batch rows (under
//                               // MemoryBudget(*c.activation_budget) when it chose a budget)
//
// The training memory is the library's books: the parameters, their gradients, the optimizer's state
// (FitOptions::optimizer_state_per_parameter times the parameters' bytes: 2 for AdamW's moments) and
// what one micro-batch's forward and backward allocate on top (its batch, the activations saved for
// backward, temporaries). What a micro-batch allocates grows linearly with its rows, so two small
// micro-batches measured under each hand-placed policy predict the largest micro-batch that fits (a
// divisor of the global batch, so that accumulation keeps the batch) and its speed; that
// micro-batch is then measured, and a smaller one when it does not fit. A MemoryBudget capping the
// activations at what the cap leaves is measured at micro-batches beyond those the policies reach:
// freed activation memory buys rows, which win back part of the recomputation. The fastest setting
// measured within the cap is chosen, and one optimizer step's worth of its micro-batches is measured
// last: FitChoice holds what was predicted and what that measurement found.
//
// loss_of(rows) runs the forward of a micro-batch of `rows` rows and returns its scalar loss; it is
// called many times, so it should take its rows from a fixed batch rather than from the training
// data stream. The default generator is restored afterwards (dropout draws do not shift the run),
// and the model's gradients are cleared.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/checkpoint/apply.hpp"
#include "remat/checkpoint/runtime_budget.hpp"
#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/random.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

/// What fit_in_memory is to fit, and the settings it may choose from.
struct FitOptions {
  /// The cap on the whole training memory, in bytes (the library's books).
  std::size_t memory_bytes = 0;
  /// Rows per optimizer step: a micro-batch divides it and accumulation makes up the rest.
  std::int64_t global_batch = 0;
  /// The optimizer's state in parameter bytes: 2 for AdamW and Adam, 1 for SGD with momentum, 0 for SGD.
  double optimizer_state_per_parameter = 2.0;
  /// The hand-placed policies to weigh, as policy::parse reads them.
  std::vector<std::string> policies{"none", "selective", "blocks", "sqrt", "binomial:4"};
  /// Whether a MemoryBudget over the activations is weighed too (when "none" is among the policies:
  /// its measurement gives the budget's room).
  bool try_budget = true;
  /// Timed micro-batches per measurement (after one untimed warm-up); their median is taken.
  int repeats = 3;
};

/// One setting at one micro-batch, as fit_in_memory predicted and measured it.
struct FitCandidate {
  /// A policy::parse word, or "budget" (a MemoryBudget over the activations).
  std::string setting;
  /// Rows per micro-batch.
  std::int64_t micro_batch = 0;
  /// For "budget": its cap on the activation bytes saved for backward.
  std::size_t activation_budget = 0;
  /// The training memory predicted from the two small micro-batches (0 for a budget: measured only).
  std::size_t predicted_bytes = 0;
  /// The rows a second predicted from them (0 for a budget).
  double predicted_rows_per_s = 0;
  /// The training memory measured at this micro-batch.
  std::size_t measured_bytes = 0;
  /// The rows a second measured at this micro-batch.
  double measured_rows_per_s = 0;
  /// Whether the measured memory is within the cap.
  bool fits = false;
};

/// What to run, and what it was predicted and measured to cost.
struct FitChoice {
  /// The setting chosen: a policy::parse word, or "budget".
  std::string setting;
  /// The checkpointing to install (fit_in_memory installed it on the model it measured).
  Checkpointing checkpointing;
  /// When the choice is a budget: run every micro-batch under MemoryBudget(*activation_budget),
  /// one budget living across the steps (it replays its plan while the steps repeat).
  std::optional<std::size_t> activation_budget;
  /// Rows per micro-batch.
  std::int64_t micro_batch = 0;
  /// Micro-batches per optimizer step: micro_batch x accumulation = the global batch.
  std::int64_t accumulation = 0;
  /// The cap it was fitted to.
  std::size_t memory_bytes = 0;
  /// Parameters + gradients + optimizer state: what no setting changes.
  std::size_t state_bytes = 0;
  /// The training memory and rows a second predicted for the choice (from two small micro-batches;
  /// for a budget, its own measurement).
  std::size_t predicted_bytes = 0;
  /// See predicted_bytes.
  double predicted_rows_per_s = 0;
  /// The training memory and rows a second of one optimizer step's micro-batches under the choice.
  std::size_t measured_bytes = 0;
  /// See measured_bytes.
  double measured_rows_per_s = 0;
  /// Every setting weighed, in the order it was.
  std::vector<FitCandidate> candidates;

  /// Installs the chosen checkpointing on `model` (another instance of the measured model).
  template <class Model>
  void apply(Model& model) const {
    apply_checkpointing(model, checkpointing);
  }

  /// The candidates as a Markdown table, then the choice with its prediction and measurement.
  std::string str() const {
    auto mib = [](std::size_t b) { return fmt::format("{:.2f}", static_cast<double>(b) / (1 << 20)); };
    std::string out = fmt::format("fit_in_memory: {} MiB for the whole training memory; model state {} MiB\n",
                                  mib(memory_bytes), mib(state_bytes));
    out += "| setting | micro-batch | predicted MiB | measured MiB | predicted rows/s | measured rows/s | fits |\n"
           "|---|---|---|---|---|---|---|\n";
    for (const FitCandidate& c : candidates) {
      const std::string name =
          c.setting == "budget" ? fmt::format("budget ({} MiB of activations)", mib(c.activation_budget)) : c.setting;
      out += fmt::format("| {} | {} | {} | {} | {} | {:.1f} | {} |\n", name, c.micro_batch,
                         c.predicted_bytes ? mib(c.predicted_bytes) : "-", mib(c.measured_bytes),
                         c.predicted_rows_per_s > 0 ? fmt::format("{:.1f}", c.predicted_rows_per_s) : "-",
                         c.measured_rows_per_s, c.fits ? "yes" : "no");
    }
    out += fmt::format("choice: {}{}, micro-batch {} x {} accumulated; predicted {} MiB, {:.1f} rows/s; measured over "
                       "one optimizer step {} MiB, {:.1f} rows/s\n",
                       setting, activation_budget ? fmt::format(" ({} MiB of activations)", mib(*activation_budget)) : "",
                       micro_batch, accumulation, mib(predicted_bytes), predicted_rows_per_s, mib(measured_bytes),
                       measured_rows_per_s);
    return out;
  }
};

namespace detail {

/// What one setting cost at one micro-batch: the bytes allocated on top of what was live before,
/// the activations' share of them, and time. Measured as the micro-batch runs in training: with
/// accumulation the gradients exist before it (allocated by the warm-up; accumulating into them
/// takes temporaries), without it they are made by its backward (cleared before each run, as
/// zero_grad() leaves them after an optimizer step) and belong to the bytes on top.
struct FitSample {
  std::size_t extra_bytes = 0;
  std::size_t activation_bytes = 0;
  double seconds = 0;
  std::size_t least_feasible = 0;  // a budget that did not fit: the least that works
};

/// Runs `micro_batches` micro-batches of `rows` rows under `setting` (after one warm-up; two under
/// a budget, whose second step searches again before its plan settles), forward and backward: the
/// most any allocated on top, and the median time of one.
template <class Model, class LossOf>
FitSample fit_measure(Model& model, LossOf& loss_of, const std::string& setting, std::optional<std::size_t> budget,
                      std::int64_t rows, int micro_batches, bool accumulated) {
  apply_checkpointing(model, budget ? Checkpointing::none() : policy::parse(setting));
  std::optional<MemoryBudget> guard;  // one across the micro-batches: its plan is replayed after the first
  if (budget) guard.emplace(*budget);
  FitSample out;
  std::vector<double> times;
  const int warm_ups = budget ? 2 : 1;
  for (int i = 0; i < warm_ups + micro_batches; ++i) {
    if (!accumulated)
      for (Tensor* p : model.parameters()) p->zero_grad();
    MemoryScope scope;
    const auto start = std::chrono::steady_clock::now();
    try {
      const Tensor loss = loss_of(rows);
      REMAT_CHECK(loss.numel() == 1, "fit_in_memory: loss_of({}) returned a tensor of shape {}; a scalar loss was "
                  "expected", rows, loss.shape());
      loss.backward();
    } catch (const Error& e) {
      if (guard && guard->least_feasible_bytes() > 0) {
        out.least_feasible = guard->least_feasible_bytes();
        return out;
      }
      throw Error(fmt::format("fit_in_memory: a micro-batch of {} rows under {} failed: {}", rows, setting, e.what()));
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i < warm_ups) continue;  // allocates the gradients, measures chain costs, settles a budget's plan
    times.push_back(seconds);
    out.extra_bytes = std::max(out.extra_bytes, scope.peak_bytes() - scope.start_bytes());
    out.activation_bytes = std::max(out.activation_bytes,
                                    scope.peak_saved_activation_bytes() - scope.start_saved_activation_bytes());
  }
  std::sort(times.begin(), times.end());
  out.seconds = times[times.size() / 2];
  return out;
}

}  // namespace detail

/// The checkpointing and micro-batch that train `model` fastest within `options.memory_bytes` of
/// training memory (see the top of this header), installed on the model; `loss_of(rows)` returns a
/// micro-batch's scalar loss. A cap below the model state, or below what even one row needs under
/// every setting, is a remat::Error naming what would work.
template <class Model, class LossOf>
FitChoice fit_in_memory(Model& model, LossOf loss_of, const FitOptions& options) {
  REMAT_CHECK(options.global_batch > 0, "fit_in_memory: the global batch must be positive, got {}", options.global_batch);
  REMAT_CHECK(options.repeats > 0, "fit_in_memory: repeats must be positive, got {}", options.repeats);
  REMAT_CHECK(options.optimizer_state_per_parameter >= 0,
              "fit_in_memory: optimizer_state_per_parameter must not be negative, got {}",
              options.optimizer_state_per_parameter);
  REMAT_CHECK(!options.policies.empty(), "fit_in_memory: no policy to weigh (FitOptions::policies is empty)");
  for (const std::string& p : options.policies) (void)policy::parse(p);  // a bad word fails here, not midway
  std::size_t parameter_bytes = 0;
  for (const Tensor* p : model.parameters()) parameter_bytes += p->nbytes();
  const auto optimizer_bytes =
      static_cast<std::size_t>(options.optimizer_state_per_parameter * static_cast<double>(parameter_bytes));
  FitChoice choice;
  choice.memory_bytes = options.memory_bytes;
  choice.state_bytes = 2 * parameter_bytes + optimizer_bytes;
  auto mib = [](double b) { return fmt::format("{:.2f} MiB", b / (1 << 20)); };
  REMAT_CHECK(options.memory_bytes > choice.state_bytes,
              "fit_in_memory: the cap of {} is below the model state alone: {} of parameters, {} of gradients and {} "
              "of optimizer state make {}; a cap above that, with room for a micro-batch, would work",
              mib(static_cast<double>(options.memory_bytes)), mib(static_cast<double>(parameter_bytes)),
              mib(static_cast<double>(parameter_bytes)), mib(static_cast<double>(optimizer_bytes)),
              mib(static_cast<double>(choice.state_bytes)));

  const Generator::State rng = default_generator().state();
  struct Restore {
    Model& model;
    Generator::State rng;
    ~Restore() {
      default_generator().set_state(rng);
      for (Tensor* p : model.parameters()) p->zero_grad();
    }
  } restore{model, rng};
  for (Tensor* p : model.parameters()) p->zero_grad();

  std::vector<std::int64_t> sizes;  // micro-batches: the divisors of the global batch
  for (std::int64_t b = 1; b <= options.global_batch; ++b)
    if (options.global_batch % b == 0) sizes.push_back(b);
  const auto rows_per_s = [](std::int64_t rows, double seconds) { return static_cast<double>(rows) / seconds; };

  // A line through two measurements: y(b) = at + per_row * (b - b0).
  struct Line {
    double at = 0, per_row = 0;
    std::int64_t b0 = 1;
    double operator()(std::int64_t b) const { return at + per_row * static_cast<double>(b - b0); }
  };
  const std::int64_t b1 = sizes[0], b2 = sizes.size() > 1 ? sizes[1] : sizes[0];
  // A micro-batch of the whole batch runs once a step, its gradients made by its backward; a smaller
  // one runs with them there.
  const auto measure = [&](const std::string& setting, std::optional<std::size_t> budget, std::int64_t b, int runs) {
    return detail::fit_measure(model, loss_of, setting, budget, b, runs, b < options.global_batch);
  };
  const auto total = [&](const detail::FitSample& m, std::int64_t b) {
    return (b < options.global_batch ? choice.state_bytes : choice.state_bytes - parameter_bytes) + m.extra_bytes;
  };
  std::optional<Line> others;     // none's training memory but its saved activations (the budget's room)
  std::size_t least_one_row = 0;  // the least training memory any setting needed at the smallest micro-batch
  std::string least_setting;
  std::int64_t best_hand_rows = 0;

  for (const std::string& setting : options.policies) {
    const detail::FitSample s1 = measure(setting, std::nullopt, b1, options.repeats);
    const detail::FitSample s2 = b2 == b1 ? s1 : measure(setting, std::nullopt, b2, options.repeats);
    const double span = static_cast<double>(std::max<std::int64_t>(b2 - b1, 1));
    const auto t1 = static_cast<double>(total(s1, b1)), t2 = static_cast<double>(total(s2, b2));
    const Line bytes{t1, (t2 - t1) / span, b1};  // the training memory
    const Line seconds{s1.seconds, std::max(0.0, (s2.seconds - s1.seconds) / span), b1};
    if (setting == "none")
      others = Line{t1 - static_cast<double>(s1.activation_bytes),
                    (t2 - static_cast<double>(s2.activation_bytes) - (t1 - static_cast<double>(s1.activation_bytes))) / span,
                    b1};
    if (least_setting.empty() || total(s1, b1) < least_one_row) {
      least_one_row = total(s1, b1);
      least_setting = setting;
    }
    // The largest micro-batch predicted to fit, measured; a smaller one while the measurement does not.
    std::size_t k = sizes.size();
    while (k > 0 && bytes(sizes[k - 1]) > static_cast<double>(options.memory_bytes)) --k;
    if (k == 0) {  // not even the smallest micro-batch: shown, not chosen
      FitCandidate c{setting, b1};
      c.predicted_bytes = c.measured_bytes = total(s1, b1);
      c.predicted_rows_per_s = c.measured_rows_per_s = rows_per_s(b1, s1.seconds);
      choice.candidates.push_back(c);
    }
    const std::size_t first_tried = k;
    for (; k > 0; --k) {
      const std::int64_t b = sizes[k - 1];
      FitCandidate c{setting, b};
      c.predicted_bytes = static_cast<std::size_t>(std::max(0.0, bytes(b)));
      c.predicted_rows_per_s = rows_per_s(b, seconds(b));
      const detail::FitSample m = b == b1 ? s1 : b == b2 ? s2 : measure(setting, std::nullopt, b, options.repeats);
      c.measured_bytes = total(m, b);
      c.measured_rows_per_s = rows_per_s(b, m.seconds);
      c.fits = c.measured_bytes <= options.memory_bytes;
      choice.candidates.push_back(c);
      if (c.fits) {
        best_hand_rows = std::max(best_hand_rows, b);
        break;
      }
      if (k + 2 <= first_tried) break;  // three sizes measured above the prediction: the line is off
    }
  }

  // A budget over the activations, at the micro-batches beyond those the policies reach (and at
  // the largest they reach): the room the cap leaves beside what none needs but activations.
  if (options.try_budget && others) {
    int tries = 0;
    for (std::size_t k = sizes.size(); k > 0 && sizes[k - 1] >= best_hand_rows && tries < 4; --k) {
      const std::int64_t b = sizes[k - 1];
      const double other = std::max(0.0, (*others)(b));
      if (other >= static_cast<double>(options.memory_bytes)) continue;
      auto activations = static_cast<std::size_t>(static_cast<double>(options.memory_bytes) - other);
      ++tries;
      detail::FitSample m = measure("budget", activations, b, options.repeats);
      // A budgeted step's other bytes are not none's: tighter, while it is over the cap (twice more).
      for (int again = 0; again < 2 && m.least_feasible == 0 && total(m, b) > options.memory_bytes &&
                          total(m, b) - options.memory_bytes < activations; ++again) {
        activations -= total(m, b) - options.memory_bytes;
        m = measure("budget", activations, b, options.repeats);
      }
      if (m.least_feasible > 0) continue;  // infeasible at this micro-batch
      FitCandidate c{"budget", b, activations};
      c.measured_bytes = total(m, b);
      c.measured_rows_per_s = rows_per_s(b, m.seconds);
      c.fits = c.measured_bytes <= options.memory_bytes;
      choice.candidates.push_back(c);
      if (c.fits) break;
    }
  }

  const FitCandidate* best = nullptr;
  for (const FitCandidate& c : choice.candidates)
    if (c.fits && (!best || c.measured_rows_per_s > best->measured_rows_per_s ||
                   (c.measured_rows_per_s == best->measured_rows_per_s && c.measured_bytes < best->measured_bytes)))
      best = &c;
  REMAT_CHECK(best != nullptr,
              "fit_in_memory: nothing fits in {}: the model state takes {} and the least a micro-batch of {} row(s) "
              "took in all is {} (under {}); a cap of at least that would work",
              mib(static_cast<double>(options.memory_bytes)), mib(static_cast<double>(choice.state_bytes)), b1,
              mib(static_cast<double>(least_one_row)), least_setting);
  choice.setting = best->setting;
  choice.micro_batch = best->micro_batch;
  choice.accumulation = options.global_batch / best->micro_batch;
  if (best->setting == "budget") choice.activation_budget = best->activation_budget;
  choice.predicted_bytes = best->predicted_bytes ? best->predicted_bytes : best->measured_bytes;
  choice.predicted_rows_per_s = best->predicted_rows_per_s > 0 ? best->predicted_rows_per_s : best->measured_rows_per_s;

  // One optimizer step's micro-batches under the choice.
  const detail::FitSample step =
      measure(choice.setting, choice.activation_budget, choice.micro_batch, static_cast<int>(choice.accumulation));
  choice.measured_bytes = total(step, choice.micro_batch);
  choice.measured_rows_per_s = rows_per_s(choice.micro_batch, step.seconds);
  choice.checkpointing = choice.activation_budget ? Checkpointing::none() : policy::parse(choice.setting);
  apply_checkpointing(model, choice.checkpointing);
  return choice;
}

}  // namespace remat
