#pragma once
// float32 <-> bfloat16 element conversion, what to<bfloat16>(t) and to<float>(t) run.
//
// Narrowing rounds to nearest, ties to even, on the bit pattern (PyTorch's rule): infinities stay
// infinities, finite values past the largest bfloat16 by half a unit or more become infinities,
// subnormals round like any other value (no flush to zero), and a NaN stays a NaN of the same sign,
// quiet, with the upper bits of its payload. bfloat16_bits() is that rule; the vectorised kernel
// must give its bits for every input, so a result never depends on the build's instruction set,
// on the thread count, or on where in a tensor an element sits. Widening is exact.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"

namespace remat::detail {

/// The bits of the bfloat16 nearest to x, ties to even (NaN: quiet, sign and upper payload kept).
inline std::uint16_t bfloat16_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  // A NaN whose payload lies only in the low 16 bits would truncate to an infinity: setting the
  // quiet bit keeps it a NaN, as the hardware instruction does.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Adding just under half a unit of the 16 dropped bits, plus the kept lsb, carries exactly when
  // they are above half or at half with an odd lsb. A carry out of the fraction is the next
  // exponent, and from the largest finite value it is the infinity: RNE's overflow. No wrap: the
  // largest non-NaN pattern (-inf) plus 0x8000 fits in 32 bits.
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// The bfloat16 nearest to x (bfloat16_bits as a value).
inline bfloat16 to_bfloat16(float x) { return Eigen::numext::bit_cast<bfloat16>(bfloat16_bits(x)); }

/// A bfloat16's float32 value: its bits are the float's upper half, so every value (NaN payloads
/// included) widens exactly.
inline float to_float(bfloat16 h) {
  const std::uint32_t u = std::uint32_t{Eigen::numext::bit_cast<std::uint16_t>(h)} << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// dst[i] = to_bfloat16(src[i]) on any instruction set. `omp simd` because GCC 12's -O2 cost
/// model leaves the loop scalar (1.8 rather than 3.6 Gelem/s on x86-64's SSE2); -O3 vectorises it
/// either way.
inline void narrow_to_bfloat16_portable(const float* src, bfloat16* dst, std::int64_t n) {
  REMAT_PRAGMA_OMP(omp simd)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_bfloat16(src[i]);
}

#if defined(__AVX512BF16__)
/// narrow_to_bfloat16_portable's bits, 32 elements per two VCVTNEPS2BF16. That instruction rounds
/// to nearest even whatever MXCSR says and quiets NaNs as bfloat16_bits does, but treats
/// subnormal inputs as zero (DAZ regardless of MXCSR), where the rule gives a bfloat16 subnormal
/// or the smallest normal: a block of 32 holding one is redone by the portable kernel. Two vectors
/// a step because with one the loop ran at 24-28 Gelem/s in L2 on Zen 4, with two at 30-32; on
/// data without subnormals the check costs four mask tests and a branch not taken per block.
inline void narrow_to_bfloat16_avx512(const float* src, bfloat16* dst, std::int64_t n) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), fraction = _mm512_set1_epi32(0x007fffff);
  const auto subnormal = [&](__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    return _mm512_testn_epi32_mask(u, exponent) & _mm512_test_epi32_mask(u, fraction);
  };
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    if (subnormal(lo) | subnormal(hi)) narrow_to_bfloat16_portable(src + i, dst + i, 32);
  }
  narrow_to_bfloat16_portable(src + i, dst + i, n - i);
}
#endif

/// The narrowing kernel to<bfloat16> runs: the AVX512-BF16 one when the build targets it.
inline void narrow_to_bfloat16(const float* src, bfloat16* dst, std::int64_t n) {
#if defined(__AVX512BF16__)
  narrow_to_bfloat16_avx512(src, dst, n);
#else
  narrow_to_bfloat16_portable(src, dst, n);
#endif
}

/// Which narrowing kernel this build runs ("avx512bf16" or "portable"), for benchmarks and tests.
constexpr const char* bfloat16_kernel() {
#if defined(__AVX512BF16__)
  return "avx512bf16";
#else
  return "portable";
#endif
}

/// dst[i] = to_float(src[i]): a shift on every instruction set (`omp simd` as for narrowing).
inline void widen_from_bfloat16(const bfloat16* src, float* dst, std::int64_t n) {
  REMAT_PRAGMA_OMP(omp simd)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

/// x[i] = to_float(to_bfloat16(x[i])) in place: float32 values rounded to bfloat16's.
inline void round_to_bfloat16(const float* src, float* dst, std::int64_t n) {
  REMAT_PRAGMA_OMP(omp simd)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(to_bfloat16(src[i]));
}

/// kernel(src + b, dst + b, e - b) over pieces of [0, n) on the kernels' threads. Pieces start at
/// multiples of 64 elements so that every thread count gives the vector kernels whole blocks; the
/// bits would not differ otherwise (each element's result is its own), only the speed.
template <class From, class To, class Kernel>
void convert_elements(const From* src, To* dst, std::int64_t n, Kernel kernel) {
  constexpr std::int64_t block = 64;
  parallel_for((n + block - 1) / block, kElementGrain / block, [&](std::int64_t b, std::int64_t e) {
    const std::int64_t begin = b * block, end = std::min(n, e * block);
    kernel(src + begin, dst + begin, end - begin);
  });
}

}  // namespace remat::detail
