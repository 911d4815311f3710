#include <cmath>
#include <limits>

#include "support.hpp"

using namespace remat;

// exp, log, sqrt, pow, tanh, sigmoid, relu, erf: each against std:: and finite differences.
namespace {
void check_against_std(Tensor (*op)(const Tensor&), double (*ref)(double), std::vector<float> inputs) {
  const Tensor y = op(tensor(inputs));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    CHECK(y.data()[i] == Approx(ref(inputs[i])).epsilon(1e-6));
}
double sigmoid_ref(double v) { return 1 / (1 + std::exp(-v)); }
double relu_ref(double v) { return v > 0 ? v : 0; }
}  // namespace

TEST_CASE("exp, log, sqrt, tanh, sigmoid, relu, erf: values match the std functions",
          "[ops][exp][log][sqrt][tanh][sigmoid][relu][erf]") {
  check_against_std(&remat::exp<float>, [](double v) { return std::exp(v); }, {-2.f, 0.f, 1.5f});
  check_against_std(&remat::log<float>, [](double v) { return std::log(v); }, {0.1f, 1.f, 7.f});
  check_against_std(&remat::sqrt<float>, [](double v) { return std::sqrt(v); }, {0.25f, 4.f, 9.f});
  check_against_std(&remat::tanh<float>, [](double v) { return std::tanh(v); }, {-3.f, 0.2f, 1.f});
  check_against_std(&remat::sigmoid<float>, &sigmoid_ref, {-3.f, 0.f, 2.f});
  check_against_std(&remat::relu<float>, &relu_ref, {-3.f, 0.f, 2.f});
  check_against_std(&remat::erf<float>, [](double v) { return std::erf(v); }, {-2.5f, -0.3f, 0.f, 0.7f, 4.f});
  CHECK(test::values(pow(tensor({2.f, 3.f}), 3)) == std::vector<float>{8, 27});
}

TEST_CASE("exp: below the smallest normal and at -inf the result is exactly 0, in float and double", "[ops][exp]") {
  // 40 elements: whole vector registers on any instruction set, where exp is vectorised.
  std::vector<float> xf(40, -std::numeric_limits<float>::infinity());
  xf[1] = -100.0f;
  xf[2] = 0.0f;
  std::vector<double> xd(40, -std::numeric_limits<double>::infinity());
  xd[1] = -2000.0;
  xd[2] = 0.0;
  const std::vector<float> yf = exp(tensor(xf)).to_vector();
  const std::vector<double> yd = exp(tensor(xd)).to_vector();
  for (std::size_t i = 0; i < 40; ++i) {
    CHECK(yf[i] == (i == 2 ? 1.0f : 0.0f));
    CHECK(yd[i] == (i == 2 ? 1.0 : 0.0));
  }
}

TEST_CASE("exp, log, sqrt, pow, tanh, sigmoid, relu, erf: backward matches finite differences",
          "[ops][exp][log][sqrt][pow][tanh][sigmoid][relu][erf]") {
  const DoubleTensor positive = (rand<double>({3, 4}) + 0.5).detach();
  test::require_gradcheck([](test::Inputs x) { return exp(x[0]); }, {randn<double>({3, 4})});
  test::require_gradcheck([](test::Inputs x) { return log(x[0]); }, {positive});
  test::require_gradcheck([](test::Inputs x) { return sqrt(x[0]); }, {positive});
  test::require_gradcheck([](test::Inputs x) { return pow(x[0], 2.5); }, {positive});
  test::require_gradcheck([](test::Inputs x) { return pow(x[0], 3); }, {randn<double>({5})});
  test::require_gradcheck([](test::Inputs x) { return tanh(x[0]); }, {randn<double>({3, 4})});
  test::require_gradcheck([](test::Inputs x) { return sigmoid(x[0]); }, {randn<double>({3, 4})});
  test::require_gradcheck([](test::Inputs x) { return erf(x[0]); }, {randn<double>({3, 4})});
  // relu is not differentiable at 0; keep inputs away from it.
  test::require_gradcheck([](test::Inputs x) { return relu(x[0]); }, {tensor<double>({-1.5, -0.3, 0.4, 2.0})});
}

TEST_CASE("element-wise ops: an element's bits depend on its input alone, not on the thread count, the "
          "tensor's length or the element's position", "[ops][exp][log][sqrt][tanh][sigmoid][pow][gelu]") {
  // Eigen computes a destination's unaligned head and ragged tail on its scalar path, whose sqrt,
  // exp, log, tanh are other functions than its vectorised ones. 2·2^15 + 37 elements: split
  // across 2 and 3 threads at offsets that are not multiples of a vector width.
  const std::int64_t n = 2 * 32768 + 37;
  Generator gen(3);
  const Tensor x = rand(Shape{n}, gen) * 4.0f + 0.05f;
  using Op = Tensor (*)(const Tensor&);
  const std::vector<std::pair<const char*, Op>> ops = {
      {"exp", [](const Tensor& t) { return exp(t); }},     {"log", [](const Tensor& t) { return log(t); }},
      {"sqrt", [](const Tensor& t) { return sqrt(t); }},   {"tanh", [](const Tensor& t) { return tanh(t); }},
      {"sigmoid", [](const Tensor& t) { return sigmoid(t); }}, {"pow", [](const Tensor& t) { return pow(t, 1.7); }},
      {"gelu", [](const Tensor& t) { return gelu(t); }},   {"gelu tanh", [](const Tensor& t) { return gelu(t, GeluApproximation::tanh); }}};
  const int threads = get_num_threads();
  for (const auto& [name, op] : ops) {
    INFO(name);
    set_num_threads(1);
    const std::vector<float> whole = op(x).to_vector();
    for (const int t : {2, 3}) {
      set_num_threads(t);
      CHECK(op(x).to_vector() == whole);
    }
    set_num_threads(threads);
    // Each of the first 64 elements alone (a one-element tensor), and a prefix of odd length.
    for (std::int64_t i = 0; i < 64; ++i) CHECK(op(tensor({x.data()[i]})).item() == whole[static_cast<std::size_t>(i)]);
    const std::vector<float> prefix = op(narrow(x, 0, 0, 29)).to_vector();
    CHECK(prefix == std::vector<float>(whole.begin(), whole.begin() + 29));
  }
}
