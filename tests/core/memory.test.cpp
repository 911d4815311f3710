#include "support.hpp"

using namespace remat;

TEST_CASE("memory: live bytes count every tensor byte exactly", "[core][memory]") {
  const std::size_t before = memory_stats().live_bytes;
  {
    const Tensor a = zeros({10, 10});
    const DoubleTensor b = zeros<double>({5});
    CHECK(memory_stats().live_bytes - before == 400 + 40);
    const Tensor view = reshape(a, {100});  // shares storage: no new bytes
    CHECK(memory_stats().live_bytes - before == 440);
  }
  CHECK(memory_stats().live_bytes == before);
}

TEST_CASE("memory: a matmul node saves exactly its two operands", "[core][memory]") {
  test::FreshTape fresh;
  Tensor a = randn({2, 3}).requires_grad_();
  Tensor b = randn({3, 4}).requires_grad_();
  const std::size_t before = memory_stats().saved_bytes;
  Tensor c = matmul(a, b);
  CHECK(memory_stats().saved_bytes - before == (6 + 12) * sizeof(float));
  // Saving the same storage twice counts once.
  Tensor d = matmul(a, b);
  CHECK(memory_stats().saved_bytes - before == (6 + 12) * sizeof(float));
  sum(c + d).backward();
  CHECK(memory_stats().saved_bytes == before);
}

TEST_CASE("memory: a scope reads the peak between its start and now", "[core][memory]") {
  MemoryScope outer;
  {
    MemoryScope inner;
    { const Tensor big = zeros({1000}); }
    CHECK(inner.peak_bytes_above_start() == 4000);
  }
  const Tensor small = zeros({10});
  CHECK(outer.peak_bytes_above_start() == 4000);
  CHECK(memory_stats().peak_bytes >= outer.peak_bytes());
}

TEST_CASE("memory: peak saved bytes track what the tape held at its fullest", "[core][memory]") {
  test::FreshTape fresh;
  Tensor x = randn({100}).requires_grad_();
  MemoryScope scope;
  Tensor loss = sum(exp(exp(x)));  // two exp nodes, each saving 100 floats
  CHECK(memory_stats().saved_bytes - scope.start_saved_bytes() == 800);
  loss.backward();
  CHECK(scope.peak_saved_bytes() - scope.start_saved_bytes() == 800);
  CHECK(memory_stats().saved_bytes == scope.start_saved_bytes());
  reset_peak_memory_stats();
  CHECK(memory_stats().peak_saved_bytes == memory_stats().saved_bytes);
}

TEST_CASE("memory: freed blocks are cached and reused, outside the live count", "[core][memory]") {
  set_allocator_caching(true);
  empty_cache();
  const std::size_t live = memory_stats().live_bytes;
  const float* first = nullptr;
  {
    const Tensor a = zeros({1000});
    first = a.data();
  }
  CHECK(memory_stats().live_bytes == live);
  // 4000 bytes in a 64-byte-aligned block; under ASan blocks are exact, so over-reads are caught
  CHECK(cached_memory_bytes() == (detail::kRoundBlocks ? 4032u : 4000u));
  const Tensor b = zeros({1000});
  CHECK(b.data() == first);  // the same block again
  CHECK(cached_memory_bytes() == 0);
  set_allocator_caching(false);
  { const Tensor c = zeros({10}); }
  CHECK(cached_memory_bytes() == 0);
  set_allocator_caching(detail::kCacheByDefault);
}

TEST_CASE("memory: a gradient passed on unchanged (reshape, dropout_add's residual) is adopted, not copied",
          "[core][memory]") {
  test::FreshTape fresh;
  // The same graph with and without a reshape in it: the reshape's backward allocates nothing.
  auto reshape_backward = [](bool reshaped) {
    Tensor x = randn({64, 64}).requires_grad_();
    const Tensor h = x * 2.0;
    const Tensor y = reshaped ? reshape(h, {4096}) : h;
    Tensor loss = sum(y * 3.0);
    const std::size_t before = memory_stats().allocations;
    loss.backward();
    CHECK(x.grad().to_vector() == std::vector<float>(4096, 6.0f));
    return memory_stats().allocations - before;
  };
  CHECK(reshape_backward(true) == reshape_backward(false));
  // dropout_add: the residual's gradient is the output's, so a residual that needs one costs no buffer.
  auto dropout_add_backward = [](bool residual_grad) {
    Generator gen(3);
    Tensor h = randn({64, 64}, gen).requires_grad_(), r = randn({64, 64}, gen).requires_grad_(residual_grad);
    Tensor loss = sum(dropout_add(h * 1.0, r, 0.5, true, gen) * 1.0);
    const std::size_t before = memory_stats().allocations;
    loss.backward();
    if (residual_grad) CHECK(r.grad().to_vector() == std::vector<float>(4096, 1.0f));
    return memory_stats().allocations - before;
  };
  CHECK(dropout_add_backward(true) == dropout_add_backward(false));
}

TEST_CASE("memory: a split's parts add their gradients into the input's in place, one input-sized buffer",
          "[core][memory]") {
  test::FreshTape fresh;
  const std::int64_t rows = 8, part = 1000;
  const std::size_t whole = rows * 3 * part * sizeof(float);
  for (const bool used_whole : {false, true}) {
    INFO((used_whole ? "the input also used whole, after the split" : "the parts alone"));
    Tensor x = randn({rows, 3 * part}).requires_grad_();
    const Tensor h = x * 1.0;
    const std::vector<Tensor> parts = split(h, part, -1);
    Tensor loss = sum(parts[0]) + sum(parts[1]) * 2.0 + sum(parts[2]) * 3.0;
    if (used_whole) loss = loss + sum(h);  // its backward runs first: every part then adds in place
    MemoryScope scope;
    loss.backward();
    // Live at most: the parts' gradients (one input's worth), h's and then x's. A dense gradient
    // per part, summed into h's, held a fourth input-sized buffer.
    CHECK(scope.peak_bytes_above_start() < 2 * whole + whole / 2);
    const std::vector<float> g = x.grad().to_vector();
    for (std::int64_t i = 0; i < rows * 3 * part; ++i) {
      const float expected = static_cast<float>(1 + (i % (3 * part)) / part) + (used_whole ? 1.0f : 0.0f);
      const float got = g[static_cast<std::size_t>(i)];
      if (got != expected) FAIL("x.grad[" << i << "] = " << got << ", expected " << expected);
    }
  }
}
