#include <cmath>
#include <optional>

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

/// Lists the outputs it hears (an observer: every op, whatever scope it runs in).
struct Recorder : Observer {
  std::vector<std::string> seen;
  void op(const OpOutput& out, const OpValues& values) override {
    seen.push_back(fmt::format("{} {} {} {}x {} B {} flops{}", out.op.name(), out.shape, out.dtype, out.count, out.bytes,
                               out.flops, out.replaying ? " (replay)" : ""));
    CHECK(values.size() == out.count);
    CHECK(values[0].shape == out.shape);
  }
};

/// A decider that notes the positions it is asked at and can hand back a fixed tensor for one op.
struct Replacer : OpOutputHook {
  std::vector<std::size_t> asked;
  std::optional<OpId> replace;
  Tensor replacement;
  std::vector<detail::TensorRef> reuse(const OpOutput& out) override {
    asked.push_back(out.position);
    if (replace && out.op == *replace) return {replacement.ref()};
    return {};
  }
};

/// A decider that skips every op it is asked about.
struct SkipAll : OpOutputHook {
  int asked = 0;
  bool skip(const OpOutput&) override {
    ++asked;
    return true;
  }
};

}  // namespace

TEST_CASE("deciders: one per scope, ops numbered within it, only the innermost hands outputs over",
          "[core][op_output]") {
  const Tensor a = ones({2, 3}), b = ones({3, 4});
  Recorder heard;
  Replacer outer;
  (void)exp(a);  // the outer scope's op #0
  {
    Replacer inner;
    const Tensor c = exp(matmul(a, b));
    CHECK(inner.asked == std::vector<std::size_t>{0, 1});  // its own scope's ops, from 0
    CHECK(outer.asked == std::vector<std::size_t>{0});     // a nested scope's ops are not the outer's
    outer.replace = op::matmul;
    outer.replacement = zeros({2, 4});
    CHECK(matmul(a, b).to_vector() == std::vector<float>(8, 3.0f));  // the outer decider is not asked
    inner.replace = op::matmul;
    inner.replacement = full({2, 4}, 7.0f);
    CHECK(matmul(a, b).to_vector() == std::vector<float>(8, 7.0f));
    inner.replacement = zeros({4, 2});
    REQUIRE_ERROR(matmul(a, b), "matmul", "(4, 2)", "(2, 4)");
  }
  CHECK(OpOutputHook::current() == &outer);
  (void)softmax(a);
  CHECK(outer.asked == std::vector<std::size_t>{0, 2});  // the nested scope took place #1 (whole, as one)
  // The observer heard every op of every scope, the handed-over ones too.
  CHECK(heard.seen == std::vector<std::string>{"exp (2, 3) float32 1x 24 B 6 flops", "matmul (2, 4) float32 1x 32 B 48 flops",
                                               "exp (2, 4) float32 1x 32 B 8 flops", "matmul (2, 4) float32 1x 32 B 48 flops",
                                               "matmul (2, 4) float32 1x 32 B 48 flops",
                                               "softmax (2, 3) float32 1x 24 B 30 flops"});
}

TEST_CASE("deciders: an enclosing decider skips inside nested scopes, up to a barrier", "[core][op_output]") {
  const Tensor x = ones({2, 2});
  SkipAll outer;
  {
    Replacer inner;  // decides nothing itself: the skip is asked outward
    const Tensor y = exp(x);
    CHECK(std::isnan(y.data()[0]));
  }
  CHECK(outer.asked == 1);
  {
    detail::RunScope barrier(nullptr, true);
    const Tensor z = exp(x);  // computed, whatever the outer decider says
    CHECK(z.data()[0] == std::exp(1.0f));
  }
  CHECK(outer.asked == 1);
}

TEST_CASE("op outputs: every op reports, with what its backward needs as extra outputs", "[core][op_output]") {
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
