#include "support.hpp"

using namespace remat;

TEST_CASE("philox: matches the Random123 known-answer vectors", "[core][random]") {
  using detail::philox4x32_10;
  using A4 = std::array<std::uint32_t, 4>;
  CHECK(philox4x32_10({0, 0, 0, 0}, {0, 0}) == A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}) == A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}) ==
        A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("philox: the lane-batched blocks and every sub-range of a draw match one block at a time",
          "[core][random]") {
  // Offsets either side of 2^32 carry into the counter's high word inside one batch of lanes;
  // the kernel this build runs (AVX-512 in bf16_native_tests on this machine) and the portable one.
  for (const std::uint64_t offset : {std::uint64_t{0}, std::uint64_t{5}, (std::uint64_t{1} << 32) - 7}) {
    const std::uint64_t seed = 0x123456789abcdefULL;
    std::uint32_t words[4 * detail::kPhiloxLanes], portable[4 * detail::kPhiloxLanes];
    detail::philox_blocks(seed, offset, words);
    detail::philox_blocks_portable(seed, offset, portable);
    for (int k = 0; k < detail::kPhiloxLanes; ++k) {
      const auto one = detail::philox_block(seed, offset + static_cast<std::uint64_t>(k));
      for (int w = 0; w < 4; ++w) {
        CHECK(words[4 * k + w] == one[static_cast<std::size_t>(w)]);
        CHECK(portable[4 * k + w] == one[static_cast<std::size_t>(w)]);
      }
    }
    const Generator::State state{seed, offset};
    // Ranges with ragged starts and ends, shorter and longer than one batch of lanes.
    for (const auto& [first, last] : std::vector<std::pair<std::uint64_t, std::uint64_t>>{
             {0, 3}, {1, 70}, {3, 200}, {64, 128}, {7, 7}, {5, 333}, {2, 1031}, {250, 515}}) {
      std::vector<std::uint64_t> seen;
      detail::for_each_uniform24(state, first, last, [&](std::uint64_t i, float u) {
        seen.push_back(i);
        const auto block = detail::philox_block(seed, offset + i / 4);
        CHECK(u == static_cast<float>(block[i % 4] >> 8) * 0x1.0p-24f);
      });
      REQUIRE(seen.size() == last - first);
      for (std::size_t j = 0; j < seen.size(); ++j) CHECK(seen[j] == first + j);
    }
  }
}

TEST_CASE("philox: the batched kernels match one block at a time at every carry position and seed",
          "[core][random]") {
  // Each lane's low counter word wrapping (first = 2^32 - j for every j a batch spans, and the
  // counter's top word wrapping too), under seeds that set the key's high and low bits.
  std::vector<std::uint64_t> offsets{1, 1000003, std::uint64_t{0xfffffffffffffff0ULL}};
  for (std::uint64_t j = 0; j <= static_cast<std::uint64_t>(detail::kPhiloxLanes); ++j)
    offsets.push_back((std::uint64_t{1} << 32) - j);
  constexpr int kMaxLanes = detail::kPhiloxLanes * detail::kPhiloxMaxBatches;
  for (std::uint64_t j = 0; j <= static_cast<std::uint64_t>(kMaxLanes); j += 5)
    offsets.push_back((std::uint64_t{1} << 32) - j);
  std::vector<int> mismatches(detail::kPhiloxMaxBatches + 1, 0);
  const std::uint64_t seeds[] = {0, 42, ~std::uint64_t{0}, 0xdeadbeef00000000ULL};
  for (const std::uint64_t seed : seeds)
    for (const std::uint64_t offset : offsets)
      for (int batches = 1; batches <= detail::kPhiloxMaxBatches; ++batches) {
        std::uint32_t words[4 * kMaxLanes];
        detail::philox_blocks(seed, offset, words, batches);
        for (int k = 0; k < batches * detail::kPhiloxLanes; ++k) {
          const auto one = detail::philox_block(seed, offset + static_cast<std::uint64_t>(k));
          for (std::size_t w = 0; w < 4; ++w)
            mismatches[static_cast<std::size_t>(batches)] += words[4 * static_cast<std::size_t>(k) + w] != one[w];
        }
      }
  CHECK(mismatches == std::vector<int>(detail::kPhiloxMaxBatches + 1, 0));
}

TEST_CASE("generator: state is (seed, offset) and restoring it replays the numbers", "[core][random]") {
  Generator g(42);
  const Tensor a = rand({3, 5}, g);
  CHECK(g.state() == Generator::State{42, 4});  // 15 floats = 4 blocks of four
  const Generator::State mid = g.state();
  const Tensor b = randn({7}, g);
  g.set_state(mid);
  const Tensor c = randn({7}, g);
  CHECK(test::values(b) == test::values(c));
  Generator h(42);
  CHECK(test::values(rand({3, 5}, h)) == test::values(a));
  Generator other(43);
  CHECK(test::values(rand({3, 5}, other)) != test::values(a));
}

TEST_CASE("generator: uniforms lie in the unit interval and normals have unit moments", "[core][random]") {
  Generator g(7);
  const DoubleTensor u = rand<double>({100000}, g);
  CHECK(detail::flat(u).minCoeff() >= 0.0);
  CHECK(detail::flat(u).maxCoeff() < 1.0);
  CHECK(detail::flat(u).mean() == Approx(0.5).margin(0.01));
  const DoubleTensor n = randn<double>({100000}, g);
  const double mean = detail::flat(n).mean();
  const double var = (detail::flat(n) - mean).square().mean();
  CHECK(mean == Approx(0.0).margin(0.01));  // 3 sigma of the sample mean is ~0.0095
  CHECK(var == Approx(1.0).margin(0.02));
}

TEST_CASE("generator: the default generator is reseeded by manual_seed", "[core][random]") {
  manual_seed(5);
  const Tensor a = randn({4});
  manual_seed(5);
  CHECK(test::values(randn({4})) == test::values(a));
}

TEST_CASE("randint: draws integers from low up to high and rejects an empty range", "[core][random]") {
  Generator g(1);
  const LongTensor t = randint(3, 9, {1000}, g);
  for (std::int64_t v : t.to_vector()) {
    CHECK(v >= 3);
    CHECK(v < 9);
  }
  REQUIRE_ERROR(randint(4, 4, {2}, g), "randint", "[4, 4)");
}
