// Planning the binomial schedule: remat's stream against ADOL-C's revolve() (Debian libadolc-dev),
// the same chain length and snapshot count, in one process, alternating; medians with ranges.
// Each loop produces every action of the whole schedule and counts the actions and the advanced steps.
//   plan_vs_revolve --steps 1000000 --snaps 20 --rounds 7 --impl both|remat|reader|virtual|batch|plan|adolc
// remat_ms: the stream read in batches of 256 (next(Action*, n)); reader_ms: one action at a time
// through remat::ActionReader, exactly as the chain executor (ChainRun::run_forward/run_backward)
// consumes a schedule; virtual_ms: one virtual next(Action&) per action (the executor's path before
// ActionReader); remat_plan_ms: plan(), the checking and counting pass; adolc_ms: ADOL-C's loop.
// --impl both runs them all, alternating; remat runs batch and plan (as before); any other value
// runs that one loop alone (for its peak RSS under /usr/bin/time -v, or its instruction count under
// valgrind --tool=callgrind --toggle-collect='*loop_*'). Built with -DREMAT_BENCH_NO_READER (headers
// without ActionReader) the reader loop is left out.
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
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
[[gnu::noinline]] Run loop_batch(std::int64_t L, std::int64_t s) {
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

/// The executor's path: one action at a time through ActionReader (256 per virtual call).
#ifndef REMAT_BENCH_NO_READER
[[gnu::noinline]] Run loop_reader(std::int64_t L, std::int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  remat::ActionReader stream(remat::policy::binomial(s).stream(L, nullptr));
  remat::Action act{remat::Action::Kind::free, 0};
  std::int64_t advances = 0, actions = 0;
  while (stream.next(act)) {
    ++actions;
    if (act.kind == remat::Action::Kind::advance) advances += act.count;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, advances, actions};
}
#endif

/// One virtual next(Action&) per action: how the executor read its schedule before ActionReader.
[[gnu::noinline]] Run loop_virtual(std::int64_t L, std::int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::unique_ptr<remat::ActionStream> stream = remat::policy::binomial(s).stream(L, nullptr);
  remat::Action act{remat::Action::Kind::free, 0};
  std::int64_t advances = 0, actions = 0;
  while (stream->next(act)) {
    ++actions;
    if (act.kind == remat::Action::Kind::advance) advances += act.count;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, advances, actions};
}

/// plan(): one pass over the stream that checks it and counts (what checkpoint_sequential does
/// before running a chain).
[[gnu::noinline]] Run loop_plan(std::int64_t L, std::int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  const remat::Plan p = remat::plan(remat::policy::binomial(s), L);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {ms, p.advances, static_cast<std::int64_t>(p.actions)};
}

[[gnu::noinline]] Run loop_adolc(int L, int s) {
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

void print_times(const char* name, const std::vector<double>& v) {
  if (v.empty()) return;
  fmt::print(", \"{}\": [{:.2f}, {:.2f}, {:.2f}]", name, median(v), *std::min_element(v.begin(), v.end()),
             *std::max_element(v.begin(), v.end()));
}

}  // namespace

int main(int argc, char** argv) try {
  bench::Flags a = bench::parse_flags(argc, argv, {{"steps", "1000000"}, {"snaps", "20"}, {"rounds", "7"}, {"impl", "both"}}, "plan_vs_revolve");
  const int L = std::stoi(a["steps"]), s = std::stoi(a["snaps"]), rounds = std::stoi(a["rounds"]);
  const std::string impl = a["impl"];
  REMAT_CHECK(impl == "both" || impl == "remat" || impl == "reader" || impl == "virtual" || impl == "batch" ||
                  impl == "plan" || impl == "adolc",
              "plan_vs_revolve: --impl is both|remat|reader|virtual|batch|plan|adolc, got {}", impl);
#ifdef REMAT_BENCH_NO_READER
  REMAT_CHECK(impl != "reader", "plan_vs_revolve: built without ActionReader (REMAT_BENCH_NO_READER)");
  const bool has_reader = false;
#else
  const bool has_reader = true;
#endif
  const auto runs = [&](const char* loop) {
    const std::string l = loop;
    if (impl == "both") return l != "reader" || has_reader;
    if (impl == "remat") return l == "batch" || l == "plan";
    return impl == l;
  };
  const long rss0 = peak_rss_kb();
  std::vector<double> batch_ms, reader_ms, virtual_ms, plan_ms, adolc_ms;
  Run b{}, rd{}, v{}, p{}, q{};
  // Alternating, the order rotated each round so no loop always runs first (or right after ADOL-C).
  for (int round = 0; round < rounds; ++round) {
    for (int k = 0; k < 5; ++k) {
      switch ((round + k) % 5) {
        case 0: if (runs("batch")) batch_ms.push_back((b = loop_batch(L, s)).ms); break;
#ifndef REMAT_BENCH_NO_READER
        case 1: if (runs("reader")) reader_ms.push_back((rd = loop_reader(L, s)).ms); break;
#endif
        case 2: if (runs("virtual")) virtual_ms.push_back((v = loop_virtual(L, s)).ms); break;
        case 3: if (runs("adolc")) adolc_ms.push_back((q = loop_adolc(L, s)).ms); break;
        case 4: if (runs("plan")) plan_ms.push_back((p = loop_plan(L, s)).ms); break;
        default: break;
      }
    }
  }
  const std::int64_t F = remat::binomial_min_advances(L, s);
  for (const auto& [ran, run] : {std::pair{!batch_ms.empty(), b}, std::pair{!reader_ms.empty(), rd},
                                 std::pair{!virtual_ms.empty(), v}, std::pair{!plan_ms.empty(), p}})
    REMAT_CHECK(!ran || run.advances == F, "remat: a loop counted {} advances, F(L, s) = {}", run.advances, F);
  const Run& r = !batch_ms.empty() ? b : !reader_ms.empty() ? rd : v;
  REMAT_CHECK((reader_ms.empty() || rd.actions == r.actions) && (virtual_ms.empty() || v.actions == r.actions),
              "remat: the loops read different numbers of actions");
  fmt::print("{{\"steps\": {}, \"snaps\": {}, \"impl\": \"{}\"", L, s, impl);
  print_times("remat_ms", batch_ms);
  print_times("reader_ms", reader_ms);
  print_times("virtual_ms", virtual_ms);
  if (!batch_ms.empty() || !reader_ms.empty() || !virtual_ms.empty())
    fmt::print(", \"remat_advances\": {}, \"remat_actions\": {}", r.advances, r.actions);
  print_times("remat_plan_ms", plan_ms);
  print_times("adolc_ms", adolc_ms);
  if (!adolc_ms.empty()) fmt::print(", \"adolc_advances\": {}, \"adolc_calls\": {}", q.advances, q.actions);
  fmt::print(", \"peak_rss_growth_kb\": {}}}\n", peak_rss_kb() - rss0);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
