#pragma once
// The one matrix product the ops call: C = op(A) · op(B), or C += op(A) · op(B), row-major, where
// op transposes or not. float goes to oneDNN's dnnl_sgemm when remat is built with it (CMake
// defines REMAT_WITH_ONEDNN when it finds libdnnl-dev; -DREMAT_ONEDNN=OFF keeps Eigen), which
// reaches more of the machine's peak than Eigen's GEMM on AVX2/AVX-512; double (gradient checks)
// and builds without oneDNN use Eigen's GEMM. Either is deterministic for a given thread count.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <Eigen/Core>

#include "remat/core/error.hpp"

#ifdef REMAT_WITH_ONEDNN
#include <oneapi/dnnl/dnnl.h>
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

}  // namespace remat::detail
