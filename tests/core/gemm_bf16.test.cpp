// The mixed-precision product (core/gemm.hpp, gemm_bf16): bfloat16 operands, float32 sums. On
// operands that are exact in bfloat16 it must agree with the float GEMM to float rounding (only the
// order of the sums may differ), for every transpose, dense and strided operands, accumulation,
// batches, and on every engine (the matmul primitive, dnnl_gemm_bf16bf16f32, widened operands).

#include <cmath>
#include <functional>
#include <tuple>

#include "support.hpp"

using namespace remat;

namespace {

using Bf16Product = std::function<void(bool, bool, std::int64_t, std::int64_t, std::int64_t, const Eigen::bfloat16*,
                                       std::int64_t, const Eigen::bfloat16*, std::int64_t, float*, std::int64_t, bool)>;

/// The engines a process may use, each called directly: the one this process chose, and the ones
/// below it.
std::vector<std::pair<const char*, Bf16Product>> bf16_engines() {
  std::vector<std::pair<const char*, Bf16Product>> engines{{"this process's", detail::gemm_bf16},
                                                           {"widened", detail::gemm_bf16_widened}};
#ifdef REMAT_WITH_ONEDNN
  if (detail::bf16_engine() != detail::Bf16Engine::widened)
    engines.emplace_back("dnnl_gemm_bf16bf16f32", detail::onednn_gemm_bf16);
#endif
  return engines;
}

/// Bfloat16 values and the float32 values they are.
struct Bf16Operand {
  std::vector<Eigen::bfloat16> b;
  std::vector<float> f;
  Bf16Operand(std::int64_t n, Generator& g) {
    const std::vector<float> r = randn({n}, g).to_vector();
    b.resize(r.size());
    f.resize(r.size());
    for (std::size_t i = 0; i < r.size(); ++i) f[i] = static_cast<float>(b[i] = Eigen::bfloat16(r[i]));
  }
};

/// Checks C (m×n, ldc) against op(A) op(B) (+ `initial` when accumulating) summed in double: a
/// float32 accumulation of k products is within k ulps of the magnitude summed.
void check_product(const std::vector<float>& c, std::int64_t ldc, const float* fa, std::int64_t lda, const float* fb,
                   std::int64_t ldb, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb, float initial) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = initial, magnitude = std::abs(initial);
      for (std::int64_t p = 0; p < k; ++p) {
        const double x = fa[ta ? p * lda + i : i * lda + p];
        const double y = fb[tb ? j * ldb + p : p * ldb + j];
        sum += x * y;
        magnitude += std::abs(x * y);
      }
      REQUIRE(std::abs(c[static_cast<std::size_t>(i * ldc + j)] - sum) <= 1e-7 * static_cast<double>(k + 1) * magnitude + 1e-30);
    }
}

}  // namespace

TEST_CASE("gemm_bf16: float32 sums of bfloat16 operands, every transpose, strides and accumulation", "[core][gemm]") {
  INFO("bfloat16 GEMM backend: " << detail::gemm_bf16_backend());
  Generator g(5);
  for (const auto& [engine, product] : bf16_engines()) {
    CAPTURE(engine);
    // Dense operands (the matmul primitive's brgemm kernels) and strided ones (rows longer than used).
    for (const bool strided : {false, true}) {
      CAPTURE(strided);
      for (auto [m, n, k, ta, tb] : {std::tuple{7, 5, 3, false, false}, {64, 48, 33, true, false}, {17, 31, 64, false, true},
                                     {128, 96, 80, true, true}, {1, 1, 1, false, false}, {256, 192, 64, false, true}}) {
        CAPTURE(m, n, k, ta, tb);
        const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
        const std::int64_t lda = a_cols + (strided ? 3 : 0), ldb = b_cols + (strided ? 1 : 0), ldc = n + (strided ? 2 : 0);
        const Bf16Operand a(a_rows * lda, g), b(b_rows * ldb, g);
        for (bool accumulate : {false, true}) {
          std::vector<float> c(static_cast<std::size_t>(m * ldc), 0.5f);
          product(ta, tb, m, n, k, a.b.data(), lda, b.b.data(), ldb, c.data(), ldc, accumulate);
          check_product(c, ldc, a.f.data(), lda, b.f.data(), ldb, m, n, k, ta, tb, accumulate ? 0.5f : 0.0f);
          // The padding past each row is never written.
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = n; j < ldc; ++j) REQUIRE(c[static_cast<std::size_t>(i * ldc + j)] == 0.5f);
        }
      }
    }
  }
}

TEST_CASE("gemm: float32 products on every path (dnnl_sgemm, the matmul primitive, Eigen) against double sums",
          "[core][gemm]") {
  // k > n takes the matmul primitive, k <= n dnnl_sgemm (with oneDNN); run under OMP_DYNAMIC and
  // OMP_THREAD_LIMIT too (tests/CMakeLists.txt), where oneDNN's split once left pieces unwritten.
  INFO("float GEMM backend: " << detail::gemm_backend());
  Generator g(9);
  for (auto [m, n, k, ta, tb] : {std::tuple{128, 96, 80, false, false}, {128, 96, 80, true, true}, {96, 64, 256, false, true},
                                 {200, 48, 300, true, false}, {33, 17, 5, false, false}}) {
    CAPTURE(m, n, k, ta, tb);
    const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
    const std::vector<float> a = randn({m * k}, g).to_vector(), b = randn({k * n}, g).to_vector();
    for (bool accumulate : {false, true}) {
      std::vector<float> c(static_cast<std::size_t>(m * n), 0.5f);
      detail::gemm(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, c.data(), n, accumulate);
      check_product(c, n, a.data(), lda, b.data(), ldb, m, n, k, ta, tb, accumulate ? 0.5f : 0.0f);
    }
  }
}

