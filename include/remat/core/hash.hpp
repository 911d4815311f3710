#pragma once
// FNV-1a, 64-bit: the hash of short byte strings and of what must stay stable (a step's op
// sequence, a training-state file's checksum); and checksum64, its four-lane form at memory speed,
// for tensors' bytes (a replay's values against its forward's, the files activations and a chain's
// snapshots go to). Not cryptographic: they detect drift and damage, not tampering.

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

/// checksum64's loop, copying the bytes to `to` as it reads them when kCopy (one pass over memory
/// instead of a copy and then a second read).
template <bool kCopy>
std::uint64_t checksum64_pass(unsigned char* to, const unsigned char* p, std::size_t n, std::uint64_t h) {
  // Four lanes in four variables, not an array: GCC at -O2 keeps an array in memory, and the
  // store-to-load round trip each step then halves the speed.
  std::uint64_t l0 = h, l1 = h ^ 1, l2 = h ^ 2, l3 = h ^ 3;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p + i, 32);
    if constexpr (kCopy) std::memcpy(to + i, w, 32);
    l0 = fnv1a_mix(l0, w[0]);
    l1 = fnv1a_mix(l1, w[1]);
    l2 = fnv1a_mix(l2, w[2]);
    l3 = fnv1a_mix(l3, w[3]);
  }
  if constexpr (kCopy) std::memcpy(to + i, p + i, n - i);
  const std::uint64_t out = fnv1a_mix(fnv1a_mix(fnv1a_mix(fnv1a_mix(fnv1a_mix(h, n), l0), l1), l2), l3);
  return fnv1a(p + i, n - i, out);
}

/// A checksum of n bytes at memory speed (the offload store's and the budget's files): FNV-1a's
/// step over 64-bit words in four independent lanes, so the multiplies overlap, then the tail byte
/// by byte. Another function than fnv1a (its values differ), with the same purpose: damage, not
/// tampering.
inline std::uint64_t checksum64(const void* bytes, std::size_t n, std::uint64_t h = kFnvOffset) {
  return checksum64_pass<false>(nullptr, static_cast<const unsigned char*>(bytes), n, h);
}

/// Copies n bytes from `from` to `to` (not overlapping) and returns checksum64 of them, in one pass.
inline std::uint64_t copy_checksum64(void* to, const void* from, std::size_t n, std::uint64_t h = kFnvOffset) {
  return checksum64_pass<true>(static_cast<unsigned char*>(to), static_cast<const unsigned char*>(from), n, h);
}

}  // namespace remat::detail
