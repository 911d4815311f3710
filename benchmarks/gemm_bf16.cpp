// The products' engines on the example GPT's shapes, same process, alternating, each timed over a
// rotation of 8 operand sets (so no product reads operands the last one left in cache), median and
// range of 9 timed rounds after a warm-up: float32 on dnnl_sgemm and on oneDNN's matmul primitive,
// bfloat16 (float32 sums) on dnnl_gemm_bf16bf16f32 and on the matmul primitive, and what remat's
// gemm and gemm_bf16 chose. Then the cost of a product served from the primitive cache (a 2×2×2
// product, whose arithmetic is nothing), and the ISA oneDNN chose. One JSON line per shape.
//
//   OMP_NUM_THREADS=1 ./bench_gemm_bf16      (and 2: the machine's cores)
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <remat/remat.hpp>

namespace {

struct Shape3 {
  const char* what;
  std::int64_t m, n, k;
  bool trans_a, trans_b;
};

struct Stats {
  double median, low, high;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

}  // namespace

int main() {
  using namespace remat;
  // Small GPT (d 256, T 128, B 8): linear layers on B·T = 1024 rows, forward (x Wᵀ) and the
  // backward's dX = dY W and dW = dYᵀ X; the attention's per-head products (T 128, head 64); the
  // issue's four shapes among them.
  const std::vector<Shape3> shapes{{"qkv 1024x768x256", 1024, 768, 256, false, true},
                                   {"mlp up 1024x1024x256", 1024, 1024, 256, false, true},
                                   {"mlp down 1024x256x1024", 1024, 256, 1024, false, true},
                                   {"proj 1024x256x256", 1024, 256, 256, false, true},
                                   {"dX qkv 1024x256x768", 1024, 256, 768, false, false},
                                   {"dW mlp down 256x1024x1024", 256, 1024, 1024, true, false},
                                   {"head scores 128x128x64", 128, 128, 64, false, true},
                                   {"head values 128x64x128", 128, 64, 128, false, false}};
  constexpr int kSets = 8;
  Generator g(0);
  std::map<std::string, std::vector<double>> worst;  // engine -> its rate over the primitive's, per shape
  for (const Shape3& s : shapes) {
    const std::int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    std::vector<std::vector<float>> a(kSets), b(kSets), c(kSets);
    std::vector<std::vector<Eigen::bfloat16>> a16(kSets), b16(kSets);
    for (int i = 0; i < kSets; ++i) {
      a[i] = randn({s.m * s.k}, g).to_vector();
      b[i] = randn({s.k * s.n}, g).to_vector();
      c[i].resize(static_cast<std::size_t>(s.m * s.n));
      for (float x : a[i]) a16[i].push_back(Eigen::bfloat16(x));
      for (float x : b[i]) b16[i].push_back(Eigen::bfloat16(x));
    }
    using Product = std::function<void(int)>;
    std::vector<std::pair<std::string, Product>> engines;
    engines.emplace_back("remat_fp32", [&](int i) {
      detail::gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, a[i].data(), lda, b[i].data(), ldb, c[i].data(), s.n);
    });
    engines.emplace_back("remat_bf16", [&](int i) {
      detail::gemm_bf16(s.trans_a, s.trans_b, s.m, s.n, s.k, a16[i].data(), lda, b16[i].data(), ldb, c[i].data(), s.n);
    });
#ifdef REMAT_WITH_ONEDNN
    const detail::MatmulKey f32_key = detail::matmul_key(dnnl_f32, s.trans_a, s.trans_b, 1, s.m, s.n, s.k, lda, 0, ldb,
                                                         0, s.n, 0, false);
    const detail::MatmulKey bf16_key = detail::matmul_key(dnnl_bf16, s.trans_a, s.trans_b, 1, s.m, s.n, s.k, lda, 0,
                                                          ldb, 0, s.n, 0, false);
    const detail::MatmulPrimitive f32_primitive(f32_key), bf16_primitive(bf16_key);
    engines.emplace_back("sgemm", [&](int i) {
      dnnl_sgemm(s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', s.m, s.n, s.k, 1.0f, a[i].data(), lda, b[i].data(), ldb,
                 0.0f, c[i].data(), s.n);
    });
    if (f32_primitive.usable())
      engines.emplace_back("fp32_primitive", [&](int i) { f32_primitive.run(a[i].data(), b[i].data(), c[i].data(), f32_key); });
    if (detail::bf16_engine() != detail::Bf16Engine::widened)
      engines.emplace_back("gemm_bf16bf16f32", [&](int i) {
        detail::onednn_gemm_bf16(s.trans_a, s.trans_b, s.m, s.n, s.k, a16[i].data(), lda, b16[i].data(), ldb,
                                 c[i].data(), s.n, false);
      });
    if (bf16_primitive.usable())
      engines.emplace_back("bf16_primitive", [&](int i) {
        bf16_primitive.run(a16[i].data(), b16[i].data(), c[i].data(), bf16_key);
      });
#endif
    const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
    // Enough rotations per timing that one lasts a few milliseconds.
    const int rounds = std::max(1, static_cast<int>(2e8 / (flops * kSets)));
    std::vector<std::vector<double>> rates(engines.size());
    for (int rep = 0; rep < 10; ++rep)
      for (std::size_t e = 0; e < engines.size(); ++e) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < rounds; ++r)
          for (int i = 0; i < kSets; ++i) engines[e].second(i);
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) rates[e].push_back(flops * rounds * kSets / sec / 1e9);  // the first is a warm-up
      }
    std::string line = fmt::format("{{\"shape\": \"{}\"", s.what);
    std::map<std::string, double> median;
    for (std::size_t e = 0; e < engines.size(); ++e) {
      const Stats st = stats_of(rates[e]);
      median[engines[e].first] = st.median;
      line += fmt::format(", \"{}\": [{:.0f}, {:.0f}, {:.0f}]", engines[e].first, st.median, st.low, st.high);
    }
    if (median.count("bf16_primitive"))
      for (const auto& [name, rate] : median) worst[name].push_back(rate / median["bf16_primitive"]);
