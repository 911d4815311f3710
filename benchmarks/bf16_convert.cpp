// float32 -> bfloat16 conversion throughput: the AVX512-BF16 kernel (VCVTNEPS2BF16 with its
// subnormal fix-up; only in builds for a CPU that has it, e.g. the bench preset's -march=native)
// against the portable kernel (integer round-to-nearest-even, as the compiler vectorises it), over
// the same thread split as to<bfloat16>, into a preallocated output; and to<bfloat16>(x) itself,
// which allocates its result. Standard normal inputs (no subnormals, the usual case). Each run
// converts about 64M elements (repeating the conversion); median of 9 runs per path, the paths
// alternating after one warm-up round. Prints one JSON line per size.
// usage: bench_bf16_convert [--sizes 1048576,16777216] [--runs 9]
#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <remat/remat.hpp>

#include "flags.hpp"

int main(int argc, char** argv) {
  using namespace remat;
  bench::Flags a = bench::parse_flags(argc, argv, {{"sizes", "1048576,16777216"}, {"runs", "9"}}, "bench_bf16_convert");
  const int runs = std::stoi(a["runs"]);
  std::vector<std::int64_t> sizes;
  std::stringstream list(a["sizes"]);
  for (std::string s; std::getline(list, s, ',');) sizes.push_back(std::stoll(s));

  for (const std::int64_t n : sizes) {
    Generator g(0);
    const Tensor x = randn({n}, g);
    BFloat16Tensor out({n});
    const std::int64_t reps = std::max<std::int64_t>(1, (std::int64_t{1} << 26) / n);
    using Kernel = void (*)(const float*, bfloat16*, std::int64_t);
    std::vector<std::pair<std::string, Kernel>> kernels{{"portable", detail::narrow_to_bfloat16_portable}};
#if defined(__AVX512BF16__)
    kernels.emplace(kernels.begin(), "avx512bf16", detail::narrow_to_bfloat16_avx512);
#endif
    // Seconds per conversion of n elements.
    const auto seconds = [&](auto&& convert) {
      const auto t0 = std::chrono::steady_clock::now();
      for (std::int64_t r = 0; r < reps; ++r) convert();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(reps);
    };
    std::map<std::string, std::vector<double>> times;
    for (int run = 0; run <= runs; ++run) {
      for (const auto& [name, kernel] : kernels) {
        const double s = seconds([&, k = kernel] { detail::convert_elements(x.data(), out.data(), n, k); });
        if (run > 0) times[name].push_back(s);  // run 0 warms caches and pages
      }
      const double s = seconds([&] { out = to<bfloat16>(x); });
      if (run > 0) times["to"].push_back(s);
    }
    std::string fields;
    for (auto& [name, v] : times) {
      std::sort(v.begin(), v.end());
      const double median = v[v.size() / 2];
      fields += fmt::format(", \"{}_gelem_s\": {:.3f}, \"{}_gb_s\": {:.2f}", name, static_cast<double>(n) / median / 1e9,
                            name, 6.0 * static_cast<double>(n) / median / 1e9);
    }
    fmt::print("{{\"elements\": {}, \"threads\": {}, \"to_kernel\": \"{}\", \"runs\": {}, \"reps_per_run\": {}{}}}\n", n,
               get_num_threads(), detail::bfloat16_kernel(), runs, reps, fields);
  }
}
