// A user's program: fit y = 2x + 1 with one weight and one bias, through the installed headers.
// Built both by CMake (find_package, add_subdirectory) and by plain c++ with pkg-config's flags.
#include <cmath>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  const Tensor x = reshape(arange(-1.0f, 1.0f, 0.25f), {8, 1});  // (8, 1)
  const Tensor y = x * 2.0f + 1.0f;                              // (8, 1)
  Tensor w = zeros({1, 1}).requires_grad_();
  Tensor b = zeros({1}).requires_grad_();
  optim::SGDOptions options;
  options.lr = 0.1;
  optim::SGD sgd({&w, &b}, options);
  for (int step = 0; step < 200; ++step) {
    Tensor loss = mean(pow(matmul(x, w) + b - y, 2));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  }
  const bool ok = std::abs(w.item() - 2.0f) < 1e-3f && std::abs(b.item() - 1.0f) < 1e-3f;
  fmt::print("w = {}, b = {}: {}\n", w.item(), b.item(), ok ? "ok" : "did not converge");
  return ok ? 0 : 1;
}
