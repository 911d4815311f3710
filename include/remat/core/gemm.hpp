#pragma once
// The one matrix product the ops call: C = op(A) · op(B), or C += op(A) · op(B), row-major, where
// op transposes or not. float goes to oneDNN's dnnl_sgemm when remat is built with it (CMake
// defines REMAT_WITH_ONEDNN when it finds libdnnl-dev; -DREMAT_ONEDNN=OFF keeps Eigen), which
// reaches more of the machine's peak than Eigen's GEMM on AVX2/AVX-512; double (gradient checks)
// and builds without oneDNN use Eigen's GEMM. Either is deterministic for a given thread count.
//
// gemm_bf16 is the mixed-precision product: bfloat16 operands, float32 accumulation and result.
// With oneDNN it is dnnl_gemm_bf16bf16f32 (AVX512-BF16 where the CPU has it, about twice sgemm on
// this machine), which libdnnl exports but the 2.6 headers do not declare, so remat declares it.
// oneDNN 2.x has that kernel only on CPUs with AVX-512 (avx512_core, or ONEDNN_MAX_CPU_ISA at or
// above it) and answers dnnl_unimplemented elsewhere; there, and without oneDNN, the operands are
// widened to float (exactly: bf16 is float's upper half) and multiplied by the float GEMM. Which
// of the two a process uses is decided once (gemm_bf16_backend), so its products never mix them.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "remat/core/error.hpp"
#include "remat/core/threads.hpp"

#ifdef REMAT_WITH_ONEDNN
#include <oneapi/dnnl/dnnl.h>

// Row-major C = alpha op(A) op(B) + beta C over bfloat16 A and B (their bits, as uint16), float C:
// libdnnl 2.x exports it under this C signature without declaring it in its headers.
#if DNNL_VERSION_MAJOR < 3
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                               float alpha, const std::uint16_t* A, dnnl_dim_t lda,
                                               const std::uint16_t* B, dnnl_dim_t ldb, float beta, float* C,
                                               dnnl_dim_t ldc);
#endif
#endif

namespace remat::detail {

/// The GEMM backend float products use in this build.
inline const char* gemm_backend() {
#ifdef REMAT_WITH_ONEDNN
  return "oneDNN";
#else
  return "Eigen";
#endif
}

/// Eigen's GEMM on strided row-major operands (what every build uses for double).
template <class T>
void eigen_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const T* a,
                std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate) {
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using In = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
  using Out = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;
  // A is stored m×k (or k×m when transposed), B k×n (or n×k).
  const In A(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  const In B(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  Out C(c, m, n, Eigen::OuterStride<>(ldc));
  auto product = [&](const auto& opa, const auto& opb) {
    if (accumulate)
      C.noalias() += opa * opb;
    else
      C.noalias() = opa * opb;
  };
  if (trans_a && trans_b) product(A.transpose(), B.transpose());
  else if (trans_a) product(A.transpose(), B);
  else if (trans_b) product(A, B.transpose());
  else product(A, B);
}

/// C (m×n, leading dimension ldc) = or += op(A) (m×k) · op(B) (k×n); lda and ldb are the leading
/// dimensions of A and B as stored (before op).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const T* a, std::int64_t lda,
          const T* b, std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate = false) {
  if (m == 0 || n == 0) return;
#ifdef REMAT_WITH_ONEDNN
  if constexpr (std::is_same_v<T, float>) {
    if (k == 0) {
      if (!accumulate)
        for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
      return;
    }
    const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb,
                                            accumulate ? 1.0f : 0.0f, c, ldc);
    REMAT_CHECK(status == dnnl_success, "gemm: oneDNN's sgemm failed with status {} for m={}, n={}, k={}",
                static_cast<int>(status), m, n, k);
    return;
  }
#endif
  eigen_gemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

/// Products of at most this many multiply-adds (M·N·K) gain little from splitting one across the
/// threads: two independent ones run one per thread at once instead (gemm_pair).
inline constexpr std::int64_t kConcurrentGemm = std::int64_t{1} << 24;

/// Two independent products of `work` multiply-adds each (a layer's input and weight gradients):
/// at once, one per thread, when they are small (remat::concurrently; each then has the one-thread
/// bits), one after the other on every thread otherwise. first and second compute on buffers
/// they were handed, nothing else.
template <class F, class G>
void gemm_pair(std::int64_t work, F first, G second) {
  if (work <= kConcurrentGemm) {
    concurrently(std::move(first), std::move(second));
  } else {
    first();
    second();
  }
}

/// Whether this process's bfloat16 products run on oneDNN's bf16 kernel: asked once, by a 1×1×1
/// product (oneDNN answers dnnl_unimplemented where the CPU lacks AVX-512), so every product of a
/// run takes the same path and its bits do not depend on which call came first.
inline bool onednn_bf16_gemm_available() {
#ifdef REMAT_WITH_ONEDNN
  static const bool available = [] {
    const std::uint16_t one = 0x3f80;  // 1.0 in bfloat16
    float c = 0.0f;
    return dnnl_gemm_bf16bf16f32('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &c, 1) == dnnl_success && c == 1.0f;
  }();
  return available;
#else
  return false;
#endif
}

/// The backend bfloat16 products use in this process: oneDNN's bf16 kernel, or the float GEMM
/// (gemm_backend()) on operands widened to float.
inline const char* gemm_bf16_backend() {
  if (onednn_bf16_gemm_available()) return "oneDNN bf16";
#ifdef REMAT_WITH_ONEDNN
  return "oneDNN sgemm on widened operands";
#else
  return "Eigen on widened operands";
#endif
}

/// gemm_bf16 where oneDNN has no bf16 kernel: the operands widened to float, densely (op(A) is
/// rows × cols as stored, whatever the leading dimension), on the float GEMM.
inline void gemm_bf16_widened(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                              const Eigen::bfloat16* a, std::int64_t lda, const Eigen::bfloat16* b, std::int64_t ldb,
                              float* c, std::int64_t ldc, bool accumulate = false) {
  auto widen = [](const Eigen::bfloat16* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) out[static_cast<std::size_t>(i * cols + j)] = static_cast<float>(p[i * ld + j]);
    return out;
  };
  const std::int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const std::int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  const std::vector<float> wa = widen(a, a_rows, a_cols, lda), wb = widen(b, b_rows, b_cols, ldb);
  gemm(trans_a, trans_b, m, n, k, wa.data(), a_cols, wb.data(), b_cols, c, ldc, accumulate);
}

/// C (float, m×n) = or += op(A) · op(B) with A and B in bfloat16 (row-major, leading dimensions as
/// stored), the products summed in float32.
inline void gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                      const Eigen::bfloat16* a, std::int64_t lda, const Eigen::bfloat16* b, std::int64_t ldb, float* c,
                      std::int64_t ldc, bool accumulate = false) {
  static_assert(sizeof(Eigen::bfloat16) == sizeof(std::uint16_t), "bfloat16 is 16 bits");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
#ifdef REMAT_WITH_ONEDNN
  if (onednn_bf16_gemm_available()) {
    const dnnl_status_t status = dnnl_gemm_bf16bf16f32(
        trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, reinterpret_cast<const std::uint16_t*>(a), lda,
        reinterpret_cast<const std::uint16_t*>(b), ldb, accumulate ? 1.0f : 0.0f, c, ldc);
    REMAT_CHECK(status == dnnl_success,
                "gemm_bf16: oneDNN's gemm_bf16bf16f32 failed with status {} for m={}, n={}, k={}",
                static_cast<int>(status), m, n, k);
    return;
  }
#endif
  gemm_bf16_widened(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace remat::detail