#ifdef REMAT_WITH_ONEDNN
    line += fmt::format(", \"fp32_kernel\": \"{}\", \"bf16_kernel\": \"{}\"", f32_primitive.implementation(),
                        bf16_primitive.implementation());
#endif
    fmt::print("{}}}\n", line);
  }
  // The hit path: a product whose arithmetic is nothing, through gemm_bf16 (key, cache lookup,
  // the primitive's four buffers set, execution), against the same through dnnl_gemm_bf16bf16f32.
  std::string hit = "{\"hit_path\": true";
#ifdef REMAT_WITH_ONEDNN
  {
    const std::vector<Eigen::bfloat16> x(4, Eigen::bfloat16(1.0f));
    std::vector<float> y(4);
    const detail::MatmulKey key = detail::matmul_key(dnnl_bf16, false, false, 1, 2, 2, 2, 2, 0, 2, 0, 2, 0, false);
    auto per_call_us = [&](auto&& f) {
      std::vector<double> v;
      for (int rep = 0; rep < 7; ++rep) {
        constexpr int calls = 20000;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) f();
        v.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls * 1e6);
      }
      return stats_of(v);
    };
    const Stats cached = per_call_us([&] { detail::run_matmul_primitive(key, x.data(), x.data(), y.data()); });
    const Stats direct = per_call_us([&] {
      detail::onednn_gemm_bf16(false, false, 2, 2, 2, x.data(), 2, x.data(), 2, y.data(), 2, false);
    });
    hit += fmt::format(", \"cached_primitive_us\": [{:.3f}, {:.3f}, {:.3f}], \"gemm_bf16bf16f32_us\": [{:.3f}, {:.3f}, "
                       "{:.3f}], \"bf16_kernel\": \"{}\"",
                       cached.median, cached.low, cached.high, direct.median, direct.low, direct.high,
                       detail::bf16_primitive_implementation());
  }
#endif
  fmt::print("{}}}\n", hit);
  std::string summary = fmt::format("{{\"backend\": \"{}\", \"bf16_backend\": \"{}\", \"threads\": {}", remat::gemm_backend(),
                                    remat::gemm_bf16_backend(), get_num_threads());
  for (const auto& [name, r] : worst)
    summary += fmt::format(", \"{}_over_bf16_primitive\": [{:.2f}, {:.2f}]", name, *std::min_element(r.begin(), r.end()),
                           *std::max_element(r.begin(), r.end()));
  fmt::print("{}}}\n", summary);
}
