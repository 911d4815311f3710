// The data-parallel GPT training step, and an α–β model of it at scale.
//
//   alone:          bench_dist_step --threads 2 --batch 16 ...
//   data parallel:  mpirun -np 2 bench_dist_step --threads 1 --batch 16 ...   (the same global batch)
//   --mode blocks|none|... --bucket-mb 25 --first-bucket-mb 1 --steps 6 --warmup 2 --model 0|1
//   ZeRO stages:    mpirun -np 2 bench_dist_step --zero all   (DDP, ZeRO-1 and ZeRO-3 alternating, step times)
//                   mpirun -np 2 bench_dist_step --zero 3     (one of 0, 1, 3 alone: its memory per rank)
//                   --in-flight K: ZeRO-3 parameters whose gradient reduction may be in flight at once
//                   --prefetch within|eager: ZeRO-3 starts a prefetch when it fits within two blocks
//                                             (the default), or as soon as the order names the block
//
// Under mpirun, steps alternate between reductions overlapping backward and all reductions after
// backward; the exposed wait of each (DataParallel::last_exposed_seconds) gives the fraction of
// the reduction time that overlap hides. Rank 0 prints one JSON line; with --model 1 it also
// measures α and β of the deterministic all-reduce here and prints the model's predictions of the
// step time and the hidden fraction at 8, 64 and 512 ranks, for this GPT and a 1.3B-parameter shape.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <remat/remat.hpp>
#include <remat/dist/data_parallel.hpp>
#include <remat/dist/fully_sharded.hpp>
#include <remat/dist/fully_sharded_adamw.hpp>
#include <remat/dist/sharded_adamw.hpp>

#include "flags.hpp"

