#pragma once
// FNV-1a, 64-bit: the one hash of bytes the library uses (a replay's values against its forward's,
// a step's op sequence, a training-state file's checksum). Not cryptographic: it detects drift and
// damage, not tampering.

#include <cstddef>
#include <cstdint>

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

}  // namespace remat::detail
