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

/// Lists the outputs it sees and can hand back a fixed tensor for one op.
struct Recorder : OpOutputHook {
  std::vector<std::string> seen;
  std::optional<OpId> replace;
  Tensor replacement;
  std::vector<detail::TensorRef> reuse(const OpOutput& out) override {
    if (replace && out.op == *replace) return {replacement.ref()};
    return OpOutputHook::reuse(out);
  }
  void produced(const OpOutput& out, const std::vector<detail::TensorRef>& values) override {
    seen.push_back(fmt::format("{} {} {} {}x {} B {} flops{}", out.op.name(), out.shape, out.dtype, out.count, out.bytes,
                               out.flops, out.replaying ? " (replay)" : ""));
    CHECK(values.size() == out.count);
    CHECK(values[0].shape == out.shape);
    OpOutputHook::produced(out, values);
  }
};

}  // namespace

TEST_CASE("op-output hook: handlers see op outputs, nest, and may supply an output", "[core][op_output]") {
  const Tensor a = ones({2, 3}), b = ones({3, 4});
  Recorder outer;
  {
    Recorder inner;
    const Tensor c = exp(matmul(a, b));
    CHECK(inner.seen == std::vector<std::string>{"matmul (2, 4) float32 1x 32 B 48 flops", "exp (2, 4) float32 1x 32 B 8 flops"});
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
  CHECK(outer.seen == std::vector<std::string>{"softmax (2, 3) float32 1x 24 B 30 flops"});
}

TEST_CASE("op-output hook: every op reports, with what its backward needs as extra outputs", "[core][op_output]") {
  Recorder rec;
  const Tensor x = randn({2, 3, 4});
  const Tensor w = ones({4}), bias = zeros({4});
  (void)layer_norm(x, w, bias);
  (void)max(x, -1);
  (void)cross_entropy(x, zeros<std::int64_t>({2, 3}));
  (void)causal_attention(randn({1, 2, 3, 4}), randn({1, 2, 3, 4}), randn({1, 2, 3, 4}));
  (void)cat(std::vector<Tensor>{x, x}, 0);
  (void)permute(x, {2, 0, 1});
  (void)reshape(x, {6, 4});
  (void)sum(x, 1);
  (void)mean(x);
  (void)embedding(zeros<std::int64_t>({5}), ones({3, 4}));
  (void)dropout(x, 0.5);
  (void)(x + x);
  CHECK(rec.seen == std::vector<std::string>{
                        "layer_norm (2, 3, 4) float32 3x 144 B 192 flops",
                        "max_dim (2, 3) float32 2x 72 B 24 flops",
                        "cross_entropy () float32 2x 100 B 120 flops",
                        "causal_attention (1, 2, 3, 4) float32 2x 120 B 288 flops",
                        "cat (4, 3, 4) float32 1x 192 B 48 flops",
                        "permute (4, 2, 3) float32 1x 96 B 24 flops",
                        "reshape (6, 4) float32 1x 96 B 0 flops",
                        "sum_dim (2, 4) float32 1x 32 B 24 flops",
                        "mean () float32 1x 4 B 24 flops",
                        "embedding (5, 4) float32 1x 80 B 20 flops",
                        "dropout (2, 3, 4) float32 1x 96 B 24 flops",
                        "add (2, 3, 4) float32 1x 96 B 24 flops",
                    });
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
