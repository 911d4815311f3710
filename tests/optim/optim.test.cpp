#include <cmath>

#include "support.hpp"

using namespace remat;

namespace {
/// A parameter with a fixed gradient, as if backward had produced it.
void set_grad(Tensor& p, std::vector<float> g) {
  p.zero_grad();
  sum(p * tensor(g, p.shape())).backward();
}
}  // namespace

TEST_CASE("sgd: plain, momentum and weight decay follow PyTorch's update", "[optim][sgd]") {
  Tensor p = tensor({1.f, -2.f}).requires_grad_();
  optim::SGD plain({&p}, {0.1});
  set_grad(p, {0.5f, 1.f});
  plain.step();
  CHECK(test::values(p) == std::vector<float>{1.f - 0.05f, -2.f - 0.1f});

  Tensor q = tensor({1.f}).requires_grad_();
  optim::SGD mom({&q}, {0.1, 0.9, 0.5});
  set_grad(q, {1.f});
  mom.step();  // g = 1 + 0.5·1 = 1.5, b = 1.5, q = 1 - 0.15
  CHECK(q.item() == Approx(0.85f));
  set_grad(q, {1.f});
  mom.step();  // g = 1 + 0.5·0.85 = 1.425, b = 0.9·1.5 + 1.425 = 2.775, q = 0.85 - 0.2775
  CHECK(q.item() == Approx(0.5725f));
  REQUIRE_ERROR(optim::SGD({&q}, {0.1, 0.0, 0.0, true}), "nesterov");

  // Every option combination reads the gradient and leaves it as backward made it.
  for (const optim::SGDOptions& o : {optim::SGDOptions{0.1}, optim::SGDOptions{0.1, 0.9}, optim::SGDOptions{0.1, 0.9, 0.5},
                                     optim::SGDOptions{0.1, 0.9, 0.0, true}, optim::SGDOptions{0.1, 0.0, 0.5}}) {
    INFO("momentum " << o.momentum << ", weight decay " << o.weight_decay << ", nesterov " << o.nesterov);
    Tensor r = tensor({1.f, -2.f}).requires_grad_();
    optim::SGD sgd({&r}, o);
    for (int step = 0; step < 2; ++step) {
      set_grad(r, {0.5f, 1.f});
      sgd.step();
      CHECK(test::values(r.grad()) == std::vector<float>{0.5f, 1.f});
    }
  }
}

TEST_CASE("adamw: first steps match the closed form, with decoupled decay", "[optim][adamw]") {
  Tensor p = tensor({1.f, -1.f}).requires_grad_();
  optim::AdamW opt({&p}, {0.1, 0.9, 0.999, 1e-8, 0.5});
  set_grad(p, {2.f, -0.5f});
  opt.step();
  // Step 1: m̂ = g, v̂ = g², update = lr·g/|g| = ±lr; decay first: p·(1 - lr·wd) = p·0.95.
  CHECK(p.data()[0] == Approx(0.95f - 0.1f).epsilon(1e-5));
  CHECK(p.data()[1] == Approx(-0.95f + 0.1f).epsilon(1e-5));
  set_grad(p, {2.f, -0.5f});
  opt.step();  // constant gradient: m̂ = g and v̂ = g² again
  CHECK(p.data()[0] == Approx(0.85f * 0.95f - 0.1f).epsilon(1e-5));
  CHECK(opt.steps() == 2);
  Tensor untouched = ones({1}).requires_grad_();
  optim::AdamW skip({&untouched});
  skip.step();  // no gradient: no change
  CHECK(untouched.item() == 1.f);
  REQUIRE_ERROR(optim::AdamW({&p}, {0.1, 1.0}), "betas");
}

TEST_CASE("adamw: parameter groups take their own weight decay", "[optim][adamw]") {
  Tensor decayed = tensor({1.f}).requires_grad_(), kept = tensor({1.f}).requires_grad_();
  optim::AdamW opt(std::vector<optim::ParamGroup>{{{&decayed}, 0.5}, {{&kept}, 0.0}}, {0.1});
  set_grad(decayed, {0.f});
  set_grad(kept, {0.f});
  opt.step();
  CHECK(decayed.item() == Approx(0.95f));
  CHECK(kept.item() == 1.f);
}

TEST_CASE("clip_grad_norm: scales the global norm down to max_norm and returns it", "[optim][clip]") {
  Tensor a = zeros({2}).requires_grad_(), b = zeros({1}).requires_grad_();
  set_grad(a, {3.f, 0.f});
  set_grad(b, {4.f});
  CHECK(optim::clip_grad_norm({&a, &b}, 1.0) == Approx(5.0));
  CHECK(a.grad().data()[0] == Approx(0.6f).epsilon(1e-5));
  CHECK(b.grad().data()[0] == Approx(0.8f).epsilon(1e-5));
  CHECK(optim::clip_grad_norm({&a, &b}, 10.0) == Approx(1.0).epsilon(1e-5));
  CHECK(b.grad().data()[0] == Approx(0.8f).epsilon(1e-5));  // under the limit: unchanged
}

TEST_CASE("warmup cosine: linear warmup, cosine to min_lr, then constant", "[optim][schedule]") {
  const optim::WarmupCosine s(1.0, 0.1, 10, 110);
  CHECK(s(0) == Approx(0.1));
  CHECK(s(9) == Approx(1.0));
  CHECK(s(10) == Approx(1.0));
  CHECK(s(60) == Approx(0.55));
  CHECK(s(110) == Approx(0.1));
  CHECK(s(500) == Approx(0.1));
  REQUIRE_ERROR(optim::WarmupCosine(1.0, 0.1, 10, 10), "warmup");
}

TEST_CASE("adamw: an element's update does not depend on where the slice holding it starts or ends",
          "[optim][adamw]") {
  // ShardedAdamW updates shards that start anywhere; AdamW the whole parameter. 1,031 elements
  // (prime) of gradients and moments spanning many magnitudes, updated whole and as slices.
  const std::int64_t n = 1031;
  Generator gen(11);
  const std::vector<float> w0 = randn(Shape{n}, gen).to_vector(), g = (randn(Shape{n}, gen) * 3.0f).to_vector();
  std::vector<float> m0 = randn(Shape{n}, gen).to_vector(), v0 = (rand(Shape{n}, gen) * 5.0f).to_vector();
  for (std::size_t i = 0; i < m0.size(); ++i) v0[i] *= std::pow(10.0f, static_cast<float>(i % 9) - 6.0f);
  const optim::AdamWStep c(optim::AdamWOptions{}, 1e-3, 3);
  std::vector<float> w = w0, m = m0, v = v0;
  c.update(w.data(), m.data(), v.data(), g.data(), n, c.decay(0.01));
  for (const std::int64_t piece : {1, 3, 5, 7, 13, 29}) {
    std::vector<float> ws = w0, ms = m0, vs = v0;
    for (std::int64_t b = 0; b < n; b += piece) {
      const std::int64_t k = std::min(piece, n - b);
      c.update(ws.data() + b, ms.data() + b, vs.data() + b, g.data() + b, k, c.decay(0.01));
    }
    INFO("slices of " << piece);
    CHECK(ws == w);
    CHECK(ms == m);
    CHECK(vs == v);
  }
}
