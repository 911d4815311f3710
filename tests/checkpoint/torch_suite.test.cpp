// checkpoint() held to PyTorch's own checkpoint tests (test/test_utils.py TestCheckpoint,
// test/test_autograd.py's non-reentrant, nested and selective-activation-checkpoint tests),
// translated where they apply; the PyTorch test each case follows is named in its tags' comment.

#include <map>
#include <optional>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

namespace test_op {
inline const OpId counted = register_op("test_counted");
}

int& computes() {
  static int n = 0;
  return n;
}

/// y = 2x through the op-output hook, counting every time it really computes. `saves_input`: its
/// backward reads x (like mul by a tensor); else it reads nothing (like add).
Tensor counted(const Tensor& x, bool saves_input = true) {
  Tensor y = detail::produce<float>(test_op::counted, x.shape(), static_cast<double>(x.numel()), {x}, [=] {
    ++computes();
    Tensor out(x.shape());
    for (std::int64_t i = 0; i < x.numel(); ++i) out.data()[i] = 2.0f * x.data()[i];
    return out;
  });
  if (detail::grad_needed(x)) {
    std::vector<detail::SavedTensor> saved;
    if (saves_input) saved.emplace_back(x);
    detail::record<float>(test_op::counted, {x}, {&y}, std::move(saved), [saves_input](detail::BackwardContext<float>& ctx) {
      if (saves_input) {
        const Tensor in = ctx.saved(0);  // const: reading must not count as a write
        REQUIRE(!std::isnan(in.data()[0]));  // what it reads was computed
      }
      Tensor dx(ctx.grad_output().shape());
      for (std::int64_t i = 0; i < dx.numel(); ++i) dx.data()[i] = 2.0f * ctx.grad_output().data()[i];
      ctx.accumulate(0, std::move(dx));
    });
  }
  return y;
}

std::vector<float> grad_of(const Tensor& t) { return t.grad().defined() ? t.grad().to_vector() : std::vector<float>{}; }

}  // namespace

// test_autograd.py: test_checkpointing_without_reentrant_early_free / set_checkpoint_early_stop
TEST_CASE("early stop: a replay computes up to the last output backward reads, and no further",
          "[checkpoint][early_stop]") {
  auto three = [](const Tensor& x) { return counted(counted(counted(x))); };
  auto run = [&](bool early_stop, std::vector<float>& grad) {
    CheckpointEarlyStop mode(early_stop);
    Tensor x = tensor({1.0f, -2.0f, 3.0f}).requires_grad_();
    Tensor y = checkpoint(three, x);
    const int before = computes();
    sum(y * y).backward();
    grad = grad_of(x);
    return computes() - before;
  };
  std::vector<float> with, without;
  // The third op's backward reads the second's output; nothing reads the third's.
  CHECK(run(true, with) == 2);
  CHECK(run(false, without) == 3);
  CHECK(with == without);
  CHECK(with == std::vector<float>{64.0f * 2 * 1, 64.0f * 2 * -2, 64.0f * 2 * 3});

  // A segment whose ops save nothing recomputes nothing.
  Tensor x = tensor({1.0f, 2.0f}).requires_grad_();
  Tensor y = checkpoint([](const Tensor& a) { return counted(counted(a, false), false); }, x);
  const int before = computes();
  sum(y).backward();
  CHECK(computes() == before);
  CHECK(grad_of(x) == std::vector<float>{4.0f, 4.0f});
}

TEST_CASE("early stop: a GPT block's replay skips its output projection and its dropout + residual, bitwise",
          "[checkpoint][early_stop][gpt]") {
  Generator init(5);
  nn::TransformerBlock block(16, 2, 0.1, true, init);
  const Tensor data = randn({2, 6, 16}, init);
  std::size_t skipped[3] = {};  // ops early stop skipped, by mode
  auto run = [&](int mode) {  // 0 plain, 1 checkpoint with early stop, 2 without
    return [&, mode] {
      CheckpointEarlyStop es(mode == 1);
      block.zero_grad();
      Tensor x = data.detach().requires_grad_();
      Tensor y = mode == 0 ? block(x) : checkpoint(block, x);
      const detail::EarlyStopStats before = early_stop_stats();
      sum(y * y).backward();
      skipped[mode] = early_stop_stats().ops - before.ops;
      return testing::RunRecord().grads(block).tensor("gradient of x", x.grad());
    };
  };
  CHECK_SAME_RUNS(run(0), run(1), 9);
  CHECK_SAME_RUNS(run(0), run(2), 9);
  CHECK(skipped[2] == 0);
  // c_proj of the MLP (linear), then its dropout and the residual add (one dropout_add): the last
  // two op outputs.
  CHECK(skipped[1] == 2);
}

