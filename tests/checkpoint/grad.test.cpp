// remat::grad (torch.autograd.grad): gradients returned, no .grad written, through every policy.
#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

std::vector<float> flat_values(const Tensor& t) { return t.defined() ? t.to_vector() : std::vector<float>{}; }

}  // namespace

TEST_CASE("grad: a leaf's and a computed tensor's gradients, as backward gives them, no .grad written",
          "[checkpoint][grad]") {
  test::FreshTape fresh;
  Tensor x = tensor({1.f, 2.f, 3.f}).requires_grad_();
  Tensor w = tensor({0.5f, -1.f, 2.f}).requires_grad_();
  sum(w * 7.0f).backward();  // w.grad = 7: grad() must leave it so
  Tensor h = x * w;
  Tensor y = sum(h * h + x);
  const std::vector<Tensor> g = grad(y, {x, h, w}, GradOptions{true});
  // dy/dh = 2h, dy/dx = 2h·w + 1, dy/dw = 2h·x
  CHECK(flat_values(g[1]) == std::vector<float>{1.f, -4.f, 12.f});
  CHECK(flat_values(g[0]) == std::vector<float>{1.5f, 5.f, 25.f});
  CHECK(flat_values(g[2]) == std::vector<float>{1.f, -8.f, 36.f});
  CHECK_FALSE(x.grad().defined());
  CHECK_FALSE(h.grad().defined());
  CHECK(flat_values(w.grad()) == std::vector<float>{7.f, 7.f, 7.f});
  // The graph was kept: backward now gives the same, into .grad.
  h.retain_grad();
  y.backward();
  CHECK(flat_values(x.grad()) == flat_values(g[0]));
  CHECK(flat_values(h.grad()) == flat_values(g[1]));
  CHECK(flat_values(w.grad()) == std::vector<float>{8.f, -1.f, 43.f});
}

TEST_CASE("grad: several outputs weighted by grad_outputs, and a retained gradient kept apart", "[checkpoint][grad]") {
  test::FreshTape fresh;
  Tensor x = tensor({1.f, -2.f}).requires_grad_();
  Tensor a = x * 3.0f;
  a.retain_grad();
  Tensor b = exp(x);
  const std::vector<Tensor> g =
      grad<float>({a, b}, {x}, {tensor({1.f, 2.f}), tensor({0.5f, 0.25f})}, GradOptions{true});
  const std::vector<float> e = exp(tensor({1.f, -2.f})).to_vector();
  CHECK(flat_values(g[0]) == std::vector<float>{3.f + 0.5f * e[0], 6.f + 0.25f * e[1]});
  CHECK_FALSE(a.grad().defined());  // a retains its gradient, yet grad() wrote none
}

TEST_CASE("backward: a second backward through a retained gradient sends only its own gradient on",
          "[checkpoint][grad]") {
  // Before: the retained .grad of h stayed as the gradient flowing into h's node, so the second
  // backward sent the first one's on again (x.grad 24 instead of 16, as in PyTorch).
  test::FreshTape fresh;
  Tensor x = ones({3}).requires_grad_();
  Tensor h = x * 2.0f;
  h.retain_grad();
  Tensor y = sum(h * h);
  y.backward(true);
  CHECK(flat_values(x.grad()) == std::vector<float>{8.f, 8.f, 8.f});
  CHECK(flat_values(h.grad()) == std::vector<float>{4.f, 4.f, 4.f});
  y.backward(true);
  CHECK(flat_values(x.grad()) == std::vector<float>{16.f, 16.f, 16.f});
  CHECK(flat_values(h.grad()) == std::vector<float>{8.f, 8.f, 8.f});
  h.zero_grad();
  CHECK_FALSE(h.grad().defined());
}

TEST_CASE("grad: through every checkpointing policy of a GPT, dropout on, bitwise backward's gradients",
          "[checkpoint][grad]") {
  for (const char* how : {"none", "blocks", "selective", "sqrt", "binomial:2"}) {
    INFO(how);
    test::FreshTape fresh;
    test::GptStep step(how);
    std::vector<Tensor> params;
    for (auto& [name, p] : step.gpt.named_parameters()) params.push_back(*p);
    step.gpt.zero_grad();
    manual_seed(4);
    step.loss().backward();
    const std::vector<std::vector<float>> by_backward = test::gradients(step.gpt);
    step.gpt.zero_grad();
    manual_seed(4);
    const std::vector<Tensor> g = grad(step.loss(), params);
    REQUIRE(g.size() == by_backward.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      INFO("parameter " << i);
      CHECK(flat_values(g[i]) == by_backward[i]);
      CHECK_FALSE(params[i].grad().defined());
    }
  }
}

