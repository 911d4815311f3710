#pragma once
// Helpers shared by the tests: gradient checks as Catch assertions, error-message matching, run
// comparisons as Catch assertions.

#include <cstdio>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <remat/remat.hpp>
#include <remat/testing/compare.hpp>
#include <remat/testing/gradcheck.hpp>

namespace remat::test {

using Inputs = const std::vector<DoubleTensor>&;

/// REQUIREs that f's tape gradients match central differences, printing the first mismatch.
template <class F>
void require_gradcheck(F f, std::vector<DoubleTensor> inputs, testing::GradcheckOptions opt = {}) {
  const testing::GradcheckResult r = testing::gradcheck(f, inputs, opt);
  INFO(r.message);
  INFO("max abs error " << r.max_abs_error);
  REQUIRE(r.ok);
}

/// Elementwise equality of two tensors' values within `tol` (0 means bitwise).
template <class T>
bool all_close(const BasicTensor<T>& a, const BasicTensor<T>& b, double tol = 0) {
  if (a.shape() != b.shape()) return false;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i]);
    if (!(d <= tol && -d <= tol)) return false;
  }
  return true;
}

/// A tape of the test's own, current while it lives: counts of nodes and saved bytes then do not
/// see nodes that earlier tests left on the thread's root tape (those are pruned lazily).
struct FreshTape {
  Tape tape;
  TapeGuard guard{tape};
};

/// A file in the test's working folder, removed when the test ends. CTest runs test cases as
/// parallel processes in one folder: give each case names of its own.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& name) : path("remat_test_" + name + ".safetensors") {}
  ~TempFile() { std::remove(path.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
};

/// A small GPT configuration for tests, every field given in one place.
inline nn::GPTConfig gpt_config(std::int64_t vocab, std::int64_t context, std::int64_t layers, std::int64_t heads,
                                std::int64_t width, double dropout = 0.0, bool tie_weights = false) {
  nn::GPTConfig c;
  c.vocab_size = vocab;
  c.block_size = context;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = width;
  c.dropout = dropout;
  c.tie_weights = tie_weights;
  return c;
}

/// The GPT most checkpoint tests use: vocabulary 23, context 12, 2 heads of width 8.
inline nn::GPTConfig small_gpt(std::int64_t layers = 4, double dropout = 0.1) {
  return gpt_config(23, 12, layers, 2, 16, dropout);
}

template <class T>
std::vector<T> values(const BasicTensor<T>& t) {
  return t.to_vector();
}

/// x², as an op of a user's own whose backward does not record its ops (it never asks
/// create_graph()): what a create_graph walk must refuse, naming it.
inline Tensor unrecordable_square(const Tensor& x) {
  static const OpId id = register_op("unrecordable_square");
  Tensor y = detail::produce<float>(id, x.shape(), static_cast<double>(x.numel()), {x}, [=] {
    Tensor out(x.shape());
    detail::flat(out) = detail::flat(x).square();
    return out;
  });
  if (detail::grad_needed(x))
    detail::record<float>(id, {x}, {&y}, {x}, [](detail::BackwardContext<float>& ctx) {
      Tensor dx(ctx.grad_output().shape());
      detail::flat(dx) = detail::flat(ctx.grad_output()) * detail::flat(ctx.saved(0)) * 2.0f;
      ctx.accumulate(0, std::move(dx));
    });
  return y;
}

/// H·v by double backward (grad with create_graph, then the gradient of ⟨g, v⟩): the reference hvp
/// is checked against. Zeros where f does not depend on an input twice (its gradient constant).
template <class T, class F>
std::vector<BasicTensor<T>> double_backward_hvp(F&& f, const std::vector<BasicTensor<T>>& inputs,
                                                const std::vector<BasicTensor<T>>& v) {
  std::vector<BasicTensor<T>> xs;
  for (const BasicTensor<T>& x : inputs) xs.push_back(detail::copy_of(x).requires_grad_());
  GradOptions recorded;
  recorded.create_graph = true;
  const std::vector<BasicTensor<T>> first = grad(f(xs), xs, recorded);
  BasicTensor<T> dot;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const BasicTensor<T> term = sum(first[i] * v[i]);
    dot = dot.defined() ? dot + term : term;
  }
  GradOptions unused;
  unused.allow_unused = true;
  std::vector<BasicTensor<T>> products =
      dot.requires_grad() ? grad(dot, xs, unused) : std::vector<BasicTensor<T>>(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i)
    if (!products[i].defined()) products[i] = zeros<T>(xs[i].shape());
  return products;
}

}  // namespace remat::test

/// REQUIRE that `expr` throws remat::Error whose message contains every given fragment.
#define REQUIRE_ERROR(expr, ...)                                                    \
  do {                                                                              \
    bool remat_threw = false;                                                       \
    try {                                                                           \
      (void)(expr);                                                                 \
    } catch (const ::remat::Error& e) {                                             \
      remat_threw = true;                                                           \
      const std::string remat_msg = e.what();                                       \
      INFO("message: " << remat_msg);                                              \
      for (const char* fragment : {__VA_ARGS__})                                    \
        CHECK(remat_msg.find(fragment) != std::string::npos);                       \
    }                                                                               \
    INFO("expected remat::Error from " #expr);                                     \
    REQUIRE(remat_threw);                                                           \
  } while (false)

/// CHECK that testing::compare_runs(reference, checkpointed[, seed]) finds the two runs' records
/// equal; a failure shows the first difference.
#define CHECK_SAME_RUNS(...)                                                        \
  do {                                                                              \
    const ::remat::testing::GradientComparison remat_runs =                         \
        ::remat::testing::compare_runs(__VA_ARGS__);                                \
    INFO(remat_runs.message);                                                       \
    CHECK(remat_runs.equal);                                                        \
  } while (false)

/// REQUIRE that testing::compare_runs(reference, checkpointed[, seed]) finds the two runs' records
/// equal; a failure shows the first difference.
#define REQUIRE_SAME_RUNS(...)                                                      \
  do {                                                                              \
    const ::remat::testing::GradientComparison remat_runs =                         \
        ::remat::testing::compare_runs(__VA_ARGS__);                                \
    INFO(remat_runs.message);                                                       \
    REQUIRE(remat_runs.equal);                                                      \
  } while (false)