// test_autograd.py TestNestedCheckpoint: test_nested_checkpoint_early_stop_{True,False}, two_children
TEST_CASE("early stop: nested checkpoints, with two children, equal plain gradients and recompute less",
          "[checkpoint][early_stop][nested]") {
  auto inner = [](const Tensor& a) { return counted(counted(a)); };
  bool nested = true;
  auto outer = [&](const Tensor& a) {
    const Tensor left = nested ? checkpoint(inner, a) : inner(a);
    const Tensor right = nested ? checkpoint(inner, counted(a)) : inner(counted(a));
    return counted(left * right);
  };
  int work[3] = {};  // recomputations in backward, by mode: 0 plain, 1 early stop, 2 without
  auto run = [&](int mode) {
    return [&, mode] {
      CheckpointEarlyStop es(mode == 1);
      nested = mode != 0;
      Tensor x = tensor({0.5f, -1.5f, 2.0f, 1.0f}).requires_grad_();
      Tensor y = mode == 0 ? outer(x) : checkpoint(outer, x);
      const int before = computes();
      sum(y).backward();
      work[mode] = computes() - before;
      return testing::RunRecord().tensor("gradient of x", x.grad());
    };
  };
  CHECK_SAME_RUNS(run(0), run(1));
  CHECK_SAME_RUNS(run(0), run(2));
  CHECK(work[0] == 0);
  CHECK(work[1] < work[2]);
}

TEST_CASE("early stop: recorded chain steps stop at the last saved output, under every policy",
          "[checkpoint][early_stop][chain]") {
  const ChainStep step = [](const Tensor& a) { return counted(counted(a) * a); };  // the last counted is never read
  const std::vector<ChainStep> steps(7, step);
  for (const Policy& p : {policy::none(), policy::uniform(2), policy::sqrt_segments(), policy::binomial(2)}) {
    int work[3] = {};  // recomputations in backward, by mode: 0 plain, 1 early stop, 2 without
    auto run = [&](int mode) {
      return [&, mode] {
        CheckpointEarlyStop es(mode == 1);
        Tensor x = tensor({0.5f, -0.25f, 0.75f}).requires_grad_();
        Tensor y = x;
        if (mode == 0) for (const ChainStep& s : steps) y = s(y);
        else y = checkpoint_sequential(steps, x, p);
        const int before = computes();
        sum(y).backward();
        work[mode] = computes() - before;
        return testing::RunRecord().tensor("gradient of x", x.grad());
      };
    };
    INFO(p.name);
    CHECK_SAME_RUNS(run(0), run(1));
    CHECK_SAME_RUNS(run(0), run(2));
    if (p.name != "none") CHECK(work[1] < work[2]);
  }
}

// test_utils.py: test_checkpoint_non_tensor_inputs_outputs; test_autograd.py:
// test_checkpointing_without_reentrant_arbitrary_input_output, test_nested_checkpoint_non_tensor_inputs_and_outputs
namespace {
struct Carry {
  Tensor h;
  std::vector<Tensor> cache;
  LongTensor mask;
  int steps;
};
}  // namespace

