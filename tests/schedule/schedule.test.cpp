#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// The properties every schedule must have, checked by replaying its bookkeeping: each step
/// recorded and reversed exactly once, newest first (analyse() throws otherwise).
Plan checked_plan(const Policy& p, std::int64_t L, const std::vector<StepCost>* costs = nullptr) {
  Plan plan = remat::plan(p, L, costs);
  CHECK(plan.records >= L);
  std::vector<int> reversed(static_cast<std::size_t>(L), 0);
  std::int64_t last = L;
  for (const Action& a : plan.materialise())
    if (a.kind == Action::Kind::reverse) {
      ++reversed[static_cast<std::size_t>(a.step)];
      CHECK(a.step == last - 1);
      last = a.step;
    }
  for (int r : reversed) CHECK(r == 1);
  return plan;
}

/// Exhaustive search over the same decisions as the budget planner, with exact byte counts and
/// no memo: the reference the planner must match on small chains.
double brute_force(const std::vector<StepCost>& c, std::int64_t s, std::int64_t t, std::int64_t m, bool kept) {
  const double inf = std::numeric_limits<double>::infinity();
  if (m < 0) return inf;
  auto at = [&](std::int64_t i) { return c[static_cast<std::size_t>(i)]; };
  double best = inf, run = 0;
  std::int64_t act = 0;
  for (std::int64_t i = s; i < t; ++i) {
    run += at(i).compute;
    act += static_cast<std::int64_t>(at(i).activation_bytes);
  }
  if (act <= m) best = run;
  if (t - s > 1) {
    best = std::min(best, at(s).compute + brute_force(c, s + 1, t, m - static_cast<std::int64_t>(at(s).activation_bytes), false));
    const std::int64_t free = m - (kept ? 0 : static_cast<std::int64_t>(at(s).state_bytes));
    double advance = 0;
    for (std::int64_t k = s + 1; k < t; ++k) {
      advance += at(k - 1).compute;
      best = std::min(best, advance + brute_force(c, k, t, free, false) + brute_force(c, s, k, free, true));
    }
  }
  return best;
}

std::vector<StepCost> random_costs(std::int64_t L, Generator& g) {
  std::vector<StepCost> c;
  const LongTensor r = randint(1, 9, {3 * L}, g);
  for (std::int64_t i = 0; i < L; ++i)
    c.push_back({static_cast<double>(r.data()[3 * i]), static_cast<std::size_t>(r.data()[3 * i + 1]),
                 static_cast<std::size_t>(2 * r.data()[3 * i + 2])});
  return c;
}

}  // namespace

TEST_CASE("binomial: Griewank's minimum at the quoted values", "[schedule][binomial]") {
  CHECK(binomial_min_advances(64, 4) == 200);
  CHECK(binomial_min_advances(1000, 10) == 3636);
  CHECK(binomial_min_advances(10000, 10) == 57624);
  CHECK(binomial_min_advances(1, 3) == 0);
  CHECK(binomial_min_advances(5, 1) == 10);  // one snapshot: 0 + 1 + 2 + 3 + 4
}

TEST_CASE("binomial: every L in 1..200 and s in 1..12 reverses each step once with minimal advances", "[schedule][binomial]") {
  for (std::int64_t L = 1; L <= 200; ++L)
    for (std::int64_t s = 1; s <= 12; ++s) {
      const Plan p = remat::plan(policy::binomial(s), L);
      INFO("L = " << L << ", s = " << s);
      REQUIRE(p.records == L);  // every step recorded once: reversed exactly once (analyse checks order)
      REQUIRE(p.peak_snapshots <= s);
      REQUIRE(p.peak_recorded <= 1);
      REQUIRE(p.advances == binomial_min_advances(L, s));
    }
}

TEST_CASE("uniform, sqrt and none: well-formed for every L, with the expected counts", "[schedule][uniform]") {
  for (std::int64_t L = 1; L <= 200; ++L) {
    INFO("L = " << L);
    const Plan none = checked_plan(policy::none(), L);
    CHECK(none.advances == 0);
    CHECK(none.peak_recorded == L);
    for (std::int64_t k : {1, 2, 3, 7, 16}) {
      const Plan u = checked_plan(policy::uniform(k), L);
      const std::int64_t last_start = ((L - 1) / k) * k;
      CHECK(u.advances == last_start);  // every segment but the last runs once unrecorded
      CHECK(u.records == L);
      CHECK(u.peak_snapshots == last_start / k);
      CHECK(u.peak_recorded == std::min(k, L));
    }
    std::int64_t k = 1;
    while (k * k < L) ++k;
    CHECK(checked_plan(policy::sqrt_segments(), L).advances == checked_plan(policy::uniform(k), L).advances);
  }
}

