// A Wasserstein GAN with gradient penalty (WGAN-GP, Gulrajani et al. 2017) learns a ring of eight
// Gaussians: the critic's loss holds λ·(‖∇ₓ D(x̂)‖ − 1)², a gradient, so training it differentiates
// twice — grad(..., create_graph) — and the critic's hidden blocks run in checkpoint scopes, so the
// second differentiation goes through their replays.
//
//   gradient_penalty [--steps N] [--seed S] [--lr LR] [--plain]
//
// --plain runs the critic without checkpointing. The run prints the critic's Wasserstein estimate,
// the penalty, and how far the generator's samples lie from the ring and from the nearest mode; it
// exits 1 unless the distance to the ring (averaged over the reports of the last 200 steps) falls to
// under half of where it started and the penalty holds the critic's gradient norm near 1.
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include <remat/remat.hpp>

namespace {

using namespace remat;

constexpr std::int64_t kBatch = 256, kWidth = 64, kModes = 8;
constexpr double kRadius = 2.0, kModeStd = 0.05, kLambda = 10.0;

/// Real samples: a mode picked uniformly, then Gaussian noise around it.
Tensor real_batch(Generator& gen) {
  const std::vector<float> pick = rand({kBatch}, gen).to_vector(), noise = randn({kBatch, 2}, gen).to_vector();
  std::vector<float> xy(2 * kBatch);
  for (std::int64_t i = 0; i < kBatch; ++i) {
    const double angle = 2 * M_PI * std::floor(pick[i] * kModes) / kModes;
    xy[2 * i] = static_cast<float>(kRadius * std::cos(angle) + kModeStd * noise[2 * i]);
    xy[2 * i + 1] = static_cast<float>(kRadius * std::sin(angle) + kModeStd * noise[2 * i + 1]);
  }
  return tensor(xy, {kBatch, 2});
}

/// Mean distance from each sample to the ring the modes lie on.
double distance_to_ring(const Tensor& samples) {
  const std::vector<float> xy = samples.to_vector();
  double total = 0;
  for (std::int64_t i = 0; i < samples.size(0); ++i) total += std::abs(std::hypot(xy[2 * i], xy[2 * i + 1]) - kRadius);
  return total / static_cast<double>(samples.size(0));
}

/// Mean distance from each sample to its nearest mode.
double distance_to_modes(const Tensor& samples) {
  const std::vector<float> xy = samples.to_vector();
  double total = 0;
  for (std::int64_t i = 0; i < samples.size(0); ++i) {
    double best = 1e30;
    for (int m = 0; m < kModes; ++m) {
      const double angle = 2 * M_PI * m / kModes;
      best = std::min(best, std::hypot(xy[2 * i] - kRadius * std::cos(angle), xy[2 * i + 1] - kRadius * std::sin(angle)));
    }
    total += best;
  }
  return total / static_cast<double>(samples.size(0));
}

struct Generator2d : nn::Module {
  nn::Linear in, hidden, out;
  explicit Generator2d(Generator& gen) : in(2, kWidth, true, gen), hidden(kWidth, kWidth, true, gen), out(kWidth, 2, true, gen) {
    register_module("in", in);
    register_module("hidden", hidden);
    register_module("out", out);
  }
  Tensor forward(const Tensor& z) { return out(tanh(hidden(tanh(in(z))))); }
};

struct Critic : nn::Module {
  nn::Linear in, block0, block1, out;
  bool checkpointed = true;
  explicit Critic(Generator& gen)
      : in(2, kWidth, true, gen), block0(kWidth, kWidth, true, gen), block1(kWidth, kWidth, true, gen),
        out(kWidth, 1, true, gen) {
    register_module("in", in);
    register_module("block0", block0);
    register_module("block1", block1);
    register_module("out", out);
  }
  Tensor forward(const Tensor& x) {
    Tensor h = tanh(in(x));
    for (nn::Linear* block : {&block0, &block1}) {
      // A residual block in a checkpoint scope: its activations are recomputed in backward, and
      // under create_graph the recomputation is recorded for the second differentiation. (The
      // callable is a temporary, which checkpoint() keeps: it replays after this loop has moved on.)
      const auto body = [block] { return [block](const Tensor& t) { return t + tanh((*block)(t)); }; };
      h = checkpointed ? checkpoint(body(), h) : body()(h);
    }
    return out(h);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int steps = 600;
  std::uint64_t seed = 0;
  bool plain = false;
  double lr = 1e-3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--lr" && i + 1 < argc) lr = std::atof(argv[++i]);
    else if (a == "--plain") plain = true;
    else {
      fmt::print(stderr, "usage: gradient_penalty [--steps N] [--seed S] [--lr LR] [--plain]\n");
      return 2;
    }
  }
  Generator gen(seed);
  Generator2d g(gen);
  Critic d(gen);
  d.checkpointed = !plain;
  optim::AdamWOptions options;  // the WGAN-GP paper's Adam: lr 1e-4 there, larger for this toy
  options.lr = lr;
  options.beta1 = 0.5;
  options.beta2 = 0.9;
  options.weight_decay = 0;
  optim::AdamW g_opt(g.parameters(), options), d_opt(d.parameters(), options);

