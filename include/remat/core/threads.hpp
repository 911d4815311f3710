#pragma once
// The thread count of the compute kernels. Eigen's GEMM runs on OpenMP threads when remat is built
// with OpenMP (the CMake target links it); OMP_NUM_THREADS sets the default, this overrides it.

#include <Eigen/Core>

#include "remat/core/error.hpp"

/// An OpenMP pragma when remat is built with OpenMP, nothing otherwise (no unknown-pragma warnings).
#ifdef _OPENMP
#define REMAT_PRAGMA_OMP(x) _Pragma(#x)
#else
#define REMAT_PRAGMA_OMP(x)
#endif

namespace remat {

inline void set_num_threads(int n) {
  REMAT_CHECK(n >= 1, "set_num_threads: needs at least 1 thread, got {}", n);
  Eigen::setNbThreads(n);
}

inline int get_num_threads() { return Eigen::nbThreads(); }

}  // namespace remat