TEST_CASE("plan: predicted bytes and a readable table", "[schedule]") {
  const std::vector<StepCost> costs(8, StepCost{1.0, 100, 1000});
  const Plan p = remat::plan(policy::uniform(4), 8, costs);
  CHECK(p.forward_end_bytes == 100 + 4 * 1000);  // x_0 kept, the last segment recorded
  CHECK(p.peak_bytes == 100 + 4 * 1000);
  CHECK(p.compute == 12.0);
  const std::string table = p.str();
  CHECK(table.find("uniform:4") != std::string::npos);
  CHECK(table.find("forward   advance   0..3") != std::string::npos);
  CHECK(table.find("backward  reverse   7..4") != std::string::npos);
  REQUIRE_ERROR(remat::plan(policy::budget(1000), 8), "budget", "costs");
  REQUIRE_ERROR(remat::plan(policy::uniform(0), 8), "uniform", "at least 1");
}

TEST_CASE("budget: a policy asked again for a chain it planned gives that chain's schedule, never another's",
          "[schedule][budget]") {
  // The policy keeps its last schedule (a training loop asks every step); asked for another chain
  // (other costs, other length) it plans that one, and each answer is what a fresh policy gives.
  const auto actions = [](const Policy& p, std::int64_t L, const std::vector<StepCost>& costs) {
    std::vector<Action> out;
    const auto stream = p.stream(L, &costs);
    for (Action a{Action::Kind::advance, 0}; stream->next(a);) out.push_back(a);
    return out;
  };
  Generator g(4);
  const std::vector<StepCost> a = random_costs(12, g), b = random_costs(12, g), c = random_costs(9, g);
  std::size_t bytes = 0;
  for (const StepCost& k : a) bytes += k.state_bytes + k.activation_bytes;
  bytes /= 2;
  const Policy kept = policy::budget(bytes, 64);
  for (int round = 0; round < 2; ++round)
    for (const auto& [L, costs] : {std::pair{std::int64_t{12}, &a}, std::pair{std::int64_t{12}, &b},
                                   std::pair{std::int64_t{9}, &c}, std::pair{std::int64_t{12}, &a}}) {
      INFO("round " << round << ", L = " << L);
      CHECK(actions(kept, L, *costs) == actions(policy::budget(bytes, 64), L, *costs));
    }
}

TEST_CASE("budget: fits its budget, never worse than the best uniform that fits, optimal on small chains", "[schedule][budget]") {
  Generator g(21);
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t L = 1 + trial % 7;
    const std::vector<StepCost> costs = random_costs(L, g);
    std::size_t total = 0;
    for (const StepCost& c : costs) total += c.state_bytes + c.activation_bytes;
    for (std::size_t budget : {total / 4, total / 2, total}) {
      INFO("trial " << trial << ", L = " << L << ", budget " << budget);
      const double exact = brute_force(costs, 0, L, static_cast<std::int64_t>(budget), false);
      if (std::isinf(exact)) {
        REQUIRE_ERROR(remat::plan(policy::budget(budget, static_cast<std::int64_t>(budget)), L, costs), "budget", "fits");
        continue;
      }
      const Plan p = checked_plan(policy::budget(budget, static_cast<std::int64_t>(budget)), L, &costs);  // 1-byte units
      CHECK(p.peak_bytes <= budget);
      CHECK(p.compute == Approx(exact));
    }
  }
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t L = 10 + 2 * trial;
    const std::vector<StepCost> costs = random_costs(L, g);
    for (std::int64_t k = 1; k <= L; ++k) {
      const Plan u = remat::plan(policy::uniform(k), L, costs);
      const Plan b = remat::plan(policy::budget(u.peak_bytes, static_cast<std::int64_t>(u.peak_bytes)), L, costs);
      INFO("L = " << L << ", uniform:" << k << " peak " << u.peak_bytes);
      CHECK(b.peak_bytes <= u.peak_bytes);
      CHECK(b.compute <= u.compute + 1e-9);
    }
  }
}
