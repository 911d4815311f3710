// The mixed-precision product (core/gemm.hpp, gemm_bf16): bfloat16 operands, float32 sums. On
// operands that are exact in bfloat16 it must agree with the float GEMM to float rounding (only the
// order of the sums may differ), for every transpose, strided operands and accumulation.

#include <cmath>
#include <tuple>

#include "support.hpp"

using namespace remat;

TEST_CASE("gemm_bf16: float32 sums of bfloat16 operands, every transpose, strides and accumulation", "[core][gemm]") {
  INFO("bfloat16 GEMM backend: " << detail::gemm_bf16_backend());
  // Both paths on every machine: the one this process uses and the widened one it falls back to.
  const bool widened = GENERATE(false, true);
  CAPTURE(widened);
  Generator g(5);
  for (auto [m, n, k, ta, tb] : {std::tuple{7, 5, 3, false, false}, {64, 48, 33, true, false}, {17, 31, 64, false, true},
                                 {128, 96, 80, true, true}, {1, 1, 1, false, false}}) {
    CAPTURE(m, n, k, ta, tb);
    const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
    const std::int64_t lda = a_cols + 3, ldb = b_cols + 1, ldc = n + 2;  // strided: rows longer than used
    const std::vector<float> ra = randn({a_rows * lda}, g).to_vector(), rb = randn({b_rows * ldb}, g).to_vector();
    std::vector<Eigen::bfloat16> a(ra.size()), b(rb.size());
    std::vector<float> fa(ra.size()), fb(rb.size());
    for (std::size_t i = 0; i < ra.size(); ++i) fa[i] = static_cast<float>(a[i] = Eigen::bfloat16(ra[i]));
    for (std::size_t i = 0; i < rb.size(); ++i) fb[i] = static_cast<float>(b[i] = Eigen::bfloat16(rb[i]));
    for (bool accumulate : {false, true}) {
      std::vector<float> c(static_cast<std::size_t>(m * ldc), 0.5f), ref = c;
      (widened ? detail::gemm_bf16_widened : detail::gemm_bf16)(ta, tb, m, n, k, a.data(), lda, b.data(), ldb,
                                                                c.data(), ldc, accumulate);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double sum = accumulate ? 0.5 : 0.0, magnitude = accumulate ? 0.5 : 0.0;
          for (std::int64_t p = 0; p < k; ++p) {
            const double x = fa[static_cast<std::size_t>(ta ? p * lda + i : i * lda + p)];
            const double y = fb[static_cast<std::size_t>(tb ? j * ldb + p : p * ldb + j)];
            sum += x * y;
            magnitude += std::abs(x * y);
          }
          // float32 accumulation of k products: within k ulps of the magnitude summed.
          REQUIRE(std::abs(c[static_cast<std::size_t>(i * ldc + j)] - sum) <= 1e-7 * static_cast<double>(k + 1) * magnitude + 1e-30);
        }
      // The padding past each row is never written.
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = n; j < ldc; ++j) REQUIRE(c[static_cast<std::size_t>(i * ldc + j)] == 0.5f);
    }
  }
}

TEST_CASE("gemm_bf16: an empty inner dimension writes zeros, or leaves C under accumulation", "[core][gemm]") {
  std::vector<float> c(6, 2.0f);
  detail::gemm_bf16(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, true);
  CHECK(c == std::vector<float>(6, 2.0f));
  detail::gemm_bf16(false, false, 2, 3, 0, nullptr, 1, nullptr, 3, c.data(), 3, false);
  CHECK(c == std::vector<float>(6, 0.0f));
}
