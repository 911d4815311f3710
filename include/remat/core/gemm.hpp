#pragma once
// The one matrix product the ops call: C = op(A) · op(B), or C += op(A) · op(B), row-major, where
// op transposes or not. float goes to oneDNN when remat is built with it (CMake defines
// REMAT_WITH_ONEDNN when it finds libdnnl-dev; -DREMAT_ONEDNN=OFF keeps Eigen), which reaches more
// of the machine's peak than Eigen's GEMM on AVX2/AVX-512: dnnl_sgemm, or the matmul primitive for
// the shape class where it measured faster (float_uses_primitive). double (gradient checks) and
// builds without oneDNN use Eigen's GEMM. Each is deterministic for a given thread count and shape.
//
// gemm_bf16 is the mixed-precision product: bfloat16 operands, float32 accumulation and result.
// Its engine is decided once per process (bf16_engine): where the CPU has AMX, oneDNN's matmul
// primitive (core/onednn_matmul.hpp; made once per shape and cached), whose brgemm kernels run
// bfloat16 tiles on the matrix engine; elsewhere on AVX-512, dnnl_gemm_bf16bf16f32 (exported by
// libdnnl 2.x, undeclared in its headers, so remat declares it: AVX512-BF16 where the CPU has it,
// emulated on plain AVX-512), as fast as the primitive there; below AVX-512 and without oneDNN,
// the operands widened to float (exactly: bf16 is float's upper half) on the float GEMM. A shape
// the primitive refuses (strided operands, say) takes dnnl_gemm_bf16bf16f32 every time in that
// process (the cache remembers the refusal), so a product's bits never depend on which call came
// first.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "remat/core/error.hpp"
#include "remat/core/onednn_matmul.hpp"
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

#ifdef REMAT_WITH_ONEDNN
/// Whether a float product of this shape runs on the matmul primitive rather than dnnl_sgemm: where
/// the inner dimension is longer than the output's rows (k > n), measured faster there on this
/// project's AVX512-BF16 machine (bench_gemm_bf16, 2 threads: 1024×256×1024 at 338 against 291
/// GFLOP/s, 128×64×128 at 206 against 157; 1024×256×768 4% slower), and no faster for k <= n.
inline bool float_uses_primitive(std::int64_t n, std::int64_t k) { return k > n; }

/// Runs `key`'s product on the cached primitive and says so, or says it has none (then the caller
/// takes its fallback, as it will for that key every time).
inline bool run_matmul_primitive(const MatmulKey& key, const void* a, const void* b, float* c) {
  const MatmulPrimitive& primitive = MatmulCache::local().get(key);
  if (!primitive.usable()) return false;
  primitive.run(a, b, c, key);
  return true;
}
#endif

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
    if (float_uses_primitive(n, k) &&
        run_matmul_primitive(matmul_key(dnnl_f32, trans_a, trans_b, 1, m, n, k, lda, 0, ldb, 0, ldc, 0, accumulate), a,
                             b, c))
      return;
    const OnednnTeam team;
    const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb,
                                            accumulate ? 1.0f : 0.0f, c, ldc);
    REMAT_CHECK(status == dnnl_success, "gemm: oneDNN's sgemm failed ({}) for m={}, n={}, k={}",
                dnnl_status_name(status), m, n, k);
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

/// How this process multiplies bfloat16 operands (the header says when each is chosen).
enum class Bf16Engine { matmul_primitive, onednn_gemm, widened };

#ifdef REMAT_WITH_ONEDNN
/// The matmul primitive's kernel for a representative product (1024×768×256, the example GPT's
/// qkv projection), as oneDNN names it: "brg:avx512_core_amx" where the CPU has AMX,
/// "brg:avx512_core_bf16" on AVX512-BF16; empty when oneDNN has no primitive for it.
inline const std::string& bf16_primitive_implementation() {
  static const std::string impl = [] {
    const MatmulPrimitive probe(matmul_key(dnnl_bf16, false, true, 1, 1024, 768, 256, 256, 0, 256, 0, 768, 0, false));
    return probe.usable() ? probe.implementation() : std::string();
  }();
  return impl;
}
#endif

