// Planning the binomial schedule: remat's stream against ADOL-C's revolve() (Debian libadolc-dev),
// the same chain length and snapshot count, in one process, alternating; medians with ranges.
// Both produce every action of the whole schedule and count the advanced steps.
//   plan_vs_revolve --steps 1000000 --snaps 20 --rounds 7 --impl both|remat|adolc
// remat_ms: streaming the schedule; remat_plan_ms: plan(), the checking and counting pass.
// With --impl remat or adolc it runs that one alone (for its peak RSS under /usr/bin/time -v).
#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <sys/resource.h>

#include <adolc/revolve.h>
#include <remat/remat.hpp>

#include "flags.hpp"

namespace {

struct Run {
  double ms;
  std::int64_t advances;
  std::int64_t actions;
};

/// The schedule itself: every action of the stream, advanced steps counted.
Run remat_stream(std::int64_t L, std::int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto stream = remat::policy::binomial(s).stream(L, nullptr);
  std::vector<remat::Action> batch(256, remat::Action{remat::Action::Kind::free, 0});
  std::int64_t advances = 0, actions = 0;
  for (std::size_t got; (got = stream->next(batch.data(), batch.size())) > 0;) {
    actions += static_cast<std::int64_t>(got);
    for (std::size_t k = 0; k < got; ++k)
      if (batch[k].kind == remat::Action::Kind::advance) advances += batch[k].count;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, advances, actions};
}

/// plan(): one pass over the stream that checks it and counts (what checkpoint_sequential does
/// before running a chain).
Run remat_plan(std::int64_t L, std::int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  const remat::Plan p = remat::plan(remat::policy::binomial(s), L);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, p.advances, static_cast<std::int64_t>(p.actions)};
}

Run adolc_revolve(int L, int s) {
  const auto t0 = std::chrono::steady_clock::now();
  int check = -1, capo = 0, fine = L, info = 0;
  std::int64_t advances = 0, actions = 0;
  for (;;) {
    const int before = capo;
    const revolve_action what = revolve(&check, &capo, &fine, s, &info);
    ++actions;
    if (what == revolve_advance) advances += capo - before;
    if (what == revolve_terminate) break;
    REMAT_CHECK(what != revolve_error, "revolve() failed with info {}", info);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, advances, actions};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

}  // namespace

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(argc, argv, {{"steps", "1000000"}, {"snaps", "20"}, {"rounds", "7"}, {"impl", "both"}}, "plan_vs_revolve");
  const int L = std::stoi(a["steps"]), s = std::stoi(a["snaps"]), rounds = std::stoi(a["rounds"]);
  const std::string impl = a["impl"];
  const long rss0 = peak_rss_kb();
  std::vector<double> remat_ms, plan_ms, adolc_ms;
  Run r{}, q{}, p{};
  for (int round = 0; round < rounds; ++round) {
    if (impl != "adolc") remat_ms.push_back((r = remat_stream(L, s)).ms);
    if (impl != "remat") adolc_ms.push_back((q = adolc_revolve(L, s)).ms);
    if (impl != "adolc") plan_ms.push_back((p = remat_plan(L, s)).ms);
  }
  REMAT_CHECK(impl == "adolc" || (r.advances == p.advances && p.advances == remat::binomial_min_advances(L, s)),
              "remat: the stream and the plan disagree");
  fmt::print("{{\"steps\": {}, \"snaps\": {}, \"impl\": \"{}\"", L, s, impl);
  if (!remat_ms.empty())
    fmt::print(", \"remat_ms\": [{:.2f}, {:.2f}, {:.2f}], \"remat_advances\": {}, \"remat_actions\": {}", median(remat_ms),
               *std::min_element(remat_ms.begin(), remat_ms.end()), *std::max_element(remat_ms.begin(), remat_ms.end()),
               r.advances, r.actions);
  if (!plan_ms.empty())
    fmt::print(", \"remat_plan_ms\": [{:.2f}, {:.2f}, {:.2f}]", median(plan_ms),
               *std::min_element(plan_ms.begin(), plan_ms.end()), *std::max_element(plan_ms.begin(), plan_ms.end()));
  if (!adolc_ms.empty())
    fmt::print(", \"adolc_ms\": [{:.2f}, {:.2f}, {:.2f}], \"adolc_advances\": {}, \"adolc_calls\": {}", median(adolc_ms),
               *std::min_element(adolc_ms.begin(), adolc_ms.end()), *std::max_element(adolc_ms.begin(), adolc_ms.end()),
               q.advances, q.actions);
  fmt::print(", \"peak_rss_growth_kb\": {}}}\n", peak_rss_kb() - rss0);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
