#include "support.hpp"

using namespace remat;

TEST_CASE("gradcheck: passes a correct gradient and reports a wrong one", "[testing][gradcheck]") {
  const auto good = testing::gradcheck([](test::Inputs x) { return x[0] * x[0]; }, {randn<double>({3})});
  CHECK(good.ok);
  CHECK(good.max_abs_error < 1e-8);

  // An op whose backward is deliberately wrong (gradient 1 instead of 2x): gradcheck must fail.
  auto wrong_square = [](test::Inputs x) {
    const DoubleTensor& in = x[0];
    DoubleTensor y = detail::copy_of(in);
    detail::flat(y) = detail::flat(in).square();
    if (detail::grad_needed(in))
      detail::record<double>("wrong_square", {in}, {&y}, {}, [](detail::BackwardContext<double>& ctx) {
        ctx.accumulate(0, detail::copy_of(ctx.grad_output()));
      });
    return y;
  };
  const auto bad = testing::gradcheck(wrong_square, {tensor<double>({1.5, 2.0})});
  CHECK_FALSE(bad.ok);
  CHECK(bad.message.find("input 0") != std::string::npos);
  CHECK(bad.max_abs_error > 0.5);
}

TEST_CASE("gradcheck: only inputs that require grad are checked when some do", "[testing][gradcheck]") {
  DoubleTensor a = randn<double>({2});
  a.requires_grad_();
  const DoubleTensor b = randn<double>({2});
  CHECK(testing::gradcheck([](test::Inputs x) { return x[0] * x[1]; }, {a, b}).ok);
}
