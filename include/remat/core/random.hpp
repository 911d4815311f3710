#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). The whole state of a
// Generator is (seed, offset): a snapshot is two integers, restoring it replays every number
// exactly, and the numbers do not depend on the thread count. Checkpoint replay relies on this.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "remat/core/session.hpp"

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

/// Block `block` of the Philox stream keyed by `seed`.
inline std::array<std::uint32_t, 4> philox_block(std::uint64_t seed, std::uint64_t block) {
  return philox4x32_10({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), 0u, 0u},
                       {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
}

/// Blocks generated together by philox_blocks: enough lanes to fill the widest vector registers.
inline constexpr int kPhiloxLanes = 16;

/// Blocks [first, first + kPhiloxLanes) of the stream keyed by `seed`, in stream order: word w of
/// block first + k lands in words[4k + w] (4 · kPhiloxLanes words). The same arithmetic as
/// philox4x32_10, lane by lane, as loops over the lanes so that the compiler turns each into vector
/// multiplies: one block at a time, Philox was a fifth of a training step with dropout.
inline void philox_blocks_portable(std::uint64_t seed, std::uint64_t first, std::uint32_t* words) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int k = 0; k < kPhiloxLanes; ++k) {
    const std::uint64_t block = first + static_cast<std::uint64_t>(k);
    c0[k] = static_cast<std::uint32_t>(block);
    c1[k] = static_cast<std::uint32_t>(block >> 32);
    c2[k] = 0u;
    c3[k] = 0u;
  }
  std::uint32_t key0 = static_cast<std::uint32_t>(seed), key1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    // Not unrolled: GCC unrolls a 16-trip loop completely, and then no longer vectorizes it.
#pragma GCC unroll 1
    for (int k = 0; k < kPhiloxLanes; ++k) {
      const std::uint64_t p0 = std::uint64_t{kMul0} * c0[k];
      const std::uint64_t p1 = std::uint64_t{kMul1} * c2[k];
      const std::uint32_t next0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1[k] ^ key0;
      const std::uint32_t next2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3[k] ^ key1;
      c0[k] = next0;
      c1[k] = static_cast<std::uint32_t>(p1);
      c2[k] = next2;
      c3[k] = static_cast<std::uint32_t>(p0);
    }
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  for (int k = 0; k < kPhiloxLanes; ++k) {
    words[4 * k] = c0[k];
    words[4 * k + 1] = c1[k];
    words[4 * k + 2] = c2[k];
    words[4 * k + 3] = c3[k];
  }
}

