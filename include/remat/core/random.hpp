#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). The whole state of a
// Generator is (seed, offset): a snapshot is two integers, restoring it replays every number
// exactly, and the numbers do not depend on the thread count. Checkpoint replay relies on this.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace remat {

namespace detail {

/// One Philox4x32-10 block: 10 rounds of two 32x32->64 multiplies and a Weyl-sequence key bump.
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> ctr,
                                                  std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{kMul0} * ctr[0];
    const std::uint64_t p1 = std::uint64_t{kMul1} * ctr[2];
    ctr = {static_cast<std::uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<std::uint32_t>(p1),
           static_cast<std::uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<std::uint32_t>(p0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

}  // namespace detail

class Generator {
 public:
  struct State {
    std::uint64_t seed = 0;
    std::uint64_t offset = 0;  ///< blocks of 128 random bits consumed so far
    bool operator==(const State& o) const { return seed == o.seed && offset == o.offset; }
    bool operator!=(const State& o) const { return !(*this == o); }
  };

  explicit Generator(std::uint64_t seed = 0) : state_{seed, 0} {}

  State state() const { return state_; }
  void set_state(State s) { state_ = s; }
  void manual_seed(std::uint64_t seed) { state_ = {seed, 0}; }
  std::uint64_t seed() const { return state_.seed; }

  /// The next 128 random bits.
  std::array<std::uint32_t, 4> next_block() {
    const std::uint64_t c = state_.offset++;
    return detail::philox4x32_10(
        {static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32), 0u, 0u},
        {static_cast<std::uint32_t>(state_.seed), static_cast<std::uint32_t>(state_.seed >> 32)});
  }

  /// n uniforms in [0, 1): floats take 24 bits each (4 per block), doubles 53 bits (2 per block).
  template <class T>
  void uniform(T* out, std::size_t n) {
    static_assert(std::is_floating_point_v<T>, "uniform: floating-point output only");
    std::size_t i = 0;
    while (i < n) {
      const auto b = next_block();
      if constexpr (std::is_same_v<T, float>) {
        for (int k = 0; k < 4 && i < n; ++k, ++i) out[i] = static_cast<float>(b[k] >> 8) * 0x1.0p-24f;
      } else {
        for (int k = 0; k < 4 && i < n; k += 2, ++i) {
          const std::uint64_t bits = (std::uint64_t{b[k]} << 32 | b[k + 1]) >> 11;
          out[i] = static_cast<T>(bits) * static_cast<T>(0x1.0p-53);
        }
      }
    }
  }

  /// n standard normals by Box-Muller on pairs of uniforms from (0, 1].
  template <class T>
  void normal(T* out, std::size_t n) {
    static_assert(std::is_floating_point_v<T>, "normal: floating-point output only");
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    std::size_t i = 0;
    while (i < n) {
      const auto b = next_block();
      for (int k = 0; k < 4 && i < n; k += 2) {
        const double u1 = (static_cast<double>(b[k]) + 1.0) * 0x1.0p-32;  // (0, 1]: log is finite
        const double u2 = static_cast<double>(b[k + 1]) * 0x1.0p-32;
        const double r = std::sqrt(-2.0 * std::log(u1));
        out[i++] = static_cast<T>(r * std::cos(kTwoPi * u2));
        if (i < n) out[i++] = static_cast<T>(r * std::sin(kTwoPi * u2));
      }
    }
  }

 private:
  State state_;
};

/// The generator ops draw from when none is given: one per thread, seeded 0 until manual_seed.
inline Generator& default_generator() {
  thread_local Generator generator(0);
  return generator;
}

inline void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace remat