namespace {

using namespace remat;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// What one model step costs, as the model needs it.
struct StepShape {
  std::string name;
  double params;           ///< parameters (fp32 gradients: 4 bytes each)
  double forward_s, backward_s, optimizer_s;  ///< per rank, at a fixed micro-batch per rank
  std::vector<double> bucket_bytes;           ///< in the order they become ready
  double units = 0, unit_bytes = 0;           ///< ZeRO-3: its blocks, and one block's parameter bytes
  double unit_params = 12;                    ///< ZeRO-3: parameters per block (a collective each)
  /// ZeRO-3 within two blocks: the share of a block's backward left once the block has freed enough
  /// for the next one's gather to start (a GPT block: its attention's, after the MLP's).
  double window = 1;
};

/// The share of a GPT block's backward that follows its MLP's, from the FLOPs per token: the MLP's
/// 8d² against the attention's 4d² of projections and 2Td of scores and weighted values.
double attention_share(double d, double t) { return (4 * d * d + 2 * t * d) / (12 * d * d + 2 * t * d); }

/// Bucket k is ready once backward has produced its share of the gradient bytes (compute per
/// byte taken as uniform); buckets are reduced one after another, each as soon as it is ready and
/// the previous one is done. Per bucket of S bytes over N ranks, as remat::dist does it: a
/// pairwise all-to-all ((N-1) α + (N-1)/N S β) then an all-gather (⌈log2 N⌉ α + (N-1)/N S β).
struct Prediction {
  double step_s, comm_s, exposed_s;
};
Prediction predict(const StepShape& s, int ranks, double alpha, double beta) {
  const double n = ranks;
  double total = 0;
  for (double b : s.bucket_bytes) total += b;
  double done = 0, ready_bytes = 0, comm = 0;
  for (double b : s.bucket_bytes) {
    ready_bytes += b;
    const double ready = s.backward_s * ready_bytes / total;
    const double cost = ranks == 1 ? 0.0 : (n - 1) * alpha + std::ceil(std::log2(n)) * alpha + 2 * (n - 1) / n * b * beta;
    done = std::max(done, ready) + cost;
    comm += cost;
  }
  const double exposed = std::max(0.0, done - s.backward_s);
  return {s.forward_s + s.backward_s + exposed + s.optimizer_s, comm, exposed};
}

/// ZeRO-3 (remat::dist::FullyShardedDataParallel with prefetch): per block, an all-gather before
/// its forward and one before its backward, one per parameter (⌈log2 N⌉ α each, and (N-1)/N S β
/// in all), and a reduce-scatter per parameter as its gradient is final ((N-1) α each, (N-1)/N S β
/// in all). The next block's gather runs during this block's compute — in backward, within two
/// blocks, only during the last `window` of it — so a block costs the longest of its compute and
/// its communication, and the first gather and the last reduction are exposed. The optimizer
/// updates 1/N of the parameters. `within` false: the gather may use the whole backward (eager).
Prediction predict_zero3(const StepShape& s, int ranks, double alpha, double beta, bool within = true) {
  const double n = ranks, units = s.units, k = s.unit_params;
  const double gather = ranks == 1 ? 0.0 : k * std::ceil(std::log2(n)) * alpha + (n - 1) / n * s.unit_bytes * beta;
  const double reduce = ranks == 1 ? 0.0 : k * (n - 1) * alpha + (n - 1) / n * s.unit_bytes * beta;
  const double f = s.forward_s / units, b = s.backward_s / units, late = within ? (1 - s.window) * b : 0.0;
  const double forward = gather + units * std::max(f, gather);
  const double backward = gather + units * std::max({b, gather + reduce, late + gather}) + reduce;
  const double comm = units * (2 * gather + reduce);
  const double exposed = forward + backward - s.forward_s - s.backward_s;
  return {forward + backward + s.optimizer_s / n, comm, exposed};
}

std::vector<double> buckets_of(double total_bytes, double first, double cap) {
  std::vector<double> out;
  double left = total_bytes;
  for (double c = first; left > 0; c = cap) {
    out.push_back(std::min(c, left));
    left -= out.back();
  }
  return out;
}

/// One way of training the same GPT on every rank: DDP (ZeRO-0), ZeRO-1 or ZeRO-3.
struct ZeroRun {
  ZeroRun(int stage, dist::Context& world, const nn::GPTConfig& cfg, const std::string& mode,
          std::size_t reductions_in_flight, bool prefetch_within_two_units)
      : stage(stage) {
    Generator gen(0);
    model = std::make_unique<nn::GPT>(cfg, gen);
    apply_checkpointing(*model, policy::parse(mode));
    const optim::AdamWOptions adamw{1e-4};
    if (stage == 3) {
      dist::FullyShardedOptions options;
      options.reductions_in_flight = reductions_in_flight;
      options.prefetch_within_two_units = prefetch_within_two_units;
      fsdp.emplace(world, *model, options);
      opt = std::make_unique<dist::FullyShardedAdamW>(*fsdp, model->parameters(), adamw);
    } else {
      dist::DataParallelOptions options;
      options.shard_gradients = stage == 1;
      ddp.emplace(world, *model, options);
      if (stage == 1) opt = std::make_unique<dist::ShardedAdamW>(*ddp, model->parameters(), adamw);
      else opt = std::make_unique<optim::AdamW>(model->parameters(), adamw);
    }
  }
  ~ZeroRun() {
    opt.reset();
    fsdp.reset();
    ddp.reset();
  }
  ZeroRun(const ZeroRun&) = delete;
  ZeroRun& operator=(const ZeroRun&) = delete;

  double step(const LongTensor& idx, const LongTensor& targets) {
    if (fsdp) fsdp->reset_peak_memory();
    const auto t0 = Clock::now();
    model->loss(idx, targets).backward();
    opt->step();
    opt->zero_grad();
    const double t = seconds_since(t0);
    if (fsdp) model_state_peak = std::max(model_state_peak, fsdp->peak_model_state().model_state());
    return t;
  }
  std::size_t model_state_peak = 0;  ///< ZeRO-3, over the steps measured (compare_zero resets it after warm-up)

