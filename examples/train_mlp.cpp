// A two-layer MLP learns a noisy sine on raw remat tensors: the smallest complete training loop.
//   x (N, 1) -> Linear(1, H) -> tanh -> Linear(H, 1) -> y (N, 1),  loss = mean squared error.
#include <cmath>
#include <vector>

#include <remat/remat.hpp>

int main() {
  using namespace remat;
  constexpr std::int64_t kN = 256, kHidden = 32;
  Generator gen(0);
  const Tensor x = reshape(arange(-3.0f, 3.0f, 6.0f / kN), {kN, 1});  // (N, 1)
  // The targets are data, not part of the graph: sin(x) plus noise, computed on plain vectors.
  const std::vector<float> xs = x.to_vector(), noise = randn(x.shape(), gen).to_vector();
  std::vector<float> ys(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) ys[i] = std::sin(xs[i]) + 0.05f * noise[i];
  const Tensor y = tensor(ys, x.shape());  // (N, 1)

  Tensor w1 = (randn({1, kHidden}, gen) * 1.0f).detach().requires_grad_();           // (1, H)
  Tensor b1 = zeros({kHidden}).requires_grad_();                                      // (H,)
  Tensor w2 = (randn({kHidden, 1}, gen) / std::sqrt(float(kHidden))).detach().requires_grad_();  // (H, 1)
  Tensor b2 = zeros({1}).requires_grad_();                                            // (1,)
  // Plain SGD, p -= lr · p.grad(); the step is below 2 / (curvature ~ 2 Σ h²) so it does not diverge.
  optim::SGDOptions sgd_options;
  sgd_options.lr = 0.02;
  optim::SGD sgd({&w1, &b1, &w2, &b2}, sgd_options);

  float first = 0, last = 0;
  for (int step = 0; step <= 2000; ++step) {
    const Tensor h = tanh(matmul(x, w1) + b1);  // (N, H)
    Tensor loss = mean(pow(matmul(h, w2) + b2 - y, 2));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    if (step == 0) first = loss.item();
    last = loss.item();
    if (step % 500 == 0) fmt::print("step {:4d}  loss {:.5f}\n", step, loss.item());
  }
  fmt::print("loss fell from {:.4f} to {:.4f}\n", first, last);
  return last < 0.25f * first ? 0 : 1;
}
