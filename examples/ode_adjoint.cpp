// A long time loop differentiated end to end: a damped oscillator x' = x Wᵀ integrated with
// explicit Euler for a million steps, the loss the distance of the final state from a target,
// and its gradient with respect to W — the adjoint of the whole trajectory — computed under a
// checkpointing schedule, so memory stays O(snapshots) instead of O(steps).
//
//   ode_adjoint --steps 1000000 --policy binomial:20            offline: the length is known
//   ode_adjoint --steps 1000000 --policy two_tier:4+16 --dir /tmp   snapshots in memory and files
//   ode_adjoint --steps 1000000 --policy online:20              steps arrive until t >= t_end
//   ode_adjoint --check 1                                        also verify on a short horizon
//   ode_adjoint --steps 100000 --policy binomial:20 --hvp 1      a Hessian-vector product too
//
// --check runs 2,000 steps three ways — no checkpointing, the chosen schedule, and central finite
// differences on every entry of W — and stops with an error if they disagree.
//
// --hvp also computes H·v, H the Hessian of the loss with respect to the initial state and W
// together, by forward-over-reverse (remat::hvp) under the same schedule: the states carry their
// tangents and the snapshots keep them beside the states, so memory stays O(snapshots). It is
// checked against central differences of gradients along v (and, with --check, against the plain
// loop's H·v on 2,000 steps, bit for bit).
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
  bool hvp = false;
};

Tensor initial_w() { return tensor({0.0f, -1.0f, 1.0f, -0.1f}, {2, 2}); }  // x' = (v, −x − 0.1 v)
Tensor initial_x() { return tensor({1.0f, 0.0f}, {1, 2}); }

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

/// The loss after `steps` steps from x0 with W = w, under the schedule in `a`.
Tensor final_loss(const Tensor& x0, const Tensor& w, const Args& a, std::int64_t steps,
                  const std::shared_ptr<ChainCounts>& counts, Plan* plan) {
  const Tensor xT = integrate(x0, w, a, steps, counts, plan);
  const Tensor target = tensor({0.25f, -0.5f}, {1, 2});
  return sum((xT - target) * (xT - target));
}

/// dLoss/dW and the loss, with the schedule in `a`.
std::pair<std::vector<float>, double> gradient(const Args& a, std::int64_t steps, ChainCounts* counts, Plan* plan) {
  Tensor w = initial_w().requires_grad_();
  auto shared = std::make_shared<ChainCounts>();
  Tensor loss = final_loss(initial_x(), w, a, steps, shared, plan);
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
      Tensor w = initial_w();
      w.data()[k] += delta;
      Tensor x = initial_x();
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

/// H·v for the initial state and W along v = (v_x, v_W), under the schedule in `a`: [x part, W part].
std::vector<Tensor> hessian_vector(const Args& a, std::int64_t steps, const std::vector<Tensor>& v,
                                   const std::shared_ptr<ChainCounts>& counts) {
  // hvp hands f the inputs as dual tensors; the chain's steps read W's by reference, alive until hvp returns.
  const auto loss = [&](const std::vector<Tensor>& p) { return final_loss(p[0], p[1], a, steps, counts, nullptr); };
  return hvp(loss, std::vector<Tensor>{initial_x(), initial_w()}, v).second;
}

/// The gradients with respect to the initial state and W at (x0, W) + s·v, under the schedule in `a`.
std::vector<Tensor> gradients_along(const Args& a, std::int64_t steps, const std::vector<Tensor>& v, float s) {
  const Tensor x = (initial_x() + v[0] * s).detach().requires_grad_();
  const Tensor w = (initial_w() + v[1] * s).detach().requires_grad_();
  return grad(final_loss(x, w, a, steps, nullptr, nullptr), {x, w});
}

void check_hvp(const Args& a) {
  const std::vector<Tensor> v{tensor({0.3f, -0.7f}, {1, 2}), tensor({0.5f, 0.2f, -0.4f, 0.9f}, {2, 2})};
  if (a.check) {
    Args coarse = a, plain = a;
    coarse.dt = plain.dt = 1e-3;
    plain.policy = "none";
    const std::vector<Tensor> ck = hessian_vector(coarse, 2000, v, nullptr), ref = hessian_vector(plain, 2000, v, nullptr);
    for (std::size_t i = 0; i < ck.size(); ++i)
      REMAT_CHECK(ck[i].to_vector() == ref[i].to_vector(), "ode_adjoint --hvp: 2000 steps under {} give another H·v "
                  "than the plain loop", a.policy);
    fmt::print("check: H·v over 2000 steps under {} equals the plain loop's bitwise\n", a.policy);
  }
  auto counts = std::make_shared<ChainCounts>();
  reset_peak_memory_stats();
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<Tensor> hv = hessian_vector(a, a.steps, v, counts);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::size_t peak_saved = memory_stats().peak_saved_bytes, peak = memory_stats().peak_bytes;
  // Central differences of gradients along v, each gradient under the same schedule; in float, with
  // a step that balances truncation and rounding: the agreement expected is about 1e-3 relative.
  const float h = 1e-2f;
  const std::vector<Tensor> plus = gradients_along(a, a.steps, v, h), minus = gradients_along(a, a.steps, v, -h);
  double worst = 0;
  for (std::size_t i = 0; i < hv.size(); ++i) {
    std::vector<double> fd;
    for (std::int64_t j = 0; j < hv[i].numel(); ++j)
      fd.push_back((double(plus[i].data()[j]) - minus[i].data()[j]) / (2.0 * h));
    double scale = 0, gap = 0;
    for (std::size_t j = 0; j < fd.size(); ++j) {
      scale = std::max(scale, std::abs(fd[j]));
      gap = std::max(gap, std::abs(fd[j] - hv[i].data()[j]));
    }
    worst = std::max(worst, gap / scale);
    fmt::print("  H·v, {} part: [{:+.6f}], differences of gradients [{:+.6f}] (largest gap {:.1e} of the largest entry)\n",
               i == 0 ? "initial state" : "W", fmt::join(hv[i].to_vector(), ", "), fmt::join(fd, ", "), gap / scale);
  }
  fmt::print("hvp: {} steps under {}: {:.2f} s; executed {} advances, {} recorded steps, at most {} snapshots ({} written "
             "to disk); peak bytes saved for backward (library books, tangents of snapshots included) {}, peak tensor "
             "bytes {}\n", a.steps, a.policy, seconds, counts->advances, counts->records, counts->peak_snapshots,
             counts->disk_writes, peak_saved, peak);
  REMAT_CHECK(worst < 1e-2, "ode_adjoint --hvp: H·v and differences of gradients differ by {:.1e} relative", worst);
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
    else if (k == "hvp") a.hvp = v != "0";
    else throw Error(fmt::format("ode_adjoint: unknown flag --{}", k));
  }
  if (a.check) check(a);
  if (a.hvp) check_hvp(a);
  ChainCounts counts;
  Plan p;
  reset_peak_memory_stats();  // the books' peak of the gradient alone
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