  const auto fake_batch = [&] { return g.forward(randn({kBatch, 2}, gen)); };
  double first_distance = 0, last_distance = 0, last_norm = 0, last_modes = 0;
  std::vector<double> late;  // the distances of the last three reports: GAN training oscillates
  for (int step = 0; step <= steps; ++step) {
    // Five critic steps: D(fake) − D(real) + λ (‖∇ₓ D(x̂)‖ − 1)² at points between real and fake.
    double wasserstein = 0, penalty_value = 0;
    for (int k = 0; k < 5; ++k) {
      const Tensor real = real_batch(gen);
      Tensor fake;
      {
        no_grad off;  // the generator is fixed during the critic's steps
        fake = fake_batch();
      }
      const Tensor mix = rand({kBatch, 1}, gen);
      Tensor between = (real * mix + fake * (1.0f - mix)).detach().requires_grad_();
      GradOptions recorded;
      recorded.create_graph = true;  // the penalty is a function of this gradient: record it
      const Tensor slope = grad(std::vector<Tensor>{sum(d.forward(between))}, {between}, {}, recorded)[0];
      const Tensor norm = sqrt(sum(slope * slope, 1) + 1e-12f);
      const Tensor penalty = mean(pow(norm - 1.0f, 2));
      const Tensor critic_gap = mean(d.forward(fake)) - mean(d.forward(real));
      Tensor loss = critic_gap + penalty * static_cast<float>(kLambda);
      d_opt.zero_grad();
      loss.backward();
      d_opt.step();
      wasserstein = -critic_gap.item();
      penalty_value = penalty.item();
      last_norm = mean(norm).item();
    }
    // One generator step: raise the critic's score of fresh fakes.
    g_opt.zero_grad();
    Tensor g_loss = -mean(d.forward(fake_batch()));
    g_loss.backward();
    g_opt.step();
    d_opt.zero_grad();  // the generator's backward reached the critic's weights too

    if (step % 100 == 0 || step == steps) {
      Tensor sample;
      {
        no_grad off;
        sample = g.forward(randn({8 * kBatch, 2}, gen));
      }
      last_distance = distance_to_ring(sample);
      last_modes = distance_to_modes(sample);
      if (step == 0) first_distance = last_distance;
      if (step >= steps - 200) late.push_back(last_distance);
      fmt::print("step {:4d}  wasserstein {:7.4f}  penalty {:.4f}  |grad| {:.3f}  distance to the ring {:.3f}, to the "
                 "nearest mode {:.3f}\n", step, wasserstein, penalty_value, last_norm, last_distance, last_modes);
    }
  }
  double late_mean = 0;
  for (double v : late) late_mean += v / static_cast<double>(late.size());
  const bool learnt = late_mean < first_distance / 2 && std::abs(last_norm - 1.0) < 0.5;
  fmt::print("distance to the ring fell from {:.3f} to {:.3f} (mean of the last reports); critic gradient norm {:.3f}{}\n",
             first_distance, late_mean, last_norm, learnt ? "" : "  (did not learn)");
  return learnt ? 0 : 1;
}