#if defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics fill their unused merge operand from a self-initialised variable,
// which its uninitialised-use analysis flags in every caller (GCC bug 105593, fixed in 13): the
// warning is in the compiler's header, not here, and -Werror users would trip on it. GCC's alone:
// clang reads `#pragma GCC` too and warns of the group it does not know (-Wunknown-warning-option).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/// philox_blocks_portable's words for Batches × 16 lanes, one counter word of 16 lanes per
/// register. GCC vectorises the portable loop with VPMULLQ on zero-extended halves (three µops,
/// and a permute to split the product) where Philox needs 32×32→64 products, which VPMULUDQ makes
/// in one µop on the even lanes: two of them (the odd lanes shifted down) and two blends give the
/// 16 high and low halves. A round's products wait on the last round's, so one batch leaves the
/// multipliers idle most of the time; independent batches interleaved fill them (on this Zen 4,
/// words per second against the portable loop: 1 batch 1.35×, 4 batches 5.5×; a dropout mask's
/// draw 2.4× faster in all). Each batch's 16 blocks leave in stream order through a 4×4 transpose
/// of 128-bit lanes.
template <int Batches>
inline void philox_batches_avx512(std::uint64_t seed, std::uint64_t first, std::uint32_t* words) {
  static_assert(kPhiloxLanes == 16, "one 512-bit register of 32-bit counters a batch");
  const auto word = [](std::uint64_t v, int shift) { return static_cast<int>(static_cast<std::uint32_t>(v >> shift)); };
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i c0[Batches], c1[Batches], c2[Batches], c3[Batches];
  for (int b = 0; b < Batches; ++b) {
    const std::uint64_t batch_first = first + static_cast<std::uint64_t>(16 * b);
    const __m512i first_lo = _mm512_set1_epi32(word(batch_first, 0));
    c0[b] = _mm512_add_epi32(first_lo, lane);
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0[b], first_lo);  // the block's low word wrapped
    const __m512i first_hi = _mm512_set1_epi32(word(batch_first, 32));
    c1[b] = _mm512_mask_add_epi32(first_hi, carry, first_hi, _mm512_set1_epi32(1));
    c2[b] = _mm512_setzero_si512();
    c3[b] = _mm512_setzero_si512();
  }
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  constexpr __mmask16 kOdd = 0xAAAA;
  // hi:lo = a * m per 32-bit lane.
  const auto multiply = [](__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
    const __m512i even = _mm512_mul_epu32(a, m);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    hi = _mm512_mask_blend_epi32(kOdd, _mm512_srli_epi64(even, 32), odd);
    lo = _mm512_mask_blend_epi32(kOdd, even, _mm512_slli_epi64(odd, 32));
  };
  std::uint32_t key0 = static_cast<std::uint32_t>(seed), key1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i k0 = _mm512_set1_epi32(static_cast<int>(key0)), k1 = _mm512_set1_epi32(static_cast<int>(key1));
    for (int b = 0; b < Batches; ++b) {
      __m512i hi0, lo0, hi1, lo1;
      multiply(c0[b], mul0, hi0, lo0);
      multiply(c2[b], mul1, hi1, lo1);
      c0[b] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[b]), k0);
      c2[b] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[b]), k1);
      c1[b] = lo1;
      c3[b] = lo0;
    }
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  for (int b = 0; b < Batches; ++b) {
    // Per 128-bit lane L: rB holds block 4L + B's four words.
    const __m512i x = _mm512_unpacklo_epi32(c0[b], c1[b]), y = _mm512_unpackhi_epi32(c0[b], c1[b]);
    const __m512i z = _mm512_unpacklo_epi32(c2[b], c3[b]), w = _mm512_unpackhi_epi32(c2[b], c3[b]);
    const __m512i r0 = _mm512_unpacklo_epi64(x, z), r1 = _mm512_unpackhi_epi64(x, z);
    const __m512i r2 = _mm512_unpacklo_epi64(y, w), r3 = _mm512_unpackhi_epi64(y, w);
    const __m512i s0 = _mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(1, 0, 1, 0));  // blocks 0 4 1 5
    const __m512i s1 = _mm512_shuffle_i32x4(r2, r3, _MM_SHUFFLE(1, 0, 1, 0));  // 2 6 3 7
    const __m512i s2 = _mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(3, 2, 3, 2));  // 8 12 9 13
    const __m512i s3 = _mm512_shuffle_i32x4(r2, r3, _MM_SHUFFLE(3, 2, 3, 2));  // 10 14 11 15
    std::uint32_t* out = words + 64 * b;
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(s2, s3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(s2, s3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// The most batches of kPhiloxLanes blocks philox_blocks makes in one call.
inline constexpr int kPhiloxMaxBatches = 4;

/// Blocks [first, first + batches · kPhiloxLanes) of the stream keyed by `seed`, in
/// philox_blocks_portable's layout (4 · kPhiloxLanes words a batch), 1 ≤ batches ≤
/// kPhiloxMaxBatches: the AVX-512 kernel when the build targets it, the same words either way.
inline void philox_blocks(std::uint64_t seed, std::uint64_t first, std::uint32_t* words, int batches = 1) {
#if defined(__AVX512F__)
  switch (batches) {
    case 1: return philox_batches_avx512<1>(seed, first, words);
    case 2: return philox_batches_avx512<2>(seed, first, words);
    case 3: return philox_batches_avx512<3>(seed, first, words);
    default: return philox_batches_avx512<kPhiloxMaxBatches>(seed, first, words);
  }
#else
  for (int b = 0; b < batches; ++b)
    philox_blocks_portable(seed, first + static_cast<std::uint64_t>(b * kPhiloxLanes), words + 4 * kPhiloxLanes * b);
#endif
}

}  // namespace detail

class Generator;
namespace detail {
struct GeneratorState;
void note_draw(const std::shared_ptr<GeneratorState>& generator);
}  // namespace detail

/// A counter-based (Philox) random generator: its whole state is a seed and a count of blocks used,
/// so saving the state and restoring it replays the same draws (what checkpoint replays rely on).
/// Every draw is reported to the thread's draw recorders (detail::RecordDraws), so a checkpoint
/// restores each generator its segment drew from, not only the default one. A copy is a new
/// generator (at the same state); assigning one to another copies the state, not the identity.
class Generator {
 public:
  /// Everything a generator is: restoring it repeats the draws that followed.
  struct State {
    /// The key the Philox rounds use.
    std::uint64_t seed = 0;
    std::uint64_t offset = 0;  ///< blocks of 128 random bits consumed so far
    /// Same seed and offset.
    bool operator==(const State& o) const { return seed == o.seed && offset == o.offset; }
    /// Not operator==.
    bool operator!=(const State& o) const { return !(*this == o); }
  };

  /// A generator at the start of `seed`'s stream.
  explicit Generator(std::uint64_t seed = 0);
  /// A new generator at `other`'s state: drawing from one does not advance the other.
  Generator(const Generator& other);
  /// Takes `other`'s state; this generator stays the one a checkpoint noted.
  Generator& operator=(const Generator& other);

  /// The current state, to restore later with set_state.
  State state() const;
  /// Resumes from a state taken by state().
  void set_state(State s);
  /// Restarts at the beginning of `seed`'s stream (as torch.manual_seed).
  void manual_seed(std::uint64_t seed) { set_state({seed, 0}); }
  /// The seed of the current stream.
  std::uint64_t seed() const { return state().seed; }

  /// The next 128 random bits.
  std::array<std::uint32_t, 4> next_block();

  /// Takes the next `blocks` blocks for a draw the caller makes itself from the state returned
  /// (the state at entry): what random ops call, so that the draw is reported like any other.
  State take(std::uint64_t blocks);

  /// The state itself, for a scoped restore (ScopedValue) around a replay.
  State& state_slot();

  /// n uniforms in [0, 1): floats follow the element rule of for_each_uniform24 (4 per block),
  /// doubles take 53 bits each (2 per block).
  template <class T>
  void uniform(T* out, std::size_t n);

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
  std::shared_ptr<detail::GeneratorState> state_;
};

namespace detail {

/// A generator's state, owned by the generator; a DrawnGenerators entry watches it weakly, so a
/// generator destroyed before the backward is simply not restored (a segment that makes its own
/// generator makes it afresh in the replay).
struct GeneratorState {
  Generator::State value;
};

/// The generators a computation drew from, each with its state at the first draw: what a replay
/// sets them to so that it draws the same numbers. Filled while a RecordDraws lives. The thread's
/// default generator is not among them: checkpoints and chains save its state at their start
/// whatever they draw (a chain stores a step's states compactly, and most steps draw from it).
class DrawnGenerators {
 public:
  struct Entry {
    std::weak_ptr<GeneratorState> generator;
    const GeneratorState* id;  // stays unique while `generator` watches it (one allocation)
    Generator::State at_first_draw;
  };

  /// Notes `generator` at its current state unless it is already noted.
  void note(const std::shared_ptr<GeneratorState>& generator) {
    for (const Entry& e : entries_)
      if (e.id == generator.get()) return;
    entries_.push_back({generator, generator.get(), generator->value});
  }
  bool empty() const { return entries_.empty(); }
  std::size_t size() const { return entries_.size(); }
  const std::vector<Entry>& entries() const { return entries_; }
  /// Sets every generator still alive back to its state at the first draw, for good.
  void rewind() const {
    for (const Entry& e : entries_)
      if (auto g = e.generator.lock()) g->value = e.at_first_draw;
  }

 private:
  std::vector<Entry> entries_;
};

/// RAII: while it lives, every generator drawn from on this thread is noted in `log`, and in the
/// logs of the recorders outside it (a segment nested in another is part of the outer's replay).
class RecordDraws {
 public:
  explicit RecordDraws(DrawnGenerators& log) : log_(log), installed_(this) {}
  RecordDraws(const RecordDraws&) = delete;
  RecordDraws& operator=(const RecordDraws&) = delete;

  void note(const std::shared_ptr<GeneratorState>& generator) {
    for (RecordDraws* r = this; r; r = r->installed_.kept()) r->log_.note(generator);
  }

 private:
  DrawnGenerators& log_;
  Install<&Session::draw_recorder> installed_;  // kept(): the recorder outside this one
};

/// RAII: every generator of `log` still alive is at its state at the first draw while it lives,
/// and back where it was afterwards (so a backward does not disturb the caller's random streams).
class RestoreDraws {
 public:
  explicit RestoreDraws(const DrawnGenerators& log) {
    for (const DrawnGenerators::Entry& e : log.entries())
      if (auto g = e.generator.lock()) {
        saved_.push_back({g, g->value});
        g->value = e.at_first_draw;
      }
  }
  ~RestoreDraws() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->first->value = it->second;
  }
  RestoreDraws(const RestoreDraws&) = delete;
  RestoreDraws& operator=(const RestoreDraws&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<GeneratorState>, Generator::State>> saved_;
};

}  // namespace detail

inline Generator::Generator(std::uint64_t seed)
    : state_(std::make_shared<detail::GeneratorState>(detail::GeneratorState{{seed, 0}})) {}
inline Generator::Generator(const Generator& other)
    : state_(std::make_shared<detail::GeneratorState>(*other.state_)) {}
inline Generator& Generator::operator=(const Generator& other) {
  state_->value = other.state_->value;
  return *this;
}
inline Generator::State Generator::state() const { return state_->value; }
inline void Generator::set_state(State s) { state_->value = s; }
inline std::array<std::uint32_t, 4> Generator::next_block() {
  detail::note_draw(state_);
  return detail::philox_block(state_->value.seed, state_->value.offset++);
}
inline Generator::State Generator::take(std::uint64_t blocks) {
  detail::note_draw(state_);
  const State at_entry = state_->value;
  state_->value.offset += blocks;
  return at_entry;
}
inline Generator::State& Generator::state_slot() { return state_->value; }

namespace detail {

/// The element rule every random float op follows: element i of a draw made at `state` is the
/// 24-bit uniform in word i mod 4 of block state.offset + i/4. Any sub-range [first, last) can be
/// generated on its own (in parallel, or a (batch, head) of an attention mask), and the same state
/// rebuilds the same numbers: dropout, fused attention and Generator::uniform all come here, so
/// they agree by construction. Calls run(i, u, n) for consecutive pieces of the range: u[j] is the
/// uniform of element i + j, j < n ≤ 4·kPhiloxLanes·kPhiloxMaxBatches; a loop over a piece
/// vectorises. A call makes as many batches of lanes as the rest of the range needs, up to the
/// most, so a short range (a causal attention row) draws little past `last` and a long one keeps
/// the multipliers busy.
template <class F>
void for_each_uniform24_run(Generator::State state, std::uint64_t first, std::uint64_t last, F run) {
  constexpr std::uint64_t kRun = 4 * kPhiloxLanes;
  alignas(64) std::uint32_t words[kRun * kPhiloxMaxBatches];
  alignas(64) float u[kRun * kPhiloxMaxBatches];
  for (std::uint64_t i = first; i < last;) {
    const std::uint64_t base = i / 4 * 4;  // element of words[0]
    const std::uint64_t batches = std::min<std::uint64_t>(kPhiloxMaxBatches, (last - base + kRun - 1) / kRun);
    philox_blocks(state.seed, state.offset + base / 4, words, static_cast<int>(batches));
    const std::uint64_t count = batches * kRun;
    for (std::uint64_t j = 0; j < count; ++j) u[j] = static_cast<float>(words[j] >> 8) * 0x1.0p-24f;
    const std::uint64_t end = std::min(last, base + count);
    run(i, u + (i - base), end - i);
    i = end;
  }
}

/// for_each_uniform24_run, one element at a time: f(i, u).
template <class F>
void for_each_uniform24(Generator::State state, std::uint64_t first, std::uint64_t last, F f) {
  for_each_uniform24_run(state, first, last, [&](std::uint64_t i, const float* u, std::uint64_t n) {
    for (std::uint64_t j = 0; j < n; ++j) f(i + j, u[j]);
  });
}

/// Blocks a draw of n float elements consumes.
inline std::uint64_t uniform24_blocks(std::uint64_t n) { return (n + 3) / 4; }

}  // namespace detail

template <class T>
void Generator::uniform(T* out, std::size_t n) {
  static_assert(std::is_floating_point_v<T>, "uniform: floating-point output only");
  if constexpr (std::is_same_v<T, float>) {
    const State at_entry = take(detail::uniform24_blocks(n));
    detail::for_each_uniform24(at_entry, 0, n, [out](std::uint64_t i, float u) { out[i] = u; });
  } else {
    std::size_t i = 0;
    while (i < n) {
      const auto b = next_block();
      for (int k = 0; k < 4 && i < n; k += 2, ++i) {
        const std::uint64_t bits = (std::uint64_t{b[k]} << 32 | b[k + 1]) >> 11;
        out[i] = static_cast<T>(bits) * static_cast<T>(0x1.0p-53);
      }
    }
  }
}

/// The generator ops draw from when none is given: one per thread, seeded 0 until manual_seed.
inline Generator& default_generator() {
  std::shared_ptr<Generator>& generator = detail::session().default_generator;
  if (!generator) generator = std::make_shared<Generator>(0);
  return *generator;
}

/// Reseeds this thread's default generator with `seed`.
inline void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

namespace detail {
inline void note_draw(const std::shared_ptr<GeneratorState>& generator) {
  RecordDraws* r = session().draw_recorder;
  if (r && &generator->value != &default_generator().state_slot()) r->note(generator);
}
}  // namespace detail

}  // namespace remat
