// A long time loop differentiated end to end: a damped oscillator x' = x Wᵀ integrated with
// explicit Euler for a million steps, the loss the distance of the final state from a target,
// and its gradient with respect to W — the adjoint of the whole trajectory — computed under a
// checkpointing schedule, so memory stays O(snapshots) instead of O(steps).
//
//   ode_adjoint --steps 1000000 --policy binomial:20            offline: the length is known
//   ode_adjoint --steps 1000000 --policy two_tier:4+16 --dir /tmp   snapshots in memory and files
//   ode_adjoint --steps 1000000 --policy online:20              steps arrive until t >= t_end
//   ode_adjoint --check 1                                        also verify on a short horizon
//
// --check runs 2,000 steps three ways — no checkpointing, the chosen schedule, and central finite
// differences on every entry of W — and stops with an error if they disagree.
#include <chrono>
#include <cmath>
#include <map>
#include <string>

#include <sys/resource.h>

#include <remat/remat.hpp>

using namespace remat;

namespace {

struct Args {
  std::int64_t steps = 1'000'000;
  double dt = 1e-5;
  std::string policy = "binomial:20";
  std::string dir = "/tmp";
  double write_cost = 2.0, read_cost = 2.0;
  bool check = false;
};

Tensor euler_step(const Tensor& x, const Tensor& w, float dt) { return x + matmul(x, w) * dt; }

/// The final state after `steps` Euler steps from x0 under `policy` (none: a plain loop).
/// `counts` is filled in by the backward.
Tensor integrate(const Tensor& x0, const Tensor& w, const Args& a, std::int64_t steps,
                 const std::shared_ptr<ChainCounts>& counts, Plan* plan_out) {
  const auto dt = static_cast<float>(a.dt);
  const ChainStep step = [&w, dt](const Tensor& x) { return euler_step(x, w, dt); };
  const std::string kind = a.policy.substr(0, a.policy.find(':'));
  const std::string arg = a.policy.find(':') == std::string::npos ? "" : a.policy.substr(a.policy.find(':') + 1);
  Tensor out;
  if (kind == "none") {
    out = x0;
    for (std::int64_t i = 0; i < steps; ++i) out = step(out);
    return out;
  }
  if (kind == "online") {
    OnlineChain chain(x0, std::stoll(arg), "ode");
    double t = 0;
    const double t_end = static_cast<double>(steps) * a.dt;
    while (t < t_end - 0.5 * a.dt) {  // the integrator does not need to know how many steps remain
      if (chain.steps() == 0) chain.advance(step);
      else chain.advance();  // the same step function again: held once
      t += a.dt;
    }
    out = chain.finish(counts);
  } else {
    Policy p = policy::binomial(1);
    if (kind == "binomial") {
      p = policy::binomial(std::stoll(arg));
    } else if (kind == "two_tier") {
      const auto plus = arg.find('+');
      REMAT_CHECK(plus != std::string::npos, "ode_adjoint: two_tier needs RAM+DISK slots, e.g. two_tier:4+16");
      p = policy::two_tier(std::stoll(arg.substr(0, plus)), std::stoll(arg.substr(plus + 1)), a.dir,
                           {a.write_cost, a.read_cost});
    } else {
      throw Error(fmt::format("ode_adjoint: unknown policy '{}' (none, binomial:S, two_tier:R+D, online:S)", a.policy));
    }
    if (plan_out) *plan_out = plan(p, steps);
    out = checkpoint_sequential(step, steps, x0, p, nullptr, counts);
  }
  return out;
}

double loss_value(const Tensor& x) {
  const Tensor target = tensor({0.25f, -0.5f}, {1, 2});
  return static_cast<double>(sum((x - target) * (x - target)).item());
}

/// dLoss/dW and the loss, with the schedule in `a`.
std::pair<std::vector<float>, double> gradient(const Args& a, std::int64_t steps, ChainCounts* counts, Plan* plan) {
  Tensor w = tensor({0.0f, -1.0f, 1.0f, -0.1f}, {2, 2}).requires_grad_();  // x' = (v, −x − 0.1 v)
  const Tensor x0 = tensor({1.0f, 0.0f}, {1, 2});
  auto shared = std::make_shared<ChainCounts>();
  const Tensor xT = integrate(x0, w, a, steps, shared, plan);
  const Tensor target = tensor({0.25f, -0.5f}, {1, 2});
  Tensor loss = sum((xT - target) * (xT - target));
  loss.backward();
  if (counts) *counts = *shared;
  return {w.grad().to_vector(), static_cast<double>(loss.item())};
}

void check(const Args& a) {
  Args plain = a;
  plain.policy = "none";
  const std::int64_t L = 2000;
  Args coarse = a;
  coarse.dt = 1e-3;  // a horizon long enough for the gradient to be well above float noise
  plain.dt = coarse.dt;
  const auto [g_ck, l_ck] = gradient(coarse, L, nullptr, nullptr);
  const auto [g_plain, l_plain] = gradient(plain, L, nullptr, nullptr);
  REMAT_CHECK(g_ck == g_plain && l_ck == l_plain, "ode_adjoint --check: {} steps under {} differ from the plain loop", L,
              a.policy);
  // Central differences on each entry of W, in float, with a step that balances truncation and
  // rounding; the agreement expected is about 1e-2 relative.
  for (int k = 0; k < 4; ++k) {
    auto loss_at = [&](float delta) {
      no_grad off;
      Tensor w = tensor({0.0f, -1.0f, 1.0f, -0.1f}, {2, 2});
      w.data()[k] += delta;
      Tensor x = tensor({1.0f, 0.0f}, {1, 2});
      for (std::int64_t i = 0; i < L; ++i) x = euler_step(x, w, static_cast<float>(coarse.dt));
      return loss_value(x);
    };
    const float h = 1e-2f;
    const double fd = (loss_at(h) - loss_at(-h)) / (2.0 * h);
    const double err = std::abs(fd - g_ck[static_cast<std::size_t>(k)]) / std::max(1e-3, std::abs(fd));
    fmt::print("  dL/dW[{}]: backward {:+.6f}, finite difference {:+.6f} (relative difference {:.1e})\n", k,
               g_ck[static_cast<std::size_t>(k)], fd, err);
    REMAT_CHECK(err < 2e-2, "ode_adjoint --check: dL/dW[{}] = {} by backward but {} by finite differences", k,
                g_ck[static_cast<std::size_t>(k)], fd);
  }
  fmt::print("check: {} steps under {} equal the plain loop bitwise, and match finite differences\n", L, a.policy);
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  std::map<std::string, std::string> flags;
  for (int i = 1; i + 1 < argc; i += 2) flags[std::string(argv[i]).substr(2)] = argv[i + 1];
  for (const auto& [k, v] : flags) {
    if (k == "steps") a.steps = std::stoll(v);
    else if (k == "dt") a.dt = std::stod(v);
    else if (k == "policy") a.policy = v;
    else if (k == "dir") a.dir = v;
    else if (k == "write-cost") a.write_cost = std::stod(v);
    else if (k == "read-cost") a.read_cost = std::stod(v);
    else if (k == "check") a.check = v != "0";
    else throw Error(fmt::format("ode_adjoint: unknown flag --{}", k));
  }
  if (a.check) check(a);
  ChainCounts counts;
  Plan p;
  const auto t0 = std::chrono::steady_clock::now();
  const auto [g, loss] = gradient(a, a.steps, &counts, &p);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (p.steps > 0) {
    const std::string summary = p.str();
    fmt::print("{}\n", summary.substr(0, summary.find('\n')));
  }
  // The process's peak, read last: ru_maxrss is the most it has held, whatever ran before.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  fmt::print("{} steps under {}: loss {:.6f}, dL/dW = [{:+.6f}, {:+.6f}, {:+.6f}, {:+.6f}]\n", a.steps, a.policy, loss, g[0],
             g[1], g[2], g[3]);
  fmt::print("executed: {} advances, {} recorded steps, at most {} snapshots ({} written to disk)\n", counts.advances,
             counts.records, counts.peak_snapshots, counts.disk_writes);
  fmt::print("time {:.2f} s, peak RSS {:.1f} MB, peak bytes saved for backward (library books) {} \n", seconds,
             static_cast<double>(usage.ru_maxrss) / 1024.0, memory_stats().peak_saved_bytes);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