TEST_CASE("grad: bad calls are errors naming the tensor and what was expected", "[checkpoint][grad]") {
  test::FreshTape fresh;
  Tensor x = tensor({1.f, 2.f}).requires_grad_();
  Tensor unused = tensor({3.f}).requires_grad_();
  Tensor plain = tensor({4.f, 5.f});
  Tensor y = sum(x * x);
  REQUIRE_ERROR(grad(sum(test::unrecordable_square(x)), {x}, GradOptions{true, true}), "unrecordable_square",
                "create_graph");
  REQUIRE_ERROR(grad(y, {plain}, GradOptions{true}), "grad", "input 0", "(2,)", "does not require grad");
  REQUIRE_ERROR(grad(y, {x, unused}, GradOptions{true}), "grad", "input 1", "(1,)", "allow_unused");
  const std::vector<Tensor> g = grad(y, {x, unused}, GradOptions{true, false, true});
  CHECK(flat_values(g[0]) == std::vector<float>{2.f, 4.f});
  CHECK_FALSE(g[1].defined());
  // A gradient has no graph: differentiating it again says so.
  REQUIRE_ERROR(grad(sum(g[0]), {x}), "grad", "output 0", "does not require grad");
  Tensor v = x * 2.0f;
  REQUIRE_ERROR(grad<float>({v}, {x}, {ones({3})}), "grad", "grad_outputs[0]", "(3,)", "(2,)");
  REQUIRE_ERROR(grad(v, {x}), "grad", "output 0", "(2,)", "one-element");
  grad(y, {x});  // frees the graph
  REQUIRE_ERROR(grad(y, {x}), "grad", "freed", "retain_graph");
}

TEST_CASE("grad: what reaches a computed input whose node does not run is not sent on by a later backward",
          "[checkpoint][grad]") {
  test::FreshTape fresh;
  Tensor x = tensor({1.f, 2.f}).requires_grad_();
  Tensor h = x * 3.0f;  // h's node on the root tape
  Tape inner;
  {
    TapeGuard use(inner);
    Tensor y = sum(h * h);  // y's on the inner tape: the walk runs that tape alone
    const std::vector<Tensor> g = grad(y, {h});
    CHECK(flat_values(g[0]) == std::vector<float>{6.f, 12.f});
  }
  sum(h).backward();
  CHECK(flat_values(x.grad()) == std::vector<float>{3.f, 3.f});
}

TEST_CASE("grad: hands back the walk's own gradients, each held once as it returns, an input listed twice gets two "
          "tensors",
          "[checkpoint][grad]") {
  test::FreshTape fresh;
  Generator gen(4);
  const Tensor x = randn<float>({1 << 16}, gen).requires_grad_();
  const std::size_t bytes = static_cast<std::size_t>(x.numel()) * sizeof(float);
  Tensor y = sum(x);
  reset_peak_memory_stats();
  const std::size_t base = memory_stats().live_bytes;
  std::vector<Tensor> g = grad(y, {x});
  // sum's backward makes the one gradient; a copy of it at the return would double the peak.
  CHECK(memory_stats().peak_bytes - base < bytes + 1024);
  CHECK(memory_stats().live_bytes - base >= bytes);
  CHECK(flat_values(g[0]) == std::vector<float>(static_cast<std::size_t>(x.numel()), 1.f));

  // Listed twice: equal values in two tensors of their own (writing one leaves the other).
  std::vector<Tensor> twice = grad(sum(x * 3.0f), {x, x});
  REQUIRE(flat_values(twice[0]) == flat_values(twice[1]));
  detail::flat(twice[0]).setZero();
  CHECK(flat_values(twice[1]) == std::vector<float>(static_cast<std::size_t>(x.numel()), 3.f));
  // One gradient passed on to two inputs (add's backward): their tensors do not share bytes either.
  Tensor a = randn<float>({8}, gen).requires_grad_(), b = randn<float>({8}, gen).requires_grad_();
  std::vector<Tensor> both = grad(sum(a + b), {a, b});
  detail::flat(both[0]).setZero();
  CHECK(flat_values(both[1]) == std::vector<float>(8, 1.f));
}
