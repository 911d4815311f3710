#pragma once
// FNV-1a, 64-bit: the one hash of bytes the library uses (a replay's values against its forward's,
// a step's op sequence, a training-state file's checksum). Not cryptographic: it detects drift and
// damage, not tampering.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace remat::detail {

inline constexpr std::uint64_t kFnvOffset = 1469598103934665603ull;

/// h folded with one value (a byte, or any integer taken whole).
inline std::uint64_t fnv1a_mix(std::uint64_t h, std::uint64_t v) { return (h ^ v) * 1099511628211ull; }

/// h folded with n bytes.
inline std::uint64_t fnv1a(const void* bytes, std::size_t n, std::uint64_t h = kFnvOffset) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  for (std::size_t i = 0; i < n; ++i) h = fnv1a_mix(h, p[i]);
  return h;
}

/// A checksum of n bytes at memory speed (the offload store's files): FNV-1a's step over 64-bit
/// words in four independent lanes, so the multiplies overlap, then the tail byte by byte. Another
/// function than fnv1a (its values differ), with the same purpose: damage, not tampering.
inline std::uint64_t checksum64(const void* bytes, std::size_t n, std::uint64_t h = kFnvOffset) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  std::uint64_t lane[4] = {h, h ^ 1, h ^ 2, h ^ 3};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = fnv1a_mix(lane[k], w);
    }
  std::uint64_t out = fnv1a_mix(h, n);
  for (std::uint64_t v : lane) out = fnv1a_mix(out, v);
  return fnv1a(p + i, n - i, out);
}

}  // namespace remat::detail
