#include "support.hpp"

using namespace remat;

TEST_CASE("op ids: every op registers its name, and unknown names are errors listing the known ones", "[core][op_output]") {
  const std::vector<std::string> known = known_ops();
  for (const char* name : {"matmul", "linear", "softmax", "layer_norm", "causal_attention", "gelu", "dropout"})
    CHECK(std::find(known.begin(), known.end(), name) != known.end());
  CHECK(find_op("matmul") == op::matmul);
  CHECK(op::matmul != op::linear);
  REQUIRE_ERROR(find_op("softmx"), "softmx", "known ops", "softmax", "matmul");
  REQUIRE_ERROR(save_policy::ops({"layr_norm"}), "save_policy::ops", "layr_norm", "layer_norm");
}

namespace {

/// Counts the outputs it sees and can hand back a fixed tensor for one op.
struct Recorder : OpOutputHook {
  std::vector<std::string> seen;
  std::optional<OpId> replace;
  Tensor replacement;
  detail::TensorRef reuse(const OpOutput& out) override {
    if (replace && out.op == *replace) return replacement.ref();
    return OpOutputHook::reuse(out);
  }
  void produced(const OpOutput& out, const detail::TensorRef& value) override {
    seen.push_back(fmt::format("{} {} {} {}", out.op.name(), out.shape, out.dtype, out.bytes));
    CHECK(value.shape == out.shape);
    OpOutputHook::produced(out, value);
  }
};

}  // namespace

TEST_CASE("op-output hook: handlers see op outputs, nest, and may supply an output", "[core][op_output]") {
  const Tensor a = ones({2, 3}), b = ones({3, 4});
  Recorder outer;
  {
    Recorder inner;
    const Tensor c = exp(matmul(a, b));
    CHECK(inner.seen == std::vector<std::string>{"matmul (2, 4) float32 32", "exp (2, 4) float32 32"});
    CHECK(outer.seen == inner.seen);  // the default passes every output outward
    inner.replace = op::matmul;
    inner.replacement = full({2, 4}, 7.0f);
    CHECK(matmul(a, b).to_vector() == std::vector<float>(8, 7.0f));
    inner.replacement = zeros({4, 2});
    REQUIRE_ERROR(matmul(a, b), "matmul", "(4, 2)", "(2, 4)");
  }
  CHECK(OpOutputHook::current() == &outer);
  outer.seen.clear();
  const Tensor d = softmax(a);
  CHECK(outer.seen == std::vector<std::string>{"softmax (2, 3) float32 24"});
}

TEST_CASE("random element rule: dropout, fused attention and Generator::uniform draw the same numbers", "[core][random]") {
  const std::int64_t n = 4 * 1000 + 3;  // not a whole number of blocks
  Generator g(42);
  g.set_state({42, 17});
  std::vector<float> u(static_cast<std::size_t>(n));
  g.uniform(u.data(), u.size());
  CHECK(g.state().offset == 17 + (n + 3) / 4);

  Generator d(42);
  d.set_state({42, 17});
  const Tensor y = dropout(ones({n}), 0.3, true, d);
  CHECK(d.state() == g.state());
  for (std::int64_t i = 0; i < n; ++i) REQUIRE((y.data()[i] == 0.0f) == (u[static_cast<std::size_t>(i)] < 0.3f));

  // Elements [first, last) of a draw, generated on their own, are that slice of the whole draw.
  std::vector<float> slice;
  detail::for_each_uniform24({42, 17}, 1001, 1010, [&](std::uint64_t, float v) { slice.push_back(v); });
  CHECK(slice == std::vector<float>(u.begin() + 1001, u.begin() + 1010));
}

TEST_CASE("ScopedValue puts the previous value back, also when an exception leaves the scope", "[core][scoped]") {
  int slot = 1;
  try {
    ScopedValue<int> guard(slot, 2);
    CHECK(slot == 2);
    throw Error("leaving");
  } catch (const Error&) {
  }
  CHECK(slot == 1);
  {
    no_grad off;
    CHECK_FALSE(is_grad_enabled());
    {
      enable_grad on;
      CHECK(is_grad_enabled());
    }
    CHECK_FALSE(is_grad_enabled());
  }
  CHECK(is_grad_enabled());
}