TEST_CASE("gemm_bf16: batched products equal their products one by one, broadcast operands included", "[core][gemm]") {
  Generator g(8);
  const std::int64_t batch = 6, m = 16, n = 24, k = 32;
  for (auto [ta, tb] : {std::pair{false, false}, {false, true}, {true, false}, {true, true}}) {
    CAPTURE(ta, tb);
    const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
    const Bf16Operand a(batch * m * k, g), b(batch * k * n, g);
    // stride_b 0: every product reads one B (oneDNN answers that with its reference kernel only,
    // so the batch runs product by product, every time).
    for (const std::int64_t stride_b : {k * n, std::int64_t{0}}) {
      CAPTURE(stride_b);
      for (bool accumulate : {false, true}) {
        std::vector<float> c(static_cast<std::size_t>(batch * m * n), 0.25f), one_by_one = c;
        detail::gemm_bf16_batched(ta, tb, batch, m, n, k, a.b.data(), lda, m * k, b.b.data(), ldb, stride_b, c.data(), n,
                                  m * n, accumulate);
        for (std::int64_t i = 0; i < batch; ++i) {
          detail::gemm_bf16(ta, tb, m, n, k, a.b.data() + i * m * k, lda, b.b.data() + i * stride_b, ldb,
                            one_by_one.data() + i * m * n, n, accumulate);
          const std::vector<float> ci(c.begin() + i * m * n, c.begin() + (i + 1) * m * n);
          check_product(ci, n, a.f.data() + i * m * k, lda, b.f.data() + i * stride_b, ldb, m, n, k, ta, tb,
                        accumulate ? 0.25f : 0.0f);
        }
      }
    }
  }
}

TEST_CASE("gemm_bf16: the same product gives the same bits on every thread and every call", "[core][gemm]") {
  // Each thread keeps its own primitives: the same key made twice must choose the same kernel.
  Generator g(3);
  const std::int64_t m = 96, n = 80, k = 128;
  const Bf16Operand a(m * k, g), b(n * k, g);
  auto run = [&] {
    std::vector<float> c(static_cast<std::size_t>(m * n));
    detail::gemm_bf16(false, true, m, n, k, a.b.data(), k, b.b.data(), k, c.data(), n);
    return c;
  };
  const int threads = get_num_threads();
  set_num_threads(1);
  const std::vector<float> first = run();
  CHECK(run() == first);
  std::vector<float> on_thread[2];
  concurrently([&] { on_thread[0] = run(); }, [&] { on_thread[1] = run(); });  // inside a region: one thread each
  set_num_threads(threads);
  CHECK(on_thread[0] == first);
  CHECK(on_thread[1] == first);
#ifdef REMAT_WITH_ONEDNN
  // A product met again is served from this thread's cache, not made again.
  const std::size_t held = detail::MatmulCache::local().size();
  for (int i = 0; i < 3; ++i) run();
  const std::size_t after_first = detail::MatmulCache::local().size();
  for (int i = 0; i < 3; ++i) run();
  CHECK(detail::MatmulCache::local().size() == after_first);
  CHECK(after_first <= held + 1);
#endif
}

#ifdef REMAT_WITH_ONEDNN
TEST_CASE("gemm_bf16: the engine is named with oneDNN's kernel, and a oneDNN error names the shapes", "[core][gemm]") {
  const std::string backend = remat::gemm_bf16_backend();
  // The float32 primitive's kernel named ("unavailable" where oneDNN has only its gemm for it).
  CHECK(remat::gemm_backend().find("oneDNN (dnnl_sgemm; matmul primitive ") == 0);
  if (detail::bf16_engine() == detail::Bf16Engine::matmul_primitive) {
    CHECK(backend.find(detail::bf16_primitive_implementation()) != std::string::npos);
    CHECK(backend.find("bf16") != std::string::npos);
  }
  // A leading dimension shorter than a row: oneDNN refuses the descriptor.
  const detail::MatmulKey bad = detail::matmul_key(dnnl_bf16, false, false, 1, 8, 6, 5, 4, 0, 6, 0, 6, 0, false);
  try {
    detail::MatmulPrimitive refused(bad);
    FAIL("oneDNN accepted a leading dimension shorter than a row");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("matmul") != std::string::npos);
    CHECK(what.find("m=8, n=6, k=5") != std::string::npos);
    CHECK(what.find("invalid_arguments") != std::string::npos);
  }
}
#endif

TEST_CASE("gemm_bf16: an empty inner dimension writes zeros, or leaves C under accumulation", "[core][gemm]") {
  std::vector<float> c(6, 2.0f);
  detail::gemm_bf16(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, true);
  CHECK(c == std::vector<float>(6, 2.0f));
  detail::gemm_bf16(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, false);
  CHECK(c == std::vector<float>(6, 0.0f));
}
