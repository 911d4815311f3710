// The timeline trace: valid trace-event JSON, nested spans, replay spans as the plan says, and a
// saved-bytes counter whose peak is the books' peak.
#include <cstdio>
#include <fstream>
#include <map>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

struct Spans {
  std::map<std::string, int> by_category;
  std::map<std::string, int> by_name_prefix;  // first word of the name
  std::int64_t saved_peak = -1;
  bool nested = true;
};

/// Reads a trace file back: checks every 'E' closes the newest open 'B' of its thread.
Spans read_trace(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);  // throws if the file is not JSON
  Spans s;
  std::map<int, std::vector<std::string>> open;  // per thread: categories of the open spans
  REQUIRE(j.contains("traceEvents"));
  for (const auto& e : j["traceEvents"]) {
    const std::string ph = e.at("ph");
    const int tid = e.at("tid");
    REQUIRE(e.at("ts").is_number());
    if (ph == "B") {
      open[tid].push_back(e.at("cat"));
      ++s.by_category[e.at("cat")];
      const std::string name = e.at("name");
      ++s.by_name_prefix[name.substr(0, name.find(' '))];
    } else if (ph == "E") {
      if (open[tid].empty() || open[tid].back() != e.at("cat").get<std::string>()) s.nested = false;
      else open[tid].pop_back();
    } else if (ph == "C") {
      s.saved_peak = std::max<std::int64_t>(s.saved_peak, e.at("args").at("saved bytes"));
    }
  }
  for (const auto& [tid, stack] : open) s.nested = s.nested && stack.empty();
  return s;
}

/// A file of this process's own: CTest runs the test cases as parallel processes in one folder.
struct TempTrace {
  std::string path = "remat_test_timeline_" + std::to_string(::getpid()) + ".json";
  ~TempTrace() { std::remove(path.c_str()); }
};

}  // namespace

TEST_CASE("trace: a checkpointed GPT step as nested spans, one replay per block, the saved-bytes peak of the books",
          "[trace]") {
  test::FreshTape fresh;
  Generator g(3);
  nn::GPT model(test::small_gpt(3, 0.1), g);
  apply_checkpointing(model, Checkpointing::each_block());
  const LongTensor x = randint(0, 23, {2, 12}, g), y = randint(0, 23, {2, 12}, g);
  TempTrace file;
  reset_peak_memory_stats();
  const std::size_t base = memory_stats().saved_bytes;
  {
    Trace trace(file.path);
    CHECK_THROWS_AS(Trace("other.json"), Error);  // one at a time
    model.loss(x, y).backward();
  }
  Spans s = read_trace(file.path);
  CHECK(s.nested);
  CHECK(s.by_category["replay"] == 3);
  CHECK(s.by_name_prefix["replay"] == 3);
  CHECK(s.by_name_prefix["linear"] > 0);
  CHECK(s.by_category["forward"] > 0);
  CHECK(s.by_category["backward"] > 0);
  CHECK(s.saved_peak == static_cast<std::int64_t>(memory_stats().peak_saved_bytes));
  CHECK(static_cast<std::size_t>(s.saved_peak) > base);
}

TEST_CASE("trace: a chain's actions and replays are spans, as many as the plan says", "[trace][chain]") {
  Generator g(4);
  Tensor w = (randn({8, 8}, g) * 0.3f).detach().requires_grad_();
  const Tensor x = randn({2, 8}, g).requires_grad_();
  const ChainStep cell = [&w](const Tensor& h) { return tanh(matmul(h, w)); };
  const std::int64_t L = 30;
  const Policy p = policy::binomial(3);
  const Plan planned = plan(p, L);
  auto counts = std::make_shared<ChainCounts>();
  TempTrace file;
  {
    Trace trace(file.path);
    Tensor out = checkpoint_sequential(cell, L, x, p, nullptr, counts);
    sum(out).backward();
  }
  Spans s = read_trace(file.path);
  CHECK(s.nested);
  CHECK(s.by_name_prefix["replay"] == planned.advances + planned.records - L);
  CHECK(s.by_name_prefix["rebuild"] == counts->rebuilt);
  CHECK(s.by_name_prefix["record"] == planned.records);
  CHECK(s.by_name_prefix["reverse"] == L);
  CHECK(s.by_category["chain"] == static_cast<int>(planned.actions));
}

TEST_CASE("trace: off, nothing records", "[trace]") {
  CHECK(detail::active_timeline().load() == nullptr);
  TempTrace file;
  { Trace trace(file.path); }
  Spans s = read_trace(file.path);
  CHECK(s.by_category.empty());
  CHECK(detail::active_timeline().load() == nullptr);
}
