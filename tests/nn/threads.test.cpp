// The kernels that split their work across threads (element-wise ops, dropout, layer norm,
// cross-entropy rows, column sums, narrow's copies and a split's gradient, optimizer steps) give
// the same bits under every team OpenMP may give them: other thread counts, a dynamic team, inside
// a user's own parallel region, and from two user threads at once. CTest also runs this file's
// cases under OMP_THREAD_LIMIT=1, OMP_DYNAMIC=true and OMP_NUM_THREADS=3. (A single GEMM is left
// out: Eigen's bits follow the team size, see README, Threads; two small products run at once, one
// per thread, give the one-thread bits.)
#include <atomic>
#include <optional>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "support.hpp"

using namespace remat;

namespace {

/// Values and gradients of each splitting kernel on inputs large enough to be split.
std::vector<std::vector<float>> kernel_results() {
  std::vector<std::vector<float>> out;
  Generator gen(31);
  const Tensor x = randn({64, 1100}, gen);  // 70,400 elements: several pieces of kElementGrain
  out.push_back(exp(x).to_vector());
  out.push_back(gelu(x, GeluApproximation::tanh).to_vector());
  Generator drop(7);
  out.push_back(dropout(x, 0.3, true, drop).to_vector());
  Tensor w = ones({1100}).requires_grad_(), b = zeros({1100}).requires_grad_();
  Tensor xin = x.detach().requires_grad_();
  Tensor y = layer_norm(xin, w, b);
  sum(y * y).backward();
  for (const Tensor& t : {y, xin.grad(), w.grad(), b.grad()}) out.push_back(t.to_vector());
  Tensor logits = randn({300, 257}, gen).requires_grad_();
  const LongTensor targets = randint(0, 257, {300}, gen);
  Tensor loss = cross_entropy(logits, targets);
  loss.backward();
  out.push_back(loss.to_vector());
  out.push_back(logits.grad().to_vector());
  Tensor h = randn({4096, 24}, gen), bias = zeros({24}).requires_grad_();  // the bias gradient: a column sum
  sum((h + bias) * (h + bias)).backward();
  out.push_back(bias.grad().to_vector());
  // narrow's copies by rows, and a split's gradients added into the input's in place.
  Tensor packed = randn({64, 3 * 1100}, gen).requires_grad_();
  const std::vector<Tensor> qkv = split(packed * 1.0, 1100, -1);
  sum(qkv[0] * qkv[1] + qkv[2] * 3.0).backward();
  out.push_back(qkv[1].to_vector());
  out.push_back(packed.grad().to_vector());
  // Optimizer steps on a parameter large enough to split: SGD in each form, AdamW.
  for (int kind = 0; kind < 4; ++kind) {
    Tensor w = (x * 1.0).detach().requires_grad_();
    const std::vector<Tensor*> params{&w};
    std::unique_ptr<optim::Optimizer> opt;
    if (kind == 0) opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{0.1});
    if (kind == 1) opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{0.1, 0.9});
    if (kind == 2) opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{0.1, 0.9, 0.01, true});
    if (kind == 3) opt = std::make_unique<optim::AdamW>(params);
    for (int step = 0; step < 2; ++step) {
      sum(w * w * x).backward();
      opt->step();
      opt->zero_grad();
    }
    out.push_back(w.to_vector());
  }
  return out;
}

}  // namespace

TEST_CASE("threads: splitting kernels give the same bits on any team OpenMP gives them", "[threads]") {
  const int threads = get_num_threads();
  const auto expected = kernel_results();
  for (const int t : {1, 2, 3}) {
    INFO(t << " threads");
    set_num_threads(t);
    CHECK(kernel_results() == expected);
  }
  set_num_threads(threads);
#ifdef _OPENMP
  omp_set_dynamic(1);
  CHECK(kernel_results() == expected);
  omp_set_dynamic(0);
  std::vector<std::vector<float>> nested;
  REMAT_PRAGMA_OMP(omp parallel num_threads(2))
  {
    REMAT_PRAGMA_OMP(omp single)
    nested = kernel_results();
  }
  CHECK(nested == expected);
#endif
  std::vector<std::vector<float>> a, b;
  std::thread ta([&] { a = kernel_results(); }), tb([&] { b = kernel_results(); });
  ta.join();
  tb.join();
  CHECK(a == expected);
  CHECK(b == expected);
}

namespace {

/// The gradients of a small linear layer (bias too) and of a 2-D matmul whose operands both need
/// one: their two products run at once, one per thread, when the kernels have two threads.
template <class T>
std::vector<std::vector<T>> product_gradients(bool bf16) {
  std::vector<std::vector<T>> out;
  Generator gen(5);
  BasicTensor<T> x = randn<T>({48, 40}, gen).requires_grad_();
  BasicTensor<T> w = randn<T>({24, 40}, gen).requires_grad_();
  BasicTensor<T> b = randn<T>({24}, gen).requires_grad_();
  BasicTensor<T> m = randn<T>({24, 16}, gen).requires_grad_();
  {
    std::optional<autocast> guard;
    if (bf16) guard.emplace();
    BasicTensor<T> y = matmul(tanh(linear(x, w, b)), m);
    sum(y * y).backward();
  }
  for (const BasicTensor<T>* t : {&x, &w, &b, &m}) out.push_back(t->grad().to_vector());
  return out;
}

}  // namespace

TEST_CASE("threads: a layer's input and weight gradients computed at once give the one-thread bits", "[threads]") {
  const int threads = get_num_threads();
  set_num_threads(1);
  const auto f32 = product_gradients<float>(false), bf16 = product_gradients<float>(true);
  const auto f64 = product_gradients<double>(false);
  for (const int t : {2, 3}) {
    INFO(t << " threads");
    set_num_threads(t);
    CHECK(product_gradients<float>(false) == f32);
    CHECK(product_gradients<double>(false) == f64);
    CHECK(product_gradients<float>(true) == bf16);
  }
  set_num_threads(threads);
}

TEST_CASE("threads: concurrently runs both parts once and rethrows a failure on the calling thread", "[threads]") {
  const int threads = get_num_threads();
  for (const int t : {1, 2}) {
    INFO(t << " threads");
    set_num_threads(t);
    std::atomic<int> first{0}, second{0};
    concurrently([&] { ++first; }, [&] { ++second; });
    CHECK(first == 1);
    CHECK(second == 1);
    bool other_ran = false;
    REQUIRE_ERROR(concurrently([] { REMAT_CHECK(false, "first part failed"); }, [&] { other_ran = true; }),
                  "first part failed");
    CHECK(other_ran);
  }
  set_num_threads(threads);
}
