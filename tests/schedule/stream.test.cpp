// Schedules as streams: equal, action for action, to the lists the policies made before they
// were streams (the references below are those generators, kept here as the specification), and
// held in O(s) memory however long the chain.

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// The binomial schedule as it was made before streams: recursive, the split found by bisection
/// on the convex split cost, one action per advanced step.
void binomial_reference(std::int64_t start, std::int64_t end, std::int64_t s, Schedule& out) {
  using K = Action::Kind;
  const std::int64_t l = end - start;
  if (l == 1) {
    out.push_back({K::record, start});
    out.push_back({K::reverse, start});
    return;
  }
  if (s == 1) {
    for (std::int64_t j = end - 1; j >= start; --j) {
      if (j != end - 1) out.push_back({K::restore, start});
      for (std::int64_t i = start; i < j; ++i) out.push_back({K::advance, i});
      out.push_back({K::record, j});
      out.push_back({K::reverse, j});
    }
    return;
  }
  auto cost = [&](std::int64_t m) { return m + binomial_min_advances(l - m, s - 1) + binomial_min_advances(m, s); };
  std::int64_t lo = 1, hi = l - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (cost(mid + 1) >= cost(mid)) hi = mid;
    else lo = mid + 1;
  }
  const std::int64_t m = lo;
  for (std::int64_t i = start; i < start + m; ++i) out.push_back({K::advance, i});
  out.push_back({K::snapshot, start + m});
  binomial_reference(start + m, end, s - 1, out);
  out.push_back({K::free, start + m});
  out.push_back({K::restore, start});
  binomial_reference(start, start + m, s, out);
}

Schedule uniform_reference(std::int64_t L, std::int64_t k) {
  using K = Action::Kind;
  Schedule s;
  const std::int64_t last = ((L - 1) / k) * k;
  for (std::int64_t b = 0; b < last; b += k) {
    s.push_back({K::snapshot, b});
    for (std::int64_t i = b; i < b + k; ++i) s.push_back({K::advance, i});
  }
  for (std::int64_t i = last; i < L; ++i) s.push_back({K::record, i});
  for (std::int64_t i = L - 1; i >= last; --i) s.push_back({K::reverse, i});
  for (std::int64_t b = last - k; b >= 0; b -= k) {
    s.push_back({K::restore, b});
    for (std::int64_t i = b; i < b + k; ++i) s.push_back({K::record, i});
    for (std::int64_t i = b + k - 1; i >= b; --i) s.push_back({K::reverse, i});
    s.push_back({K::free, b});
  }
  return s;
}

}  // namespace

TEST_CASE("stream: binomial equals the recursive schedule action for action, L 1..200, s 1..12", "[schedule][stream]") {
  for (std::int64_t L = 1; L <= 200; ++L)
    for (std::int64_t s = 1; s <= 12; ++s) {
      Schedule expected{{Action::Kind::snapshot, 0}};
      binomial_reference(0, L, s, expected);
      expected.push_back({Action::Kind::free, 0});
      INFO("L = " << L << ", s = " << s);
      REQUIRE(remat::plan(policy::binomial(s), L).materialise() == expected);
    }
}

TEST_CASE("stream: uniform, sqrt and none equal the lists they made before", "[schedule][stream]") {
  for (std::int64_t L = 1; L <= 120; ++L) {
    INFO("L = " << L);
    for (std::int64_t k : {1, 2, 3, 7, 16, 200}) REQUIRE(remat::plan(policy::uniform(k), L).materialise() == uniform_reference(L, k));
    std::int64_t k = 1;
    while (k * k < L) ++k;
    REQUIRE(remat::plan(policy::sqrt_segments(), L).materialise() == uniform_reference(L, k));
    Schedule none;
    for (std::int64_t i = 0; i < L; ++i) none.push_back({Action::Kind::record, i});
    for (std::int64_t i = L - 1; i >= 0; --i) none.push_back({Action::Kind::reverse, i});
    REQUIRE(remat::plan(policy::none(), L).materialise() == none);
  }
}

TEST_CASE("stream: binomial(20) plans a million steps in O(s) memory with exactly F(L, s) advances",
          "[schedule][stream][binomial]") {
  const std::int64_t L = 1'000'000, s = 20;
  const Plan p = remat::plan(policy::binomial(s), L);
  std::int64_t advanced = 0, actions = 0;
  std::size_t most_held = 0;
  {
    const auto stream = p.stream();
    Action a{Action::Kind::free, 0};
    while (stream->next(a)) {
      ++actions;
      if (a.kind == Action::Kind::advance) advanced += a.count;
      most_held = std::max(most_held, stream->state_bytes());
    }
  }
  CHECK(p.advances == 6'815'960);
  CHECK(advanced == 6'815'960);
  CHECK(p.advances == binomial_min_advances(L, s));
  CHECK(p.records == L);
  CHECK(p.peak_snapshots <= s);
  CHECK(static_cast<std::size_t>(actions) == p.actions);
  // The stream held its frames (at most s) and its table of binomials — about two kilobytes —
  // never anything that grows with L or with the 11 million single-step actions a list would be.
  INFO("most bytes the stream held: " << most_held);
  CHECK(most_held < 4096);
  CHECK(policy::binomial(s).stream(10 * L, nullptr)->state_bytes() < 4096);
}

