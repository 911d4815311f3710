#pragma once
// Where the snapshots of a chain of unknown length go (OnlinePlacement), decided one state at a
// time, and the reversal that follows (OnlineReversal): the planner under checkpoint/online.hpp's
// OnlineChain, standing on the binomial schedule alone.
//
// Placement. Ending at L with snapshots at p_0 = 0 < p_1 < … < p_K, running and reversing the
// chain costs
//   A(P, L) = (L − 1) + Σ_{j<K} F(p_{j+1} − p_j, s − j) + F(L − 1 − p_K, s − K)
// step executions besides the L recordings, counted as the offline F(L, s) counts them: the
// forward up to the last step, then each interval reversed from its snapshot with the slots the
// earlier ones leave (the last one ends before the step the forward recorded). While slots are
// free every state is kept, and then nothing new until t = s + 2: optimal for every L ≤ s + 2,
// and no placement is optimal for every L beyond (an exhaustive search for s = 2..6, a test). From
// there, reaching x_t the placement either leaves the set alone or drops one snapshot and keeps
// x_t, whichever minimises the worst ratio A(P, H)/F(H, s) over the horizons H ∈ {t + 1, t + 2,
// ⌈1.1 t⌉, ⌈h t⌉}, h = 1.2: the chain is assumed to go on a little longer than it has. The
// horizons were chosen by simulating against the offline optimum (the tests and
// bench_online_ratio give the ratios); a decision costs O(s) evaluations of F.


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/schedule/action_stream.hpp"
#include "remat/schedule/binomial.hpp"

namespace remat {

/// Where the snapshots of a chain of unknown length go, decided one state at a time.
class OnlinePlacement {
 public:
  /// snapshots: slots including the chain's input x_0 (at least 1); horizon: how much longer than
  /// it has run the chain is assumed to go on (the h of the rule above, at least 1).
  explicit OnlinePlacement(std::int64_t snapshots, double horizon = 1.2) : s_(snapshots), horizon_(horizon) {
    REMAT_CHECK(snapshots >= 1, "OnlinePlacement: needs at least 1 snapshot (the chain's input), got {}", snapshots);
    REMAT_CHECK(horizon >= 1.0, "OnlinePlacement: the horizon factor must be at least 1, got {}", horizon);
    positions_.push_back(0);
  }

  /// What to do on reaching x_t, t ≥ 1, when the chain goes on.
  struct Decision {
    bool keep = false;        ///< keep x_t
    std::int64_t drop = -1;   ///< the position of the snapshot to free first, -1 for none
  };

  /// The decision on reaching x_t (t ≥ 1, one more on each call); positions() follows it.
  Decision at(std::int64_t t) {
    Decision d;
    if (static_cast<std::int64_t>(positions_.size()) < s_) {
      positions_.push_back(t);
      d.keep = true;
      return d;
    }
    // Keeping x_0 .. x_{s−1} and nothing new is optimal for chains ending at L = s + 1 and s + 2;
    // no placement stays optimal beyond that (exhaustive search, s = 3, 4, 5), so only from
    // there on does the choice trade one length against another.
    if (s_ == 1 || t <= s_ + 1) return d;
    // A(P, H) for P as it is, and for P without p_k and with t, k = 1..s−1, in O(s) evaluations
    // of F: intervals before k keep their slots, the two around p_k merge, those after it gain
    // one slot (one fewer snapshot before them), and t starts the last interval, with one slot.
    // Only that last interval depends on H, so each candidate is scored against several
    // horizons at the price of one F each: the worst ratio to the optimum F(H, s) over H in
    // {t + 1, t + 2, ⌈1.1 t⌉, ⌈h t⌉} is what the choice minimises.
    const auto n = positions_.size();  // = s
    auto part = [&](std::int64_t len, std::int64_t slots, bool swept) {
      return len <= 0 ? 0 : binomial_min_advances(len, slots) + (swept ? len : 0);
    };
    std::vector<std::int64_t> before(n + 1, 0), after(n + 1, 0);  // prefix with own slots; suffix with one more
    for (std::size_t j = 0; j + 1 < n; ++j)
      before[j + 1] = before[j] + part(positions_[j + 1] - positions_[j], s_ - static_cast<std::int64_t>(j), true);
    for (std::size_t j = n - 1; j-- > 1;)
      after[j] = after[j + 1] + part(positions_[j + 1] - positions_[j], s_ - static_cast<std::int64_t>(j) + 1, true);
    std::int64_t horizons[4] = {t + 1, t + 2, static_cast<std::int64_t>(std::ceil(1.1 * static_cast<double>(t))),
                                static_cast<std::int64_t>(std::ceil(horizon_ * static_cast<double>(t)))};
    double optimum[4];
    for (int h = 0; h < 4; ++h) {
      horizons[h] = std::max(horizons[h], t + 1);
      optimum[h] = static_cast<double>(std::max<std::int64_t>(1, binomial_min_advances(horizons[h], s_)));
    }
    // The worst ratio over the horizons of a set whose cost is base + its last interval's.
    auto worst = [&](std::int64_t base, std::int64_t last_start, std::int64_t last_slots) {
      double w = 0;
      for (int h = 0; h < 4; ++h)
        w = std::max(w, static_cast<double>(base + part(horizons[h] - last_start, last_slots, false)) / optimum[h]);
      return w;
    };
    double best = worst(before[n - 1], positions_[n - 1], s_ - static_cast<std::int64_t>(n - 1));
    std::int64_t pick = -1;
    for (std::size_t k = 1; k < n; ++k) {
      const std::int64_t merged_end = k + 1 < n ? positions_[k + 1] : t;
      std::int64_t base = before[k - 1] + part(merged_end - positions_[k - 1], s_ - static_cast<std::int64_t>(k - 1), true);
      if (k + 1 < n) base += after[k + 1] + part(t - positions_[n - 1], s_ - static_cast<std::int64_t>(n - 2), true);
      const double w = worst(base, t, 1);
      if (w < best - 1e-12) {
        best = w;
        pick = static_cast<std::int64_t>(k);
      }
    }
    if (pick < 0) return d;
    d.keep = true;
    d.drop = positions_[static_cast<std::size_t>(pick)];
    positions_.erase(positions_.begin() + pick);
    positions_.push_back(t);
    return d;
  }