/// The engine REMAT_BF16_ENGINE names ("primitive", "gemm", "widened"), for tests and for
/// measuring one engine against another; unset or empty leaves the choice to bf16_engine.
inline std::optional<Bf16Engine> bf16_engine_from_environment() {
  const char* name = std::getenv("REMAT_BF16_ENGINE");
  if (name == nullptr || *name == '\0') return std::nullopt;
  const std::string n = name;
  if (n == "primitive") return Bf16Engine::matmul_primitive;
  if (n == "gemm") return Bf16Engine::onednn_gemm;
  if (n == "widened") return Bf16Engine::widened;
  throw Error(fmt::format("REMAT_BF16_ENGINE: expected primitive, gemm or widened, got '{}'", n));
}

/// The engine of this process's bfloat16 products, decided once (a probe), so every product of a
/// run takes the same path and its bits do not depend on which call came first: the matmul
/// primitive where its kernel uses AMX; dnnl_gemm_bf16bf16f32 elsewhere on AVX-512 (on
/// AVX512-BF16 without AMX it ran the GPT's linear-layer products 1.00-1.19× the primitive's
/// brgemm, 624-728 against 547-671 GFLOP/s on 2 threads, bench_gemm_bf16); the widened operands
/// below AVX-512 or without oneDNN. REMAT_BF16_ENGINE forces one; an engine this CPU or build
/// lacks is refused with an Error rather than taken silently.
inline Bf16Engine bf16_engine() {
  static const Bf16Engine engine = [] {
    const std::optional<Bf16Engine> forced = bf16_engine_from_environment();
#ifdef REMAT_WITH_ONEDNN
    const std::string& impl = bf16_primitive_implementation();
    const bool native = impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos;
    const std::uint16_t one = 0x3f80;  // 1.0 in bfloat16
    float c = 0.0f;
    const OnednnTeam team;
    const bool gemm = dnnl_gemm_bf16bf16f32('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &c, 1) == dnnl_success &&
                      c == 1.0f;
    if (forced) {
      REMAT_CHECK(*forced != Bf16Engine::matmul_primitive || native,
                  "REMAT_BF16_ENGINE=primitive: oneDNN has no native bfloat16 matmul on this CPU (its kernel: '{}')",
                  impl);
      REMAT_CHECK(*forced != Bf16Engine::onednn_gemm || gemm,
                  "REMAT_BF16_ENGINE=gemm: oneDNN's gemm_bf16bf16f32 is not available on this CPU");
      return *forced;
    }
    if (impl.find("amx") != std::string::npos) return Bf16Engine::matmul_primitive;
    if (gemm) return Bf16Engine::onednn_gemm;
#else
    if (forced)
      REMAT_CHECK(*forced == Bf16Engine::widened, "REMAT_BF16_ENGINE: this build has no oneDNN, only 'widened'");
#endif
    return Bf16Engine::widened;
  }();
  return engine;
}

/// The backend bfloat16 products use in this process, with the kernel oneDNN's matmul primitive
/// chose on this CPU: e.g. "oneDNN matmul primitive (brg:avx512_core_amx)".
inline std::string gemm_bf16_backend() {
#ifdef REMAT_WITH_ONEDNN
  const std::string isa = bf16_primitive_implementation().empty() ? "none" : bf16_primitive_implementation();
  switch (bf16_engine()) {
    case Bf16Engine::matmul_primitive: return "oneDNN matmul primitive (" + isa + ")";
    case Bf16Engine::onednn_gemm: return "oneDNN gemm_bf16bf16f32 (the matmul primitive's kernel here: " + isa + ")";
    case Bf16Engine::widened: return "oneDNN sgemm on widened operands";
  }
#endif
  return "Eigen on widened operands";
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

#ifdef REMAT_WITH_ONEDNN
/// dnnl_gemm_bf16bf16f32: the engine below the primitive, and the primitive's fallback.
inline void onednn_gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                             const Eigen::bfloat16* a, std::int64_t lda, const Eigen::bfloat16* b, std::int64_t ldb,
                             float* c, std::int64_t ldc, bool accumulate) {
  const OnednnTeam team;
  const dnnl_status_t status = dnnl_gemm_bf16bf16f32(
      trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.0f, reinterpret_cast<const std::uint16_t*>(a), lda,
      reinterpret_cast<const std::uint16_t*>(b), ldb, accumulate ? 1.0f : 0.0f, c, ldc);
  REMAT_CHECK(status == dnnl_success, "gemm_bf16: oneDNN's gemm_bf16bf16f32 failed ({}) for m={}, n={}, k={}",
              dnnl_status_name(status), m, n, k);
}
#endif

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
  switch (bf16_engine()) {
    case Bf16Engine::matmul_primitive:
      if (run_matmul_primitive(matmul_key(dnnl_bf16, trans_a, trans_b, 1, m, n, k, lda, 0, ldb, 0, ldc, 0, accumulate),
                               a, b, c))
        return;
      [[fallthrough]];
    case Bf16Engine::onednn_gemm: return onednn_gemm_bf16(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    case Bf16Engine::widened: break;
  }
#endif
  gemm_bf16_widened(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

/// Products of at most this many multiply-adds (M·N·K) each run faster as one batched primitive
/// than one primitive per product spread over the threads: 128 heads of 64×64×32 at 334 against 296
/// GFLOP/s on 2 threads (315 against 221 on one), while 32 of 128×128×64 ran slower batched (483
/// against 563) on this project's AVX512-BF16 machine (operands reused, not rotated).
inline constexpr std::int64_t kBatchedGemm = std::int64_t{1} << 18;

/// Whether gemm_bf16_batched runs a batch of m·n·k products as one primitive (small products on
/// the matmul primitive); otherwise callers spread the products over threads themselves.
inline bool bf16_batches_at_once(std::int64_t m, std::int64_t n, std::int64_t k) {
  return bf16_engine() == Bf16Engine::matmul_primitive && m * n * k <= kBatchedGemm;
}

/// `batch` products C_i = or += op(A_i) · op(B_i), the i-th operands stride_a, stride_b and
/// stride_c elements after the (i-1)-th: one batched primitive, or one gemm_bf16 per product where
/// oneDNN refuses that primitive (every time, for that key).
inline void gemm_bf16_batched(bool trans_a, bool trans_b, std::int64_t batch, std::int64_t m, std::int64_t n,
                              std::int64_t k, const Eigen::bfloat16* a, std::int64_t lda, std::int64_t stride_a,
                              const Eigen::bfloat16* b, std::int64_t ldb, std::int64_t stride_b, float* c,
                              std::int64_t ldc, std::int64_t stride_c, bool accumulate = false) {
#ifdef REMAT_WITH_ONEDNN
  if (batch > 1 && m > 0 && n > 0 && k > 0 && bf16_engine() == Bf16Engine::matmul_primitive &&
      run_matmul_primitive(matmul_key(dnnl_bf16, trans_a, trans_b, batch, m, n, k, lda, stride_a, ldb, stride_b, ldc,
                                      stride_c, accumulate),
                           a, b, c))
    return;
#endif
  for (std::int64_t i = 0; i < batch; ++i)
    gemm_bf16(trans_a, trans_b, m, n, k, a + i * stride_a, lda, b + i * stride_b, ldb, c + i * stride_c, ldc, accumulate);
}

}  // namespace remat::detail

namespace remat {

/// The float32 products' backend of this build, with the kernel oneDNN's matmul primitive chose on
/// this CPU where remat uses it: e.g. "oneDNN (dnnl_sgemm; matmul primitive brg:avx512_core
/// where k > n)", or "Eigen".
inline std::string gemm_backend() {
#ifdef REMAT_WITH_ONEDNN
  static const std::string description = [] {
    const detail::MatmulPrimitive probe(
        detail::matmul_key(dnnl_f32, false, true, 1, 1024, 256, 1024, 1024, 0, 1024, 0, 256, 0, false));
    return std::string("oneDNN (dnnl_sgemm; matmul primitive ") +
           (probe.usable() ? probe.implementation() : std::string("unavailable")) + " where k > n)";
  }();
  return description;
#else
  return "Eigen";
#endif
}

/// The engine of this process's bfloat16 products (autocast's), with the kernel oneDNN's matmul
/// primitive chose on this CPU: e.g. "oneDNN matmul primitive (brg:avx512_core_amx)" on a CPU
/// with AMX, "oneDNN gemm_bf16bf16f32 (...)" on one with AVX512-BF16 only.
inline std::string gemm_bf16_backend() { return detail::gemm_bf16_backend(); }

}  // namespace remat
