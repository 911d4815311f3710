#pragma once
// The binomial (Revolve) schedule: Griewank's minimum count of step executions for s snapshots,
// its closed-form split, and the schedule as a stream of O(s) state.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/schedule/action_stream.hpp"
#include "remat/core/error.hpp"

namespace remat {
namespace detail {

/// β(s, r) = C(s + r, s), saturating instead of overflowing.
inline std::uint64_t beta(std::int64_t s, std::int64_t r) {
  if (s < 0 || r < 0) return 0;
  std::uint64_t b = 1;
  for (std::int64_t i = 1; i <= r; ++i) {
    const std::uint64_t num = b * static_cast<std::uint64_t>(s + i);
    if (b != 0 && num / b != static_cast<std::uint64_t>(s + i)) return std::numeric_limits<std::uint64_t>::max();
    b = num / static_cast<std::uint64_t>(i);
  }
  return b;
}

/// The least r with β(s, r) ≥ l: how often the busiest step runs when s slots reverse l steps.
inline std::int64_t binomial_repetitions(std::int64_t l, std::int64_t s) {
  std::int64_t r = 0;
  std::uint64_t b = 1;  // β(s, r), stepped as β(s, r) = β(s, r − 1)·(s + r)/r (exact: a binomial)
  while (b < static_cast<std::uint64_t>(l)) {
    ++r;
    const std::uint64_t f = static_cast<std::uint64_t>(s + r);
    if (b > std::numeric_limits<std::uint64_t>::max() / f) return r;  // β(s, r) ≥ 2^64 / (s + r) > any l
    b = b * f / static_cast<std::uint64_t>(r);
  }
  return r;
}

}  // namespace detail

// Derivation of the binomial schedule (Griewank 1992; Griewank & Walther, "Algorithm 799: Revolve").
// Reverse l steps holding x_0 in one of s snapshot slots, the position at x_0; the last step to be
// reversed is run recorded, so the count F(l, s) is of advances (non-recording executions).
//   • l = 1: record and reverse step 0: F(1, s) = 0.
//   • s = 1: only x_0 is kept, so each step j is reached again from x_0: F(l, 1) = Σ_{j<l} j = l(l−1)/2.
//   • otherwise pick m, advance to x_m (m executions) and snapshot it; reverse [m, l) with s − 1 free
//     slots (x_0 still occupies one), then free x_m, restore x_0 and reverse [0, m) with all s slots:
//         F(l, s) = min_{0<m<l} { m + F(l − m, s − 1) + F(m, s) }.
// The minimum has a closed form. Count repetitions: β(s, r) = C(s + r, s) is the longest chain
// that s slots reverse with no step run more than r times. Proof of β(s, r) = β(s, r − 1) +
// β(s − 1, r) (Pascal's rule, hence the binomial): place the first snapshot at m; the steps before
// m were already run once to reach x_m, so the prefix has r − 1 repetitions left with s slots, and
// the suffix has r repetitions with s − 1 slots. With r the least integer such that β(s, r) ≥ l,
// summing the split recurrence gives Griewank's count (Prop. 1 of his 1992 paper)
//   F(l, s) = r·l − β(s + 1, r − 1),
// i.e. every step runs r times except for β(s + 1, r − 1) executions that the slack between l and
// β(s, r) saves. The split cost m + F(l − m, s − 1) + F(m, s) is convex in m (F is convex in l),
// so the smallest optimal m is well defined; binomial_split gives it in closed form, and the tests check that the
// emitted schedule's advance count equals the closed form for every l ≤ 200, s ≤ 12.

/// Griewank's minimum number of non-recording step executions to reverse l steps with s
/// snapshots (the chain's input counting as one), the last step recorded directly:
/// F(l, s) = r·l − β(s+1, r−1), r the least integer with β(s, r) ≥ l.
inline std::int64_t binomial_min_advances(std::int64_t l, std::int64_t s) {
  REMAT_CHECK(l >= 1 && s >= 1, "binomial_min_advances: needs l >= 1 and s >= 1, got l = {}, s = {}", l, s);
  if (s == 1) return l * (l - 1) / 2;  // r = l − 1 repetitions: a closed form instead of l iterations
  std::int64_t r = 0;
  if (s == 2) {  // β(2, r) = (r + 1)(r + 2)/2 ≥ l: start from the root of the quadratic, then correct
    r = std::max<std::int64_t>(0, static_cast<std::int64_t>(std::sqrt(2.0 * static_cast<double>(l))) - 2);
    while (static_cast<std::uint64_t>((r + 1) * (r + 2) / 2) < static_cast<std::uint64_t>(l)) ++r;
  } else {
    r = detail::binomial_repetitions(l, s);
  }
  return r * l - static_cast<std::int64_t>(detail::beta(s + 1, r - 1));
}

namespace detail {

/// β(s', r') for every s' ≤ s and r' ≤ r: a split only ever needs these, since r never grows
/// down the recursion (the suffix keeps at most r repetitions, the prefix at most r − 1). With
/// C(s + r, s) ≈ l, (s + 1)(r + 1) entries is a few hundred for the usual s (s = 20, l = 10^6: r = 6).
class BinomialTable {
 public:
  BinomialTable(std::int64_t s, std::int64_t r) : r_(r) {
    table_.resize(static_cast<std::size_t>((s + 1) * (r + 1)));
    for (std::int64_t i = 0; i <= s; ++i)
      for (std::int64_t j = 0; j <= r; ++j) table_[static_cast<std::size_t>(i * (r + 1) + j)] = beta(i, j);
  }
  /// β(s, r), 0 for r < 0.
  std::uint64_t operator()(std::int64_t s, std::int64_t r) const {
    return r < 0 ? 0 : table_[static_cast<std::size_t>(s * (r_ + 1) + r)];
  }
  std::size_t bytes() const { return table_.capacity() * sizeof(std::uint64_t); }
  /// The least r' ≤ r with β(s, r') ≥ l, given that β(s, r) ≥ l.
  std::int64_t repetitions(std::int64_t l, std::int64_t s, std::int64_t r) const {
    while (r > 0 && (*this)(s, r - 1) >= static_cast<std::uint64_t>(l)) --r;
    return r;
  }

