// What a parallel region costs remat's kernels: an empty region through parallel_for and a
// 4,096-float axpy through it, each timed back to back (the team still spinning) and after 50 µs
// of serial work on the calling thread (what a small serial op does between two parallel ones:
// a spinning worker may have been descheduled, a sleeping one must be woken). Median and range of
// --calls calls per case, in µs per call. Then, per kernel family (a memory-bound axpy, Eigen's
// vectorised tanh, the dropout mask's Philox draw, layer norm's rows of 128), the time of n
// elements on one thread and split over the team, for n from 2^10 to 2^17: where splitting starts
// to pay is where remat's grains (core/threads.hpp) belong. One JSON line.
//   parallel_overhead --calls 2000
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <remat/remat.hpp>

#include "flags.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// About `us` microseconds of work the optimiser cannot drop, on the calling thread only.
double serial_work(double us, double seed) {
  const auto end = Clock::now() + std::chrono::duration<double, std::micro>(us);
  volatile double x = seed;
  while (Clock::now() < end)
    for (int i = 0; i < 64; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}

struct Summary {
  double median, low, high;
};

Summary summarise(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v[v.size() * 9 / 10]};
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace remat;
  bench::Flags a = bench::parse_flags(argc, argv, {{"calls", "2000"}, {"gap-us", "50"}}, "parallel_overhead");
  const int calls = std::stoi(a["calls"]);
  const double gap = std::stod(a["gap-us"]);
  constexpr std::int64_t n = 4096;
  std::vector<float> x(n, 1.0f), y(n, 2.0f);
  double sink = 0;

  // Each case's body forced onto every thread (grain 1), as a kernel whose work is worth splitting.
  auto empty = [&] { parallel_for(get_num_threads(), 1, [&](std::int64_t, std::int64_t) {}); };
  auto axpy = [&] {
    parallel_for(n, 1, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) y[static_cast<std::size_t>(i)] += 0.5f * x[static_cast<std::size_t>(i)];
    });
  };
  auto time_calls = [&](auto&& body, double gap_us) {
    std::vector<double> us;
    for (int c = 0; c < calls; ++c) {
      if (gap_us > 0) sink += serial_work(gap_us, c);
      const auto t0 = Clock::now();
      body();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    return summarise(us);
  };
  for (int warm = 0; warm < 100; ++warm) empty(), axpy();
  const Summary e0 = time_calls(empty, 0), a0 = time_calls(axpy, 0), eg = time_calls(empty, gap), ag = time_calls(axpy, gap);
  auto field = [](const char* name, const Summary& s) {
    return fmt::format("\"{}\": [{:.3f}, {:.3f}, {:.3f}]", name, s.median, s.low, s.high);
  };

  // Per family: serial and split medians (µs) at each n, alternating call by call.
  constexpr std::int64_t kMax = std::int64_t{1} << 17, kRow = 128;
  std::vector<float> in(kMax), out(kMax);
  Generator gen(3);
  const std::vector<float> init = randn({kMax}, gen).to_vector();
  std::copy(init.begin(), init.end(), in.begin());
  const Generator::State state = gen.state();
  using Body = std::function<void(std::int64_t, std::int64_t)>;  // on elements [b, e)
  const std::vector<std::pair<const char*, Body>> families = {
      {"axpy", [&](std::int64_t b, std::int64_t e) {
         for (std::int64_t i = b; i < e; ++i) out[static_cast<std::size_t>(i)] += 0.5f * in[static_cast<std::size_t>(i)];
       }},
      {"tanh", [&](std::int64_t b, std::int64_t e) {
         detail::ArrayMap<float>(out.data() + b, e - b) = detail::ConstArrayMap<float>(in.data() + b, e - b).tanh();
       }},
      {"dropout_mask", [&](std::int64_t b, std::int64_t e) {
         detail::for_each_uniform24_run(state, static_cast<std::uint64_t>(b), static_cast<std::uint64_t>(e),
                                        [&](std::uint64_t i, const float* u, std::uint64_t m) {
                                          for (std::uint64_t j = 0; j < m; ++j)
                                            out[i + j] = u[j] >= 0.1f ? in[i + j] * 1.1f : 0.0f;
                                        });
       }},
      {"layer_norm_rows", [&](std::int64_t b, std::int64_t e) {
         for (std::int64_t r = b / kRow; r < e / kRow; ++r) {
           const auto x = detail::ConstArrayMap<float>(in.data() + r * kRow, kRow);
           const float mean = x.mean(), inv = 1.0f / std::sqrt((x - mean).square().mean() + 1e-5f);
           detail::ArrayMap<float>(out.data() + r * kRow, kRow) = (x - mean) * inv;
         }
       }},
  };
  std::string sweep;
  for (const auto& [name, body] : families) {
    std::string cells;
    for (std::int64_t n = 1024; n <= kMax; n *= 2) {
      const std::int64_t pieces = n / (std::string(name) == "dropout_mask" ? 4 : std::string(name) == "layer_norm_rows" ? kRow : 1);
      const std::int64_t unit = n / pieces;
      std::vector<double> serial, split;
      for (int c = 0; c < calls / 4; ++c) {
        auto t0 = Clock::now();
        body(0, n);
        auto t1 = Clock::now();
        parallel_for(pieces, 1, [&](std::int64_t p0, std::int64_t p1) { body(p0 * unit, p1 * unit); });
        auto t2 = Clock::now();
        serial.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        split.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
      }
      cells += fmt::format("{}[{}, {:.2f}, {:.2f}]", cells.empty() ? "" : ", ", n, summarise(serial).median,
                           summarise(split).median);
    }
    sweep += fmt::format("{}\"{}\": [{}]", sweep.empty() ? "" : ", ", name, cells);
  }
  fmt::print("{{\"threads\": {}, \"calls\": {}, \"gap_us\": {}, {}, {}, {}, {}, "
             "\"n_serial_split_us\": {{{}}}, \"sink\": {}}}\n",
             get_num_threads(), calls, gap, field("empty_back_to_back_us", e0), field("axpy4096_back_to_back_us", a0),
             field("empty_after_gap_us", eg), field("axpy4096_after_gap_us", ag), sweep, sink + y[0] + out[0] > 0 ? 1 : 0);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "parallel_overhead: {}\n", e.what());
  return 1;
}