TEST_CASE("outputs: any mix of tensors of any dtype and other values, nested in containers and structs",
          "[checkpoint][outputs]") {
  Generator g(3);
  const Tensor wdata = randn({4, 4}, g), xdata = randn({3, 4}, g);
  auto fn = [](const Tensor& x, const std::vector<Tensor>& ws, double scale, const std::string& tag) {
    const Tensor h = tanh(matmul(x, ws[0])) * static_cast<float>(scale);
    Carry c{h, {h * 2.0f, matmul(h, ws[1])}, LongTensor({3}), static_cast<int>(tag.size())};
    for (std::int64_t i = 0; i < 3; ++i) c.mask.data()[i] = i % 2;
    std::map<std::string, Tensor> named{{"sig", sigmoid(h)}};
    return std::make_tuple(c, std::optional<Tensor>(exp(h)), named, tag + "!");
  };
  auto loss_of = [](const auto& r) {
    const auto& [c, opt, named, text] = r;
    return sum(c.h) + sum(c.cache[0] * c.cache[1]) + sum(*opt) + sum(named.at("sig"));
  };
  auto run = [&](bool ck) {
    Tensor x = xdata.detach().requires_grad_();
    std::vector<Tensor> ws{wdata.detach().requires_grad_(), (wdata * 0.5f).detach().requires_grad_()};
    auto r = ck ? checkpoint(fn, x, ws, 0.5, std::string("abc")) : fn(x, ws, 0.5, std::string("abc"));
    const auto& [c, opt, named, text] = r;
    CHECK(c.steps == 3);
    CHECK(text == "abc!");
    CHECK(c.mask.to_vector() == std::vector<std::int64_t>{0, 1, 0});
    CHECK(c.h.requires_grad());
    loss_of(r).backward();
    return testing::RunRecord()
        .tensor("gradient of x", x.grad())
        .tensor("gradient of ws[0]", ws[0].grad())
        .grad("ws[1]", ws[1]);  // the weight inside the vector got its gradient through the boundary
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
}

TEST_CASE("outputs: an output that needs no gradient stays that way, non-float outputs pass through",
          "[checkpoint][outputs]") {
  Tensor x = randn({2, 3}).requires_grad_();
  const Tensor frozen = randn({2, 3});
  auto fn = [&frozen](const Tensor& a) { return std::make_pair(exp(a), exp(frozen)); };
  auto [y, z] = checkpoint(fn, x);
  CHECK(y.requires_grad());
  CHECK(!z.requires_grad());
  sum(y).backward();
  CHECK(x.grad().defined());

  // test_utils.py test_checkpoint_no_tensors: a function of no tensors returns its value, no node.
  test::FreshTape fresh;
  CHECK(checkpoint([](int a, const std::string& s) { return a + static_cast<int>(s.size()); }, 2, std::string("ab")) == 4);
  CHECK(fresh.tape.size() == 0);
}

// test_utils.py: test_checkpoint_partial_grad
TEST_CASE("outputs: backward through only some outputs gives what the plain graph gives", "[checkpoint][outputs]") {
  auto fn = [](const Tensor& a, const Tensor& b) { return std::make_tuple(a * b, exp(a), tanh(b)); };
  bool checkpointed_b_grad = true;
  auto run = [&](bool ck) {
    Tensor a = tensor({0.1f, 0.2f}).requires_grad_();
    Tensor b = tensor({0.3f, -0.4f}).requires_grad_();
    auto [p, q, r] = ck ? checkpoint(fn, a, b) : fn(a, b);
    sum(q).backward();
    if (ck) checkpointed_b_grad = b.grad().defined();
    return testing::RunRecord().tensor("gradient of a", a.grad()).tensor("gradient of b", b.grad());
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
  CHECK_FALSE(checkpointed_b_grad);  // b only feeds outputs that reached no loss
}

TEST_CASE("boundary: tensors inside container arguments are saved, counted and version-checked",
          "[checkpoint][outputs][version]") {
  test::FreshTape fresh;
  std::vector<Tensor> parts{randn({8}), randn({8}).requires_grad_()};
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y = checkpoint([](const std::vector<Tensor>& v) { return sum(v[0] * v[1]); }, parts);
  CHECK(memory_stats().saved_bytes - before == parts[0].nbytes() + parts[1].nbytes());
  parts[0].data()[0] += 1.0f;  // an in-place write between forward and backward
  REQUIRE_ERROR(y.backward(), "modified in place", "(8,)");
}

// test_autograd.py: test_checkpointing_without_reentrant_parameter_used_in_an_out (and the plain
// path's own "modified after it was saved" check, which checkpointing must not lose)
TEST_CASE("version check: a captured parameter written in place before backward is an error, as without checkpointing",
          "[checkpoint][version]") {
  Generator g(4);
  nn::Linear lin(4, 4, true, g);
  const Tensor x = randn({2, 4}, g).requires_grad_();  // so backward needs the weight (for x's gradient)
  auto bump = [&] { lin.weight.data()[0] += 0.5f; };
  for (int mode = 0; mode < 3; ++mode) {
    INFO("mode " << mode);
    Tensor y;
    if (mode == 0) y = lin(x);
    else if (mode == 1) y = checkpoint(lin, x);
    else y = checkpoint_sequential(std::vector<ChainStep>(3, [&](const Tensor& h) { return lin(h); }), x, policy::binomial(1));
    bump();
    REQUIRE_ERROR(sum(y).backward(), "modified in place", "(4, 4)");
  }
  // Untouched, the same runs succeed.
  Tensor y = checkpoint(lin, x);
  sum(y).backward();
  CHECK(lin.weight.grad().defined());
}

// test_autograd.py: test_checkpoint_detects_non_determinism (the debug trace names the op)
TEST_CASE("debug: a replay that runs other ops names the first differing op, with shapes and position",
          "[checkpoint][debug]") {
  auto fn = [](const Tensor& x) {
    const Tensor h = exp(x);
    const Tensor k = is_replaying() ? sigmoid(h) : tanh(h);
    return sum(k * h);
  };
  Tensor x = randn({3, 2}).requires_grad_();
  CheckpointOptions opts("drift");
  opts.debug = true;
  opts.check_values = true;
  Tensor y = checkpoint(opts, fn, x);
  REQUIRE_ERROR(y.backward(), "drift", "first differ at op #1", "'tanh' -> (3, 2)", "'sigmoid' -> (3, 2)", "#0 'exp'");

  // Without debug the same mismatch is reported, without a trace.
  CheckpointOptions quiet("drift");
  quiet.check_values = true;
  Tensor z = checkpoint(quiet, fn, x);
  try {
    z.backward();
    FAIL("no error");
  } catch (const CheckpointError& e) {
    CHECK(std::string(e.what()).find("op trace") == std::string::npos);
  }

  // Same ops, different values: the trace says so.
  float scale = 1.0f;
  auto drifting = [&scale](const Tensor& a) { return exp(a) * scale; };
  CheckpointDebug debug;
  CheckpointChecking checking;
  Tensor w = checkpoint(drifting, x);
  scale = 2.0f;
  REQUIRE_ERROR(sum(w).backward(), "same 2 ops", "values");
}

TEST_CASE("debug: a chain step whose replay differs names the step and the first differing op", "[checkpoint][debug][chain]") {
  const ChainStep step = [](const Tensor& a) { return is_replaying() ? exp(sigmoid(a)) : exp(tanh(a)); };
  CheckpointDebug debug;
  Tensor x = randn({2, 2}).requires_grad_();
  {
    CheckpointEarlyStop full_records(false);
    Tensor y = checkpoint_sequential(std::vector<ChainStep>(4, step), x, policy::binomial(1));
    CHECK_NOTHROW(sum(y).backward());  // same shapes, and values are checked only when asked for
  }
  // The step recorded in forward is held by what its backward reads and rebuilt from it: a
  // rebuild running other ops would hand them other ops' outputs, so that is always an error.
  Tensor y = checkpoint_sequential(std::vector<ChainStep>(4, step), x, policy::binomial(1));
  REQUIRE_ERROR(sum(y).backward(), "step 3 of 4", "other ops", "first differ at op #0");
  CheckpointChecking checking;
  Tensor z = checkpoint_sequential(std::vector<ChainStep>(4, step), x, policy::binomial(1));
  REQUIRE_ERROR(sum(z).backward(), "step 0 of 4", "first differ at op #0", "'tanh' -> (2, 2)", "'sigmoid' -> (2, 2)");
}

// test_autograd.py TestSelectiveActivationCheckpoint: test_policy_with_state, test_bad_inputs
TEST_CASE("selective: the policy is asked once per op in forward, sees shapes and bytes, bad names are errors",
          "[checkpoint][selective]") {
  std::vector<std::string> seen;
  std::vector<bool> replaying;
  int calls = 0;
  SavePolicy policy = [&](const OpOutput& out) {
    ++calls;
    seen.push_back(fmt::format("{} {} {}", out.op.name(), out.shape, out.bytes));
    replaying.push_back(out.replaying);
    return calls % 2 == 1;  // stateful: keeps every other op
  };
  auto fn = [](const Tensor& a) { return sum(tanh(exp(a)) * a); };
  auto run = [&](bool ck) {
    Tensor x = tensor({0.1f, 0.2f, 0.3f}).requires_grad_();
    Tensor y = ck ? checkpoint(CheckpointOptions{"sel", false, policy}, fn, x) : fn(x);
    y.backward();
    return testing::RunRecord().tensor("gradient of x", x.grad());
  };
  CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); });
  CHECK(calls == 4);  // exp, tanh, mul, sum — in forward only: the replay follows its decisions
  CHECK(seen[0] == "exp (3,) 12");
  CHECK(std::none_of(replaying.begin(), replaying.end(), [](bool r) { return r; }));
  REQUIRE_ERROR(save_policy::ops({"exp", "layr_norm"}), "save_policy::ops", "layr_norm", "layer_norm");
}
