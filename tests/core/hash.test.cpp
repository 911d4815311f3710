#include "support.hpp"

#include "remat/core/hash.hpp"

#include <cstdint>
#include <vector>

using remat::detail::checksum64;
using remat::detail::copy_checksum64;

namespace {

std::vector<unsigned char> pattern(std::size_t n) {
  std::vector<unsigned char> v(n);
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

}  // namespace

// The offload store checksums a file's bytes as it copies them (copy_checksum64) and the budget's
// files with checksum64 alone; a file written one way is read back the other way, so the two must
// agree for every length (the 32-byte loop and the byte tail), every alignment and every chunking.
TEST_CASE("hash: copy_checksum64 copies exactly n bytes and gives checksum64 of them", "[core][hash]") {
  const std::vector<unsigned char> src = pattern(4096 + 64);
  for (std::size_t offset : {0, 1, 7, 32}) {
    for (std::size_t n = 0; n <= 200; ++n) {
      std::vector<unsigned char> dst(n + 80, 0xAB);
      const std::uint64_t h = copy_checksum64(dst.data() + 3, src.data() + offset, n);
      REQUIRE(h == checksum64(src.data() + offset, n));
      for (std::size_t i = 0; i < dst.size(); ++i) {
        const bool inside = i >= 3 && i < 3 + n;
        REQUIRE(dst[i] == (inside ? src[offset + i - 3] : 0xAB));
      }
    }
  }
  // Chained over pieces, as a file is read a staging buffer at a time.
  const std::vector<unsigned char> big = pattern((std::size_t{1} << 20) + 13);
  std::vector<unsigned char> copy(big.size());
  std::uint64_t whole = remat::detail::kFnvOffset, copied = remat::detail::kFnvOffset;
  for (std::size_t done = 0; done < big.size(); done += 100000) {
    const std::size_t n = std::min<std::size_t>(100000, big.size() - done);
    whole = checksum64(big.data() + done, n, whole);
    copied = copy_checksum64(copy.data() + done, big.data() + done, n, copied);
  }
  CHECK(copied == whole);
  CHECK(copy == big);
}

TEST_CASE("hash: checksum64 sees a one-bit change anywhere, and the length", "[core][hash]") {
  std::vector<unsigned char> bytes = pattern(203);
  const std::uint64_t base = checksum64(bytes.data(), bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i)
    for (int bit : {0, 7}) {
      bytes[i] ^= static_cast<unsigned char>(1u << bit);
      REQUIRE(checksum64(bytes.data(), bytes.size()) != base);
      bytes[i] ^= static_cast<unsigned char>(1u << bit);
    }
  CHECK(checksum64(bytes.data(), bytes.size()) == base);
  const std::vector<unsigned char> zeros(64, 0);
  CHECK(checksum64(zeros.data(), 32) != checksum64(zeros.data(), 64));  // zeros appended are seen
}
