// The chain executor's per-step notes (checkpoint/step_log.hpp): stored as runs, read back exactly.

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

TEST_CASE("step log: per-step notes stored as runs read back exactly", "[chain][stream]") {
  detail::StateRuns rng;
  detail::EqualRuns<Shape> shapes;
  std::vector<Generator::State> states;
  std::uint64_t offset = 7;
  for (int i = 0; i < 1000; ++i) {
    offset += i < 500 ? 3 : (i % 7 == 0 ? 5 : 2);  // a fixed stride, then an irregular one
    states.push_back({i < 800 ? 11u : 12u, offset});
    rng.push_back(states.back());
    shapes.push_back(i < 600 ? Shape{2, 3} : Shape{4});
  }
  for (std::size_t i = 0; i < states.size(); ++i) {
    REQUIRE(rng[i] == states[i]);
    REQUIRE(shapes[i] == (i < 600 ? Shape{2, 3} : Shape{4}));
  }
  CHECK(shapes.runs() == 2);
  CHECK(rng.runs() < 400);  // the regular first half is one run
}
