// float32 GEMM throughput on this machine: C = A B with A, B, C 1024 x 1024 on the configured
// thread count, Eigen's GEMM and the build's float backend (oneDNN's sgemm when remat is built
// with it) alternating, median of 7 runs each. Prints one JSON line; gemm_gflops is the better.
#include <algorithm>
#include <chrono>
#include <vector>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  constexpr std::int64_t n = 1024;
  Generator g(0);
  const std::vector<float> a = randn({n, n}, g).to_vector(), b = randn({n, n}, g).to_vector();
  std::vector<float> c(static_cast<std::size_t>(n * n));
  std::vector<double> eigen, backend;
  auto gflops = [&](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 2.0 * n * n * n / s / 1e9;
  };
  for (int rep = 0; rep < 8; ++rep) {
    const double e = gflops([&] { detail::eigen_gemm(false, false, n, n, n, a.data(), n, b.data(), n, c.data(), n, false); });
    const double d = gflops([&] { detail::gemm(false, false, n, n, n, a.data(), n, b.data(), n, c.data(), n); });
    if (rep == 0) continue;  // warm-up
    eigen.push_back(e);
    backend.push_back(d);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double me = median(eigen), mb = median(backend);
  fmt::print("{{\"gemm_gflops\": {:.2f}, \"eigen_gflops\": {:.2f}, \"backend_gflops\": {:.2f}, \"backend\": \"{}\", "
             "\"threads\": {}}}\n", std::max(me, mb), me, mb, detail::gemm_backend(), get_num_threads());
}
