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
