// Chains of unknown length: OnlinePlacement (pure, no tensors) and OnlineChain (the executor).

#include <functional>
#include <set>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// Places snapshots for a chain that turns out to have L steps, then checks the reversal stream
/// the chain would run: each step reversed once, newest first, from kept states only, at most s
/// kept at once. Returns the advances it counts.
std::int64_t checked_online(std::int64_t L, std::int64_t s) {
  OnlinePlacement place(s);
  for (std::int64_t t = 1; t < L; ++t) {
    place.at(t);
    REQUIRE(static_cast<std::int64_t>(place.positions().size()) <= s);
  }
  std::set<std::int64_t> kept(place.positions().begin(), place.positions().end());
  std::set<std::int64_t> recorded{L - 1};
  std::int64_t pos = L, next_reverse = L - 1, advances = 0;
  detail::OnlineReversal reversal(place.positions(), L, s);
  Action a{Action::Kind::free, 0};
  while (reversal.next(a)) {
    switch (a.kind) {
      case Action::Kind::reverse:
        REQUIRE(a.step == next_reverse);
        REQUIRE(recorded.erase(a.step) == 1);
        --next_reverse;
        break;
      case Action::Kind::record:
        REQUIRE(pos == a.step);
        recorded.insert(a.step);
        ++pos;
        break;
      case Action::Kind::advance:
        REQUIRE(pos == a.step);
        pos += a.count;
        advances += a.count;
        break;
      case Action::Kind::restore:
        REQUIRE(kept.count(a.step) == 1);
        pos = a.step;
        break;
      case Action::Kind::free:
        REQUIRE(kept.erase(a.step) == 1);
        break;
      case Action::Kind::snapshot:
        REQUIRE(pos == a.step);
        REQUIRE(static_cast<std::int64_t>(kept.size()) < s);
        kept.insert(a.step);
        break;
    }
  }
  REQUIRE(next_reverse == -1);
  REQUIRE(kept.empty());
  // The forward ran every step recorded (keeping only the newest tape), so L − 1 of the A(P, L)
  // non-recording executions the cost counts happened as those records instead.
  REQUIRE(advances + (L - 1) == place.cost(place.positions(), L));
  return advances;
}

}  // namespace

TEST_CASE("online: well-formed for every L in 1..2000 and s in 1..10, never above 1.2 F(L, s) for s >= 3",
          "[chain][online]") {
  for (std::int64_t s = 1; s <= 10; ++s) {
    OnlinePlacement place(s);
    for (std::int64_t L = 1; L <= 2000; ++L) {
      INFO("L = " << L << ", s = " << s);
      if (L <= 300 || L % 97 == 0) checked_online(L, s);  // the full stream check on a sample
      const std::int64_t online = place.cost(place.positions(), L), best = binomial_min_advances(L, s);
      REQUIRE(online >= best);
      // Every state while slots are free, then nothing new until L = s + 2: optimal as far as any
      // placement can be (past s + 2 none is, for every L).
      if (L <= s + 2) REQUIRE(online == best);
      if (s >= 3) REQUIRE(static_cast<double>(online) <= 1.2 * static_cast<double>(best));
      place.at(L);
    }
  }
}

TEST_CASE("online: no placement is optimal at every L past s + 2 (exhaustive search), OnlinePlacement is up to it",
          "[chain][online]") {
  // Every sequence of decisions (at each state: keep it in a free slot, replace one snapshot but
  // x_0 with it, or neither), followed while the placement stays at F(L, s) for every L so far.
  for (std::int64_t s = 2; s <= 6; ++s) {
    const OnlinePlacement model(s);
    std::set<std::pair<std::int64_t, std::vector<std::int64_t>>> dead;
    std::function<std::int64_t(std::int64_t, const std::vector<std::int64_t>&)> furthest =
        [&](std::int64_t L, const std::vector<std::int64_t>& P) -> std::int64_t {
      if (model.cost(P, L) != binomial_min_advances(L, s)) return L - 1;
      if (L == 3 * s || dead.count({L, P})) return L;
      std::vector<std::vector<std::int64_t>> next{P};
      if (static_cast<std::int64_t>(P.size()) < s) {
        next.push_back(P);
        next.back().push_back(L);
      } else {
        for (std::size_t k = 1; k < P.size(); ++k) {
          std::vector<std::int64_t> Q = P;
          Q.erase(Q.begin() + static_cast<std::ptrdiff_t>(k));
          Q.push_back(L);
          next.push_back(Q);
        }
      }
      std::int64_t best = L;
      for (const auto& Q : next) best = std::max(best, furthest(L + 1, Q));
      if (best < 3 * s) dead.insert({L, P});
      return best;
    };
    INFO("s = " << s);
    CHECK(furthest(1, {0}) == s + 2);
    OnlinePlacement place(s);
    for (std::int64_t L = 1; L <= s + 2; ++L) {
      CHECK(place.cost(place.positions(), L) == binomial_min_advances(L, s));
      place.at(L);
    }
  }
}

TEST_CASE("online: an OnlineChain's gradients equal the plain loop's bitwise, dropout in the step", "[chain][online]") {
  Generator init(17);
  nn::Linear lin(6, 6, true, init);
  const Tensor data = randn({3, 6}, init);
  auto step_of = [&](float dt) {
    return ChainStep([&lin, dt](const Tensor& h) { return h + dropout(tanh(lin(h)), 0.2) * dt; });
  };
  for (std::int64_t s : {1, 2, 3, 5}) {
    for (std::int64_t L : {1, 2, 7, 40}) {
      INFO("s = " << s << ", L = " << L);
      auto run = [&](bool online) {
        lin.zero_grad();
        Tensor x = data.detach().requires_grad_();
        Tensor y;
        std::int64_t expected_advances = 0;
        auto counts = std::make_shared<ChainCounts>();
        if (online) {
          OnlineChain chain(x, s);
          for (std::int64_t i = 0; i < L; ++i) chain.advance(step_of(0.1f + 0.01f * static_cast<float>(i)));
          OnlinePlacement check(s);
          for (std::int64_t t = 1; t < L; ++t) check.at(t);
          REQUIRE(chain.snapshots() == check.positions());
          expected_advances = check.cost(check.positions(), L) - (L - 1);  // forward steps ran recorded
          y = chain.finish(counts);
        } else {
          y = x;
          for (std::int64_t i = 0; i < L; ++i) y = step_of(0.1f + 0.01f * static_cast<float>(i))(y);
        }
        sum(y * y).backward();
        if (online) {
          CHECK(counts->advances == expected_advances);
          CHECK(counts->records == 2 * L - 1);  // each step in forward, and all but the last again
          CHECK(counts->peak_snapshots <= s);
        }
        return testing::RunRecord().grads(lin).grad("x", x).tensor("output", y);
      };
      CHECK_SAME_RUNS([&] { return run(false); }, [&] { return run(true); }, 5);
    }
  }
}

TEST_CASE("online: misuse is a clear error", "[chain][online][misuse]") {
  Tensor x = randn({2}).requires_grad_();
  OnlineChain chain(x, 2, "ode");
  REQUIRE_ERROR(chain.finish(), "ode", "before any step");
  chain.advance([](const Tensor& h) { return h * 2.0f; });
  REQUIRE_ERROR(chain.advance(ChainStep()), "ode", "empty function");
  Tensor y = chain.finish();
  REQUIRE_ERROR(chain.advance([](const Tensor& h) { return h; }), "ode", "after finish");
  sum(y).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{2.0f, 2.0f});
  REQUIRE_ERROR(OnlinePlacement(0), "OnlinePlacement", "at least 1");
}
