// float32 GEMM throughput of Eigen on this machine: C = A B with A, B, C 1024 x 1024, median of
// 7 runs on the configured thread count. Prints one JSON line.
#include <algorithm>
#include <chrono>
#include <vector>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  constexpr std::int64_t n = 1024;
  Generator g(0);
  const Tensor a = randn({n, n}, g), b = randn({n, n}, g);
  std::vector<double> gflops;
  for (int rep = 0; rep < 8; ++rep) {
    no_grad guard;
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor c = matmul(a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) gflops.push_back(2.0 * n * n * n / s / 1e9);
  }
  std::sort(gflops.begin(), gflops.end());
  fmt::print("{{\"gemm_gflops\": {:.2f}, \"threads\": {}}}\n", gflops[gflops.size() / 2], get_num_threads());
}