 private:
  std::int64_t r_;
  std::vector<std::uint64_t> table_;
};

/// Where the binomial reversal of l steps with s > 1 slots places its first snapshot: the
/// smallest m minimising m + F(l − m, s − 1) + F(m, s). With r = binomial_repetitions(l, s), the
/// prefix [0, m) must be reversible with r − 1 repetitions and s slots and the suffix with r and
/// s − 1, and the smallest such m is
///   m = max(1, β(s, r − 2), l − β(s − 1, r))
/// — equal to the bisection on the (convex) split cost for every l < 1500, s ≤ 12, and the tests
/// check the schedules it makes against that search action for action. A closed form: no search,
/// which is what lets a million-step schedule stream in milliseconds.
inline std::int64_t binomial_split(std::int64_t l, std::int64_t s, std::int64_t r, const BinomialTable& beta_of) {
  const auto cap = [&](std::uint64_t v) { return static_cast<std::int64_t>(std::min<std::uint64_t>(v, static_cast<std::uint64_t>(l))); };
  return std::max<std::int64_t>({1, cap(beta_of(s, r - 2)), l - cap(beta_of(s - 1, r))});
}

/// The binomial (Revolve) schedule as a stream: the recursion
///   reverse(start, end, s): advance to start + m, snapshot it, reverse(start + m, end, s − 1),
///                           free it, restore start, reverse(start, start + m, s)
/// run on an explicit stack. The second call is a tail call (the frame is reused), so the stack
/// holds at most s frames: O(s) state for any chain length.
class BinomialStream final : public ActionStream {
 public:
  /// `disk_depth`: snapshots taken at recursion depth below it (x_0 is depth 0, each nested
  /// suffix one deeper) go to disk. The shallow ones are restored least — a frame with s' slots
  /// restores its snapshot once per split of its prefix, and deeper frames, with fewer slots,
  /// split more often relative to their length — so they are the cheapest to keep on disk.
  BinomialStream(std::int64_t L, std::int64_t s, std::int64_t disk_depth = 0)
      : L_(L), s_(s), r_(s > 1 ? binomial_repetitions(L, s) : 0), disk_depth_(disk_depth), beta_(s > 1 ? s : 0, r_) {
    stack_.reserve(static_cast<std::size_t>(std::min(s, L)) + 1);  // the deepest the recursion goes
  }

