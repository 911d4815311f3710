#pragma once
// The thread count of the compute kernels. Eigen's and oneDNN's GEMMs run on OpenMP threads when
// remat is built with OpenMP (the CMake target links it); OMP_NUM_THREADS sets the default, this
// overrides it for both.

#include <algorithm>
#include <cstdint>

#include <Eigen/Core>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "remat/core/error.hpp"

/// An OpenMP pragma when remat is built with OpenMP, nothing otherwise (no unknown-pragma warnings).
#ifdef _OPENMP
#define REMAT_PRAGMA_OMP(x) _Pragma(#x)
#else
#define REMAT_PRAGMA_OMP(x)
#endif

namespace remat {

/// Sets the number of threads the kernels use (Eigen's and OpenMP's); `n` must be at least 1.
inline void set_num_threads(int n) {
  REMAT_CHECK(n >= 1, "set_num_threads: needs at least 1 thread, got {}", n);
  Eigen::setNbThreads(n);
#ifdef _OPENMP
  omp_set_num_threads(n);  // oneDNN's GEMM sizes its team from the calling thread's OpenMP count
#endif
}

/// The number of threads the kernels use (Eigen's count).
inline int get_num_threads() { return Eigen::nbThreads(); }

/// Calls f(begin, end) on pieces of [0, n), one per thread, when n is worth splitting (at least two
/// grains); serially otherwise. Only for work whose pieces are independent (element-wise ops,
/// per-row ops), so results are the same bits on any thread count.
template <class F>
void parallel_for(std::int64_t n, [[maybe_unused]] std::int64_t grain, F f) {
#ifdef _OPENMP
  const int threads = static_cast<int>(std::min<std::int64_t>(Eigen::nbThreads(), n / std::max<std::int64_t>(grain, 1)));
  if (threads > 1 && !omp_in_parallel()) {
    // num_threads is an upper bound: OMP_DYNAMIC, OMP_THREAD_LIMIT or a busy runtime may give the
    // region fewer threads, so the range is split by the team it got, never the one it asked for.
    REMAT_PRAGMA_OMP(omp parallel num_threads(threads))
    {
      const std::int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
      f(n * t / team, n * (t + 1) / team);
    }
    return;
  }
#endif
  f(std::int64_t{0}, n);
}

/// Elements per piece below which splitting costs more than it saves.
inline constexpr std::int64_t kElementGrain = 1 << 15;

}  // namespace remat