TEST_CASE("stream: the plan table merges runs and reads the same as before", "[schedule][stream]") {
  const std::string table = remat::plan(policy::binomial(2), 6).str();
  CHECK(table.find("forward   snapshot  0") != std::string::npos);
  CHECK(table.find("forward   advance   0..") != std::string::npos);
  CHECK(table.find("backward  reverse") != std::string::npos);
}

TEST_CASE("budget: long chains are planned over groups of steps, within the budget, and say so", "[schedule][budget]") {
  Generator g(31);
  const LongTensor r = randint(1, 9, {3 * 1000}, g);
  std::vector<StepCost> costs;
  std::size_t total = 0;
  for (std::int64_t i = 0; i < 1000; ++i) {
    costs.push_back({static_cast<double>(r.data()[3 * i]), static_cast<std::size_t>(r.data()[3 * i + 1]) * 1024,
                     static_cast<std::size_t>(r.data()[3 * i + 2]) * 8192});
    total += costs.back().state_bytes + costs.back().activation_bytes;
  }
  const std::size_t budget = total / 4;
  const Plan p = remat::plan(policy::budget(budget), 1000, costs);  // analyse() checks it is well-formed
  CHECK(p.peak_bytes <= budget);
  CHECK(p.note.find("1000 steps planned as 100 groups") != std::string::npos);
  CHECK(p.str().find("note: 1000 steps") != std::string::npos);
  CHECK(p.records == 1000);
  // Exact, and silent about it, up to the planner's limit.
  const std::vector<StepCost> first(costs.begin(), costs.begin() + 40);
  CHECK(remat::plan(policy::budget(budget / 10), 40, first).note.empty());
  // A budget nothing fits is an error naming the least that fits, never bad_alloc.
  REQUIRE_ERROR(remat::plan(policy::budget(1000, 256, {30}), 1000, costs), "policy::budget", "least budget", "30 groups");
}

TEST_CASE("plan: a malformed schedule is an error saying what is wrong with it", "[schedule][misuse]") {
  using K = Action::Kind;
  auto policy_of = [](Schedule actions) {
    return Policy{"custom", false, [actions](std::int64_t, const std::vector<StepCost>*) -> std::unique_ptr<ActionStream> {
                    return std::make_unique<detail::ListStream>(actions);
                  }};
  };
  // Well-formed: record both, reverse newest first.
  CHECK(remat::plan(policy_of({{K::record, 0}, {K::record, 1}, {K::reverse, 1}, {K::reverse, 0}}), 2).records == 2);
  REQUIRE_ERROR(remat::plan(policy_of({{K::record, 0}, {K::record, 1}, {K::reverse, 0}, {K::reverse, 1}}), 2),
                "reverses step 0", "step 1 is next");
  REQUIRE_ERROR(remat::plan(policy_of({{K::snapshot, 0}, {K::snapshot, 0}, {K::record, 0}, {K::reverse, 0}, {K::free, 0}}), 1),
                "x_0 was kept and never freed");
  REQUIRE_ERROR(remat::plan(policy_of({{K::snapshot, 0}, {K::record, 0}, {K::restore, 0}, {K::record, 0}, {K::reverse, 0},
                                       {K::free, 0}}), 1),
                "recorded and never reversed");
  REQUIRE_ERROR(remat::plan(policy_of({{K::snapshot, 0}, {K::advance, 0}, {K::restore, 0}, {K::record, 0}, {K::record, 1},
                                       {K::reverse, 1}, {K::reverse, 0}, {K::free, 0}}), 2),
                "forward phase", "must not restore");
  REQUIRE_ERROR(remat::plan(policy_of({{K::restore, 3}}), 4), "restores x_3", "not kept");
  REQUIRE_ERROR(remat::plan(policy_of({{K::advance, 0, 5}}), 4), "advances steps 0..4");
}

TEST_CASE("stream: a plan's text is a bounded summary, the full table lists every action", "[schedule][stream]") {
  const Plan long_plan = remat::plan(policy::binomial(20), 1000000);
  const std::string summary = long_plan.str();
  INFO(summary);
  CHECK(summary.size() < 4096);
  CHECK(summary.find("more lines") != std::string::npos);
  CHECK(summary.find("backward  reverse   0") != std::string::npos);  // the table's last line
  REQUIRE_ERROR(long_plan.actions_str(), "actions_str", "actions");
  const Plan p = remat::plan(policy::binomial(3), 40);
  const std::string full = p.actions_str();
  std::size_t snapshots = 0;
  for (const Action& a : p.materialise())
    if (a.kind == Action::Kind::snapshot) {
      ++snapshots;
      CHECK(full.find(fmt::format("snapshot  {} ", a.step)) != std::string::npos);
    }
  CHECK(snapshots > 8);
  CHECK(p.str().size() < full.size());
}