  std::size_t state_bytes() const override {
    return sizeof(*this) + stack_.capacity() * sizeof(Frame) + beta_.bytes() + note_.capacity();
  }
  std::string note() const override { return note_; }
  /// What the plan should say about this schedule (e.g. why a policy chose it).
  BinomialStream& with_note(std::string note) {
    note_ = std::move(note);
    return *this;
  }
  bool next(Action& out) override {
    if (buffered_ == used_) {
      buffered_ = emit(buffer_.data());
      used_ = 0;
      if (buffered_ == 0) return false;
    }
    out = buffer_[used_++];
    return true;
  }
  std::size_t next(Action* out, std::size_t n) override {
    std::size_t k = 0;
    while (k < n && used_ < buffered_) out[k++] = buffer_[used_++];
    while (n - k >= kBurst) {
      const std::size_t got = emit(out + k);
      if (got == 0) return k;
      k += got;
    }
    while (k < n && next(out[k])) ++k;
    return k;
  }

 private:
  static constexpr std::size_t kBurst = 4;  // the most actions one emit() writes

  struct Frame {
    std::int64_t start, end, s;
    std::int64_t r = 0;  // repetitions (s > 1)
    std::int64_t m = 0;  // the split, once chosen
    std::int64_t j = 0;  // s == 1: the step being reached
    int phase = 0;
  };

  void push(std::int64_t start, std::int64_t end, std::int64_t s, std::int64_t r) {
    stack_.push_back(Frame{start, end, s, r, 0, end - 1, 0});
  }

  /// Writes the next one to kBurst actions (a run the recursion always emits together); 0 at the end.
  std::size_t emit(Action* out) {
    using K = Action::Kind;
    if (stack_.empty()) {
      if (stage_ == 0) {
        stage_ = 1;
        push(0, L_, s_, r_);
        out[0] = {K::snapshot, 0, 1, disk_depth_ > 0};
        return 1;
      }
      if (stage_ == 1) {
        stage_ = 2;
        out[0] = {K::free, 0};
        return 1;
      }
      return 0;
    }
    Frame& f = stack_.back();
    if (f.end - f.start == 1) {  // record and reverse the one step
      out[0] = {K::record, f.start};
      out[1] = {K::reverse, f.start};
      stack_.pop_back();
      return 2;
    }
    if (f.s == 1) {  // only x_start kept: reach each step j from it, newest first
      std::size_t k = 0;
      if (f.j != f.end - 1) out[k++] = {K::restore, f.start};
      if (f.j > f.start) out[k++] = {K::advance, f.start, f.j - f.start};
      out[k++] = {K::record, f.j};
      out[k++] = {K::reverse, f.j};
      if (f.j == f.start) stack_.pop_back();
      else --f.j;
      return k;
    }
    if (f.phase == 0) {  // advance to the split and keep it
      f.m = binomial_split(f.end - f.start, f.s, f.r, beta_);
      const std::int64_t child = f.start + f.m;
      out[0] = {K::advance, f.start, f.m};
      out[1] = {K::snapshot, child, 1, static_cast<std::int64_t>(stack_.size()) < disk_depth_};
      f.phase = 1;
      if (f.end - child == 1) {  // a one-step suffix: recorded and reversed here, no frame
        out[2] = {K::record, child};
        out[3] = {K::reverse, child};
        return 4;
      }
      const std::int64_t end = f.end, s = f.s - 1, r = beta_.repetitions(end - child, s, f.r);
      push(child, end, s, r);  // f is not used after this (push may move it)
      return 2;
    }
    // The suffix is reversed: drop its snapshot, go back to start, and reverse the prefix
    // [start, start + m) with all s slots — a tail call, reusing the frame.
    out[0] = {K::free, f.start + f.m};
    out[1] = {K::restore, f.start};
    f.end = f.start + f.m;
    f.r = f.r > 0 ? beta_.repetitions(f.m, f.s, f.r - 1) : 0;
    f.j = f.end - 1;
    f.m = 0;
    f.phase = 0;
    return 2;
  }

  std::int64_t L_, s_, r_, disk_depth_;
  BinomialTable beta_;
  std::string note_;
  int stage_ = 0;  // 0: before the first snapshot, 1: reversing, 2: after the final free
  std::vector<Frame> stack_;
  std::array<Action, kBurst> buffer_{};
  std::size_t buffered_ = 0, used_ = 0;
};

}  // namespace detail
}  // namespace remat