  int stage;
  std::unique_ptr<nn::GPT> model;
  std::optional<dist::DataParallel> ddp;
  std::optional<dist::FullyShardedDataParallel> fsdp;
  std::unique_ptr<optim::Optimizer> opt;
};

/// --zero all: the three stages in one run, steps alternating; --zero S: stage S alone, with its
/// bytes per rank from the books (between steps, and the peak of a step).
int compare_zero(dist::Context& world, bench::Flags& a, const nn::GPTConfig& cfg, const LongTensor& idx,
                 const LongTensor& targets) {
  const int warmup = std::stoi(a["warmup"]), steps = std::stoi(a["steps"]);
  const std::vector<int> stages = a["zero"] == "all" ? std::vector<int>{0, 1, 3} : std::vector<int>{std::stoi(a["zero"])};
  const std::size_t baseline = memory_stats().live_bytes;
  std::vector<std::unique_ptr<ZeroRun>> runs;
  const auto in_flight = static_cast<std::size_t>(std::stoul(a["in-flight"]));
  REMAT_CHECK(a["prefetch"] == "within" || a["prefetch"] == "eager", "dist_step: --prefetch is within or eager, got '{}'",
              a["prefetch"]);
  for (int stage : stages)
    runs.push_back(std::make_unique<ZeroRun>(stage, world, cfg, a["mode"], in_flight, a["prefetch"] == "within"));
  std::vector<std::vector<double>> times(runs.size());
  std::size_t between = 0, peak = 0;
  for (int s = 0; s < warmup + steps; ++s)
    for (std::size_t r = 0; r < runs.size(); ++r) {
      world.barrier();
      MemoryScope scope;
      if (s == warmup) runs[r]->model_state_peak = 0;  // warm-up steps apart (the first has no moments yet)
      const double t = runs[r]->step(idx, targets);
      if (s < warmup) continue;
      times[r].push_back(t);
      between = memory_stats().live_bytes - baseline;
      peak = std::max(peak, scope.peak_bytes() - baseline);
    }
  if (world.rank() == 0) {
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const std::vector<double>& v = times[r];
      fmt::print("{{\"ranks\": {}, \"zero\": {}, \"mode\": \"{}\", \"step_ms\": {:.2f}, \"step_ms_min\": {:.2f}, "
                 "\"step_ms_max\": {:.2f}", world.world_size(), runs[r]->stage, a["mode"], 1e3 * median(v),
                 1e3 * *std::min_element(v.begin(), v.end()), 1e3 * *std::max_element(v.begin(), v.end()));
      if (runs.size() == 1) {
        const double psi = static_cast<double>(runs[r]->model->num_parameters());
        fmt::print(", \"parameters\": {:.0f}, \"bytes_between_steps\": {}, \"peak_bytes\": {}", psi, between, peak);
        if (runs[r]->fsdp) {
          std::int64_t root = 0, largest = 0;
          for (const dist::ShardedUnit& u : runs[r]->fsdp->units()) {
            if (u.root) root = u.numel;
            else largest = std::max(largest, u.numel);
          }
          const double formula = 16 * psi / world.world_size() + 2.0 * sizeof(float) * static_cast<double>(largest);
          fmt::print(", \"root_parameters\": {}, \"largest_unit_parameters\": {}, \"sixteen_psi_over_n\": {:.0f}, "
                     "\"gathers_per_step\": {:.2f}, \"model_state_peak_bytes\": {}, \"sixteen_psi_over_n_plus_two_units\": "
                     "{:.0f}, \"model_state_over_that\": {:.4f}", root, largest, 16 * psi / world.world_size(),
                     static_cast<double>(runs[r]->fsdp->gathers()) / (warmup + steps), runs[r]->model_state_peak,
                     formula, static_cast<double>(runs[r]->model_state_peak) / formula);
        }
      }
      fmt::print("}}\n");
    }
  }
  while (!runs.empty()) runs.pop_back();  // wrappers end in the reverse order of their construction
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<dist::Context> world;
  const bool mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
  if (mpi) world.emplace(&argc, &argv);
  try {
    bench::Flags a = bench::parse_flags(argc, argv,
                                        {{"layers", "8"}, {"width", "256"}, {"heads", "4"}, {"context", "128"},
                                         {"batch", "16"}, {"vocab", "256"}, {"mode", "blocks"}, {"steps", "6"},
                                         {"warmup", "2"}, {"threads", "1"}, {"model", "0"},
                                         {"bucket-mb", "25"}, {"first-bucket-mb", "1"}, {"zero", ""}, {"in-flight", "1"},
                                          {"prefetch", "within"}},
                                        "dist_step");
    set_num_threads(std::stoi(a["threads"]));
    const int rank = world ? world->rank() : 0, ranks = world ? world->world_size() : 1;
    const nn::GPTConfig cfg = bench::gpt_config(a, 0.1);
    const std::int64_t global_batch = std::stoll(a["batch"]);
    REMAT_CHECK(global_batch % ranks == 0, "dist_step: batch {} does not split across {} ranks", global_batch, ranks);
    const std::int64_t B = global_batch / ranks;
    Generator gen(0);
    nn::GPT model(cfg, gen);
    apply_checkpointing(model, policy::parse(a["mode"]));
    optim::AdamW adamw(model.parameters(), {1e-4});
    const LongTensor idx = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
    const LongTensor targets = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
    if (!a["zero"].empty()) {
      REMAT_CHECK(world.has_value(), "dist_step: --zero compares data-parallel stages: run under mpirun");
      return compare_zero(*world, a, cfg, idx, targets);
    }
    std::optional<dist::DataParallel> ddp;
    dist::DataParallelOptions options;
    options.bucket_bytes = static_cast<std::size_t>(std::stod(a["bucket-mb"]) * (1 << 20));
    options.first_bucket_bytes = static_cast<std::size_t>(std::stod(a["first-bucket-mb"]) * (1 << 20));
    if (world) ddp.emplace(*world, model, options);

    // Steps alternate overlap on / off (alone: every step is the same).
    std::vector<double> step_s[2], fwd_s[2], bwd_s[2], opt_s[2], exposed_s[2];
    const int warmup = std::stoi(a["warmup"]), steps = std::stoi(a["steps"]);
    for (int s = 0; s < warmup + 2 * steps; ++s) {
      const int overlap = s % 2 == 0 ? 1 : 0;
      if (ddp) ddp->set_overlap(overlap != 0);
      if (world) world->barrier();
      const auto t0 = Clock::now();
      Tensor loss = model.loss(idx, targets);
      const double f = seconds_since(t0);
      const auto t1 = Clock::now();
      loss.backward();
      const double b = seconds_since(t1);
      const auto t2 = Clock::now();
      adamw.step();
      adamw.zero_grad();
      const double o = seconds_since(t2);
      if (s < warmup) continue;
      step_s[overlap].push_back(seconds_since(t0));
      fwd_s[overlap].push_back(f);
      bwd_s[overlap].push_back(b);
      opt_s[overlap].push_back(o);
      exposed_s[overlap].push_back(ddp ? ddp->last_exposed_seconds() : 0.0);
    }
    const double tokens = static_cast<double>(global_batch * cfg.block_size);
    if (rank == 0) {
      if (ddp) {
        const double hidden = 1 - median(exposed_s[1]) / median(exposed_s[0]);
        fmt::print("{{\"ranks\": {}, \"threads_per_rank\": {}, \"mode\": \"{}\", \"global_batch\": {}, "
                   "\"step_ms_overlap\": {:.2f}, \"step_ms_after\": {:.2f}, \"tokens_per_s_overlap\": {:.0f}, "
                   "\"tokens_per_s_after\": {:.0f}, \"reduce_ms_after_backward\": {:.3f}, \"exposed_ms_overlap\": {:.3f}, "
                   "\"hidden_fraction\": {:.3f}, \"buckets\": {}}}\n",
                   ranks, get_num_threads(), a["mode"], global_batch, 1e3 * median(step_s[1]), 1e3 * median(step_s[0]),
                   tokens / median(step_s[1]), tokens / median(step_s[0]), 1e3 * median(exposed_s[0]),
                   1e3 * median(exposed_s[1]), hidden, ddp->buckets().size());
      } else {
        std::vector<double> all = step_s[0];
        all.insert(all.end(), step_s[1].begin(), step_s[1].end());
        fmt::print("{{\"ranks\": 1, \"threads_per_rank\": {}, \"mode\": \"{}\", \"global_batch\": {}, \"step_ms\": {:.2f}, "
                   "\"tokens_per_s\": {:.0f}}}\n",
                   get_num_threads(), a["mode"], global_batch, 1e3 * median(all), tokens / median(all));
      }
    }

    if (a["model"] != "0" && world && ranks >= 2) {
      // α and β of the deterministic all-reduce here: time small and large messages.
      auto time_all_reduce = [&](std::int64_t n) {
        Tensor t = zeros(Shape{n});
        std::vector<double> v;
        for (int r = 0; r < 7; ++r) {
          world->barrier();
          const auto t0 = Clock::now();
          dist::all_reduce(*world, t);
          v.push_back(seconds_since(t0));
        }
        return median(v);
      };
      const double n = ranks, small = time_all_reduce(2), large = time_all_reduce(std::int64_t{1} << 24);
      const double alpha = small / ((n - 1) + std::ceil(std::log2(n)));
      const double beta = std::max(0.0, large - small) / (2 * (n - 1) / n * 4.0 * (1 << 24));
      if (rank == 0) {
        // The measured step at this micro-batch, and a 1.3B-parameter GPT (24 layers, width 2048,
        // vocabulary 50257, context 2048) whose compute is scaled from this one by FLOPs (6 per
        // parameter per token), at the throughput measured here.
        std::vector<double> small_buckets;
        for (const dist::Bucket& bk : ddp->buckets()) small_buckets.push_back(4.0 * static_cast<double>(bk.numel));
        const double p_small = static_cast<double>(model.num_parameters());
        const auto d = static_cast<double>(cfg.n_embd);
        const StepShape measured{"this GPT (" + std::to_string(model.num_parameters()) + " parameters, " +
                                     std::to_string(B) + " x " + std::to_string(cfg.block_size) + " tokens per rank)",
                                 p_small, median(fwd_s[1]), median(bwd_s[1]) - median(exposed_s[1]), median(opt_s[1]),
                                 small_buckets, static_cast<double>(cfg.n_layer), 4.0 * (12.0 * d * d + 13.0 * d), 12,
                                 attention_share(d, static_cast<double>(cfg.block_size))};
        const double p_big = 24 * 12.0 * 2048 * 2048 + 50257.0 * 2048 + 2048.0 * 2048;
        const double tokens_big = 8.0 * 2048;  // 8 sequences of 2048 per rank
        const double scale = (p_big * tokens_big) / (p_small * static_cast<double>(B * cfg.block_size));
        const StepShape big{"GPT 1.3B (8 x 2048 tokens per rank, compute scaled by FLOPs)", p_big,
                            measured.forward_s * scale, measured.backward_s * scale, measured.optimizer_s * p_big / p_small,
                            buckets_of(4 * p_big, 1 << 20, 25 << 20), 24, 4 * 12.0 * 2048 * 2048, 12,
                            attention_share(2048, 2048)};
        // The same 1.3B step on an accelerator: compute at an assumed 100 TFLOP/s per rank, backward
        // two thirds of it, the optimizer at an assumed 1 TB/s over its 16 bytes per parameter.
        const double flops_big = 6 * p_big * tokens_big;
        const StepShape fast{"GPT 1.3B at an assumed 100 TFLOP/s per rank", p_big, flops_big / 3 / 100e12,
                             2 * flops_big / 3 / 100e12, 16 * p_big / 1e12, big.bucket_bytes, big.units, big.unit_bytes,
                             big.unit_params, big.window};
        struct Network {
          const char* name;
          double alpha, beta;
        } networks[] = {{"measured here (shared memory)", alpha, beta},
                        {"assumed cluster: 100 Gb/s, 5 us", 5e-6, 1 / 12.5e9}};
        fmt::print("# α–β model: measured α = {:.2f} µs, β = {:.3f} ns/byte ({:.1f} GB/s) from the all-reduce of 8 B and "
                   "64 MiB on {} ranks\n", alpha * 1e6, beta * 1e9, 1e-9 / beta, ranks);
        fmt::print("| model | network | ranks | step (s) | reduction (s) | exposed (s) | hidden | ZeRO-3 step (s) | "
                   "ZeRO-3 communication (s) | ZeRO-3 exposed (s) | ZeRO-3 eager step (s) |\n"
                   "|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (const StepShape* sh : {&measured, &big, &fast})
          for (const Network& net : networks)
            for (int r : {ranks, 8, 64, 512}) {
              const Prediction p = predict(*sh, r, net.alpha, net.beta);
              const Prediction z = predict_zero3(*sh, r, net.alpha, net.beta);
              const Prediction eager = predict_zero3(*sh, r, net.alpha, net.beta, false);
              fmt::print("| {} | {} | {} | {:.4g} | {:.4g} | {:.4g} | {:.1f}% | {:.4g} | {:.4g} | {:.4g} | {:.4g} |\n",
                         sh->name, net.name, r, p.step_s, p.comm_s, p.exposed_s,
                         p.comm_s > 0 ? 100 * (1 - p.exposed_s / p.comm_s) : 100.0, z.step_s, z.comm_s, z.exposed_s,
                         eager.step_s);
            }
      }
    }
    return 0;
  } catch (const remat::Error& e) {
    if (world) world->abort(e.what());
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }
}
