#pragma once
// The thread count of the compute kernels. Eigen's GEMM runs on OpenMP threads when remat is built
// with OpenMP (the CMake target links it); OMP_NUM_THREADS sets the default, this overrides it.

#include <Eigen/Core>

#include "remat/core/error.hpp"

namespace remat {

inline void set_num_threads(int n) {
  REMAT_CHECK(n >= 1, "set_num_threads: needs at least 1 thread, got {}", n);
  Eigen::setNbThreads(n);
}

inline int get_num_threads() { return Eigen::nbThreads(); }

}  // namespace remat
