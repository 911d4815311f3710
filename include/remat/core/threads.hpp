#pragma once
// The thread count of the compute kernels. Eigen's and oneDNN's GEMMs run on OpenMP threads when
// remat is built with OpenMP (the CMake target links it); OMP_NUM_THREADS sets the default, this
// overrides it for both.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <initializer_list>

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

/// parallel_for over elements of float arrays that Eigen expressions read and write: pieces
/// begin at multiples of 16 elements (64 bytes), so where the arrays begin on 64-byte lines (every
/// storage of 256 bytes or more does) each piece's packets and scalar tail are the whole range's,
/// and the bits are the serial loop's whatever the team. Arrays not on such lines run serially.
template <class F>
void parallel_for_lines(std::int64_t n, std::int64_t grain, std::initializer_list<const void*> arrays, F f) {
  constexpr std::int64_t kLine = 16;
  bool on_lines = true;
  for (const void* a : arrays) on_lines = on_lines && reinterpret_cast<std::uintptr_t>(a) % 64 == 0;
  if (!on_lines) return f(std::int64_t{0}, n);
  const std::int64_t lines = (n + kLine - 1) / kLine;
  parallel_for(lines, std::max<std::int64_t>(1, grain / kLine),
               [&](std::int64_t l0, std::int64_t l1) { f(l0 * kLine, std::min(l1 * kLine, n)); });
}

/// Runs first() and second() at the same time, one on each of two threads, when the kernels have
/// two threads and the caller is not inside a parallel region already; one after the other
/// otherwise. For two independent products each too small to split well across threads (a small
/// linear layer's input and weight gradients: 5-8% faster together than one after the other, each
/// on both threads, for 2^22-2^24 multiply-adds on this machine): each then runs on one thread as
/// under set_num_threads(1), so its bits are the one-thread bits. The callables compute on buffers
/// they were handed and touch nothing per-thread (no tensor access, no allocation in the books: one
/// of them runs on an OpenMP worker). Both run even if one throws; the first failure is rethrown on
/// the calling thread.
template <class F, class G>
void concurrently(F first, G second) {
  std::exception_ptr failed[2];
  auto run = [&](int which) {
    try {
      if (which == 0) first();
      else second();
    } catch (...) {
      failed[which] = std::current_exception();
    }
  };
  bool together = false;
#ifdef _OPENMP
  if (Eigen::nbThreads() >= 2 && !omp_in_parallel()) {
    together = true;
    REMAT_PRAGMA_OMP(omp parallel num_threads(2))
    {
      if (omp_get_num_threads() < 2) {  // a dynamic or limited team: one thread does both, in order
        run(0);
        run(1);
      } else {
        run(omp_get_thread_num());
      }
    }
  }
#endif
  if (!together) {
    run(0);
    run(1);
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

/// Elements per piece below which splitting costs more than it saves, per kernel family, from
/// bench_parallel_overhead on this 2-core machine (a fork and join costs 0.7-1 µs while the team
/// spins): split over two threads, a memory-bound axpy pays from 2 x 8192 elements (1.6 vs 1.8 µs),
/// Eigen's tanh and layer norm's rows of 128 from 2 x 8192 (3.1 vs 4.4 µs, 3.6 vs 5.2 µs), below
/// that each loses; the dropout mask, whose Philox draw costs 2.4 ns an element, already pays at
/// 2 x 512 (2.0 vs 2.5 µs).
inline constexpr std::int64_t kElementGrain = 1 << 13;
/// Elements per piece of a dropout mask (see kElementGrain).
inline constexpr std::int64_t kDropoutGrain = 1 << 10;

}  // namespace remat
