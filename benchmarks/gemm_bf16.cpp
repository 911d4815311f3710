// bfloat16 GEMM (float32 sums) against the float32 GEMM on the example GPT's shapes, same process,
// alternating, median and range of 9 timed runs each after a warm-up. The operands are converted
// once before timing: the figure is the product alone. One JSON line per shape, then a summary.
//
//   OMP_NUM_THREADS=1 ./bench_gemm_bf16      (and 2: the machine's cores)
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  struct Shape3 {
    const char* what;
    std::int64_t m, n, k;
    bool trans_b;
  };
  // Small GPT (d 256, T 128, B 8): linear layers on B·T = 1024 rows; the attention's per-head
  // products (T 128, head 64); the backward's weight gradient (d_out^T x: k = 1024).
  const std::vector<Shape3> shapes{{"qkv 1024x768x256", 1024, 768, 256, true},
                                   {"proj 1024x256x256", 1024, 256, 256, true},
                                   {"mlp up 1024x1024x256", 1024, 1024, 256, true},
                                   {"mlp down 1024x256x1024", 1024, 256, 1024, true},
                                   {"weight grad 768x256x1024", 768, 256, 1024, false},
                                   {"scores 128x128x64", 128, 128, 64, true},
                                   {"values 128x64x128", 128, 64, 128, false}};
  Generator g(0);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  double worst_ratio = 1e9;
  for (const Shape3& s : shapes) {
    const std::int64_t a_n = s.m * s.k, b_n = s.k * s.n;
    const std::vector<float> a = randn({a_n}, g).to_vector(), b = randn({b_n}, g).to_vector();
    std::vector<Eigen::bfloat16> a16(a.begin(), a.end()), b16(b.begin(), b.end());
    std::vector<float> c(static_cast<std::size_t>(s.m * s.n));
    const std::int64_t ldb = s.trans_b ? s.k : s.n;
    // Enough repetitions per timing that one lasts a few milliseconds.
    const int reps = std::max<int>(1, static_cast<int>(2e8 / (2.0 * s.m * s.n * s.k)));
    auto gflops = [&](auto&& f) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) f();
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return 2.0 * s.m * s.n * s.k * reps / sec / 1e9;
    };
    std::vector<double> f32, b16v;
    for (int rep = 0; rep < 10; ++rep) {
      const double x = gflops([&] { detail::gemm(false, s.trans_b, s.m, s.n, s.k, a.data(), s.k, b.data(), ldb, c.data(), s.n); });
      const double y = gflops([&] {
        detail::gemm_bf16(false, s.trans_b, s.m, s.n, s.k, a16.data(), s.k, b16.data(), ldb, c.data(), s.n);
      });
      if (rep == 0) continue;  // warm-up
      f32.push_back(x);
      b16v.push_back(y);
    }
    const double mf = median(f32), mb = median(b16v);
    worst_ratio = std::min(worst_ratio, mb / mf);
    fmt::print("{{\"shape\": \"{}\", \"fp32_gflops\": {:.1f}, \"fp32_range\": [{:.1f}, {:.1f}], \"bf16_gflops\": {:.1f}, "
               "\"bf16_range\": [{:.1f}, {:.1f}], \"ratio\": {:.2f}}}\n", s.what, mf,
               *std::min_element(f32.begin(), f32.end()), *std::max_element(f32.begin(), f32.end()), mb,
               *std::min_element(b16v.begin(), b16v.end()), *std::max_element(b16v.begin(), b16v.end()), mb / mf);
  }
  fmt::print("{{\"backend\": \"{}\", \"bf16_backend\": \"{}\", \"threads\": {}, \"worst_bf16_over_fp32\": {:.2f}}}\n",
             detail::gemm_backend(), detail::gemm_bf16_backend(), get_num_threads(), worst_ratio);
}