  /// The positions of the snapshots kept now (x_0 first).
  const std::vector<std::int64_t>& positions() const { return positions_; }
  /// The number of snapshot slots.
  std::int64_t snapshots() const { return s_; }

  /// A(P, L): step executions to run and reverse a chain of L steps with snapshots at `positions`
  /// (ascending, 0 first, all below L) other than the L recordings the reversal needs, counted as
  /// F(L, s) counts them: the forward's L − 1 steps before the last, then, newest first, each
  /// interval [p_j, p_{j+1}) reversed by the binomial schedule with the s − j slots left to it,
  /// and the last interval's steps before L − 1 the same way from p_K.
  std::int64_t cost(const std::vector<std::int64_t>& positions, std::int64_t L) const {
    auto F = [](std::int64_t l, std::int64_t slots) { return l > 0 ? binomial_min_advances(l, slots) : 0; };
    std::int64_t total = L - 1;
    const std::size_t K = positions.size() - 1;
    for (std::size_t j = 0; j < K; ++j) total += F(positions[j + 1] - positions[j], s_ - static_cast<std::int64_t>(j));
    return total + F(L - 1 - positions[K], s_ - static_cast<std::int64_t>(K));
  }

 private:
  std::int64_t s_;
  double horizon_;
  std::vector<std::int64_t> positions_;
};

namespace detail {

/// The backward part of an online chain: reverse the recorded last step, then each interval
/// between kept snapshots, newest first, with the binomial schedule and the slots left to it.
class OnlineReversal final : public ActionStream {
 public:
  OnlineReversal(std::vector<std::int64_t> positions, std::int64_t L, std::int64_t s)
      : positions_(std::move(positions)), L_(L), s_(s), j_(static_cast<std::ptrdiff_t>(positions_.size()) - 1) {}

  std::size_t state_bytes() const override {
    return sizeof(*this) + positions_.capacity() * sizeof(std::int64_t) + (inner_ ? inner_->state_bytes() : 0);
  }

  bool next(Action& out) override {
    using K = Action::Kind;
    if (!started_) {
      started_ = true;
      out = {K::reverse, L_ - 1};
      return true;
    }
    for (;;) {
      if (inner_) {
        if (inner_->next(out)) {
          // The inner schedule starts by keeping its x_0 (held here already) and ends by freeing
          // it: both become this interval's restore and free of the kept snapshot.
          out.step += offset_;
          if (first_) {
            first_ = false;
            out = {K::restore, offset_};
          }
          return true;
        }
        inner_.reset();
      }
      if (j_ < 0) return false;
      const std::int64_t a = positions_[static_cast<std::size_t>(j_)];
      const std::int64_t b = j_ + 1 < static_cast<std::ptrdiff_t>(positions_.size()) ? positions_[static_cast<std::size_t>(j_) + 1]
                                                                                       : L_ - 1;
      const std::int64_t slots = s_ - j_;
      --j_;
      if (b > a) {
        inner_ = std::make_unique<BinomialStream>(b - a, slots);
        offset_ = a;
        first_ = true;
      } else {
        out = {K::free, a};  // the last step started at this snapshot: nothing left to reverse from it
        return true;
      }
    }
  }

 private:
  std::vector<std::int64_t> positions_;
  std::int64_t L_, s_;
  std::ptrdiff_t j_;
  bool started_ = false;
  std::unique_ptr<BinomialStream> inner_;
  std::int64_t offset_ = 0;
  bool first_ = false;
};

}  // namespace detail

}  // namespace remat
