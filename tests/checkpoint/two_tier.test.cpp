// Two storage tiers: snapshots in memory and in files.

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <map>
#include <queue>
#include <set>
#include <tuple>
#include <fstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

using test::TempDir;

std::vector<ChainStep> mlp_steps(nn::Linear& lin, std::int64_t L) {
  const ChainStep step = [&lin](const Tensor& h) { return h + dropout(tanh(lin(h)), 0.1) * 0.5f; };
  return std::vector<ChainStep>(static_cast<std::size_t>(L), step);
}

}  // namespace

namespace {

Plan two_level_plan(std::int64_t L, std::int64_t memory, std::int64_t disk, const TierCosts& c,
                    std::shared_ptr<const detail::TwoLevelTable>* table_out = nullptr) {
  auto table = std::make_shared<const detail::TwoLevelTable>(L, memory, disk, c);
  if (table_out) *table_out = table;
  return detail::analyse("two_level", L, [table] { return std::unique_ptr<ActionStream>(std::make_unique<detail::TwoLevelStream>(table)); },
                         nullptr);
}

/// The least time to reverse L steps over every sequence of the executor's moves (advance,
/// keep in memory or on disk, restore, free, record-and-reverse the next step), slots permitting,
/// x_0 kept first: a shortest path over (position, kept set, next step to reverse).
double exhaustive_time(std::int64_t L, std::int64_t memory, std::int64_t disk, const TierCosts& c) {
  using Kept = std::set<std::pair<std::int64_t, bool>>;  // (step, on disk)
  using State = std::tuple<std::int64_t, Kept, std::int64_t>;  // position (-1: nothing in hand), kept, next reverse
  std::map<State, double> best;
  using Item = std::pair<double, State>;
  std::priority_queue<Item, std::vector<Item>, std::greater<>> queue;
  auto push = [&](State s, double t) {
    auto it = best.find(s);
    if (it != best.end() && it->second <= t) return;
    best[s] = t;
    queue.push({t, std::move(s)});
  };
  if (memory > 0) push({0, Kept{{0, false}}, L - 1}, 0.0);
  if (disk > 0) push({0, Kept{{0, true}}, L - 1}, c.write);
  while (!queue.empty()) {
    auto [t, s] = queue.top();
    queue.pop();
    if (best[s] < t) continue;
    const auto& [pos, kept, next] = s;
    if (next < 0) return t;
    std::int64_t in_memory = 0, on_disk = 0;
    bool pos_kept = false;
    for (const auto& [i, disk_tier] : kept) {
      (disk_tier ? on_disk : in_memory) += 1;
      pos_kept = pos_kept || i == pos;
    }
    if (pos >= 0 && pos < next) push({pos + 1, kept, next}, t + 1);
    if (pos >= 0 && pos == next) push({-1, kept, next - 1}, t);
    if (pos >= 0 && !pos_kept) {
      Kept k = kept;
      if (in_memory < memory) {
        k.insert({pos, false});
        push({pos, k, next}, t);
        k.erase({pos, false});
      }
      if (on_disk < disk) {
        k.insert({pos, true});
        push({pos, k, next}, t + c.write);
      }
    }
    for (const auto& [i, disk_tier] : kept) {
      if (i <= next) push({i, kept, next}, t + (disk_tier ? c.read : 0.0));
      Kept k = kept;
      k.erase({i, disk_tier});
      push({pos, k, next}, t);
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("two tiers: the dynamic program is the optimum of an exhaustive search on small chains", "[chain][two_tier]") {
  for (const auto& [memory, disk, c] : {std::tuple{1, 1, TierCosts{2, 2}}, std::tuple{2, 1, TierCosts{1, 3}},
                                        std::tuple{1, 2, TierCosts{0.5, 0.5}}, std::tuple{0, 2, TierCosts{1, 1}},
                                        std::tuple{2, 2, TierCosts{3, 1}}}) {
    for (std::int64_t L = 1; L <= 7; ++L) {
      INFO("L = " << L << ", " << memory << " in memory, " << disk << " on disk, write " << c.write << ", read " << c.read);
      std::shared_ptr<const detail::TwoLevelTable> table;
      const Plan p = two_level_plan(L, memory, disk, c, &table);
      CHECK(table->time() == exhaustive_time(L, memory, disk, c));
      CHECK(detail::tier_time(p, c) == table->time());
      CHECK(p.peak_disk_snapshots <= disk);
      CHECK(p.peak_snapshots - p.peak_disk_snapshots <= memory);
    }
  }
}

TEST_CASE("two tiers: the schedule costs what the tables predict, never more than binomial with disk, F without disk",
          "[chain][two_tier]") {
  for (const auto& [memory, disk, c] : {std::tuple{2, 4, TierCosts{2, 2}}, std::tuple{1, 3, TierCosts{5, 5}},
                                        std::tuple{0, 3, TierCosts{1, 1}}, std::tuple{3, 2, TierCosts{0.5, 0.5}},
                                        std::tuple{3, 0, TierCosts{1, 1}}}) {
    for (std::int64_t L = 1; L <= 80; ++L) {
      INFO("L = " << L << ", " << memory << " in memory, " << disk << " on disk");
      std::shared_ptr<const detail::TwoLevelTable> table;
      const Plan p = two_level_plan(L, memory, disk, c, &table);
      CHECK(detail::tier_time(p, c) == table->time());
      CHECK(p.peak_disk_snapshots <= disk);
      CHECK(p.peak_snapshots - p.peak_disk_snapshots <= memory);
      double family = 1e300;
      for (std::int64_t d = memory == 0 ? 1 : 0; d <= disk; ++d)
        family = std::min(family, detail::two_tier_time(L, memory + d, d, c));
      CHECK(table->time() <= family);
      if (disk == 0) CHECK(p.advances == binomial_min_advances(L, memory));
    }
  }
  // Past the exact tables' length: groups on top, each group exact; still well-formed and as predicted.
  std::shared_ptr<const detail::TwoLevelTable> table;
  const Plan p = two_level_plan(5000, 2, 4, {2, 2}, &table);
  CHECK(table->group() > 1);
  CHECK(detail::tier_time(p, {2, 2}) == table->time());
  CHECK(detail::TwoLevelStream(table).note().find("groups") != std::string::npos);
  CHECK(table->time() <= detail::two_tier_time(5000, 6, 4, {2, 2}));
  // When the family's free placement beats splits on group boundaries, the policy uses the family
  // and its plan says so.
  TempDir dir;
  const Plan hedged = remat::plan(policy::two_tier(1, 1, dir.path, {2, 2}), 8000);
  CHECK(hedged.note.find("binomial over 2 slots with 1 on disk") != std::string::npos);
  CHECK(detail::tier_time(hedged, {2, 2}) < detail::TwoLevelTable(8000, 1, 1, {2, 2}).time());
}

TEST_CASE("two tiers: the plan uses disk slots when they pay, and shows them", "[chain][two_tier]") {
  TempDir dir;
  const Plan cheap = remat::plan(policy::two_tier(2, 4, dir.path, {0.1, 0.1}), 1000);
  const Plan ram_only = remat::plan(policy::binomial(2), 1000);
  CHECK(cheap.disk_writes > 0);
  CHECK(cheap.peak_disk_snapshots <= 4);
  CHECK(cheap.peak_snapshots - cheap.peak_disk_snapshots <= 2);
  CHECK(cheap.advances < ram_only.advances);
  CHECK(cheap.str().find("to disk") != std::string::npos);
  CHECK(cheap.str().find("written to disk") != std::string::npos);
  // Disk so slow that no disk slot pays: a memory-only schedule as short as the binomial one.
  const Plan slow = remat::plan(policy::two_tier(2, 4, dir.path, {1e9, 1e9}), 1000);
  CHECK(slow.disk_writes == 0);
  CHECK(slow.advances == ram_only.advances);
  REQUIRE_ERROR(policy::two_tier(0, 0, dir.path), "two_tier", "at least one");
  REQUIRE_ERROR(policy::two_tier(1, 2, ""), "two_tier", "directory");
}

TEST_CASE("two tiers: gradients with snapshots on disk equal the plain ones bitwise, the directory is left clean",
          "[chain][two_tier]") {
  TempDir dir;
  Generator init(8);
  nn::Linear lin(5, 5, true, init);
  const Tensor data = randn({2, 5}, init);
  const auto steps = mlp_steps(lin, 30);
  auto run = [&](const std::optional<Policy>& p) {
    lin.zero_grad();
    Tensor x = data.detach().requires_grad_();
    Tensor y = x;
    if (p) y = checkpoint_sequential(steps, x, *p);
    else for (const ChainStep& s : steps) y = s(y);
    if (p) CHECK(!dir.files().empty());  // the forward left snapshots on disk
    sum(y * y).backward();
    return testing::RunRecord().grads(lin).grad("x", x);
  };
  const Policy all_disk = policy::two_tier(0, 4, dir.path, {0, 0});
  CHECK(remat::plan(all_disk, 30).disk_writes > 0);
  CHECK_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(all_disk); }, 4);
  CHECK(dir.files().empty());
  CHECK_SAME_RUNS([&] { return run(std::nullopt); }, [&] { return run(policy::two_tier(1, 3, dir.path, {0, 0})); }, 4);
  CHECK(dir.files().empty());
}

TEST_CASE("two tiers: a snapshot file removed, truncated or altered is an error naming it, no file is left",
          "[chain][two_tier][misuse]") {
  TempDir dir;
  Generator init(9);
  nn::Linear lin(5, 5, true, init);
  const auto steps = mlp_steps(lin, 12);
  for (const std::string damage : {"truncate", "alter", "remove"}) {
    INFO(damage);
    {
      Tensor x = randn({2, 5}, init).requires_grad_();
      Tensor y = checkpoint_sequential(steps, x, policy::two_tier(0, 3, dir.path, {0, 0}));
      const std::vector<std::string> files = dir.files();
      REQUIRE(!files.empty());
      const std::string victim = files.front();
      if (damage == "remove") {
        std::remove(victim.c_str());
      } else {
        std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(0, std::ios::end);
        const auto size = static_cast<long>(f.tellg());
        f.close();
        if (damage == "truncate") {
          REQUIRE(::truncate(victim.c_str(), size - 4) == 0);
        } else {
          std::fstream g(victim, std::ios::in | std::ios::out | std::ios::binary);
          g.seekp(size - 3);
          g.put('\x7f');
        }
      }
      const std::string name = victim.substr(victim.rfind('/') + 1);
      REQUIRE_ERROR(sum(y).backward(), "chain snapshot", name.c_str());
    }
    CHECK(dir.files().empty());  // the chain's files went with it, exception or not
  }
}

namespace {

/// Changes the working directory for a test, and restores it at the end, failure or not.
class WorkingDirectory {
 public:
  WorkingDirectory() {
    char buffer[4096];
    REQUIRE(::getcwd(buffer, sizeof buffer) != nullptr);
    saved_ = buffer;
  }
  ~WorkingDirectory() {
    if (::chdir(saved_.c_str()) != 0) std::abort();  // every later test would run elsewhere
  }
  WorkingDirectory(const WorkingDirectory&) = delete;
  WorkingDirectory& operator=(const WorkingDirectory&) = delete;
  void change(const std::string& to) { REQUIRE(::chdir(to.c_str()) == 0); }

 private:
  std::string saved_;
};

/// A chain's gradients with the policy (or without checkpointing), `between` run after its forward:
/// the parameters' and the input's (for compare_runs, from generator seed 4).
template <class Between>
testing::RunRecord chain_gradients(nn::Linear& lin, const std::vector<ChainStep>& steps, const Tensor& data,
                                   const std::optional<Policy>& p, Between between) {
  lin.zero_grad();
  Tensor x = data.detach().requires_grad_();
  Tensor y = x;
  if (p) y = checkpoint_sequential(steps, x, *p);
  else for (const ChainStep& s : steps) y = s(y);
  between(y);
  sum(y * y).backward();
  return testing::RunRecord().grads(lin).grad("x", x);
}

}  // namespace

TEST_CASE("two tiers: a relative directory still names the snapshots after a chdir between forward and backward",
          "[chain][two_tier]") {
  TempDir dir;  // /tmp/remat-test-XXXXXX
  Generator init(11);
  nn::Linear lin(5, 5, true, init);
  const Tensor data = randn({2, 5}, init);
  const auto steps = mlp_steps(lin, 12);
  WorkingDirectory cwd;
  auto plain = [&] { return chain_gradients(lin, steps, data, std::nullopt, [](Tensor&) {}); };
  auto moved = [&] {
    cwd.change("/tmp");
    const Policy relative = policy::two_tier(0, 3, dir.path.substr(std::string("/tmp/").size()), {0, 0});
    return chain_gradients(lin, steps, data, relative, [&](Tensor&) {
      CHECK(!dir.files().empty());
      cwd.change("/");
    });
  };
  CHECK_SAME_RUNS(plain, moved, 4);
  CHECK(dir.files().empty());
}

TEST_CASE("two tiers: a child forked after the forward leaves the parent's snapshot files alone",
          "[chain][two_tier]") {
  TempDir dir;
  Generator init(12);
  nn::Linear lin(5, 5, true, init);
  const Tensor data = randn({2, 5}, init);
  const auto steps = mlp_steps(lin, 12);
  auto fork_between = [&](Tensor& y) {
    const std::vector<std::string> files = dir.files();
    REQUIRE(!files.empty());
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // The child drops its copies of the chain — the output, and the tape whose node holds the
      // snapshots — as exit() would by running the thread's destructors; then it ends without
      // running the test framework's.
      y = Tensor();
      current_tape().reset();
      ::_exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
    CHECK(dir.files() == files);
  };
  const Policy on_disk = policy::two_tier(0, 3, dir.path, {0, 0});
  CHECK_SAME_RUNS([&] { return chain_gradients(lin, steps, data, std::nullopt, [](Tensor&) {}); },
                  [&] { return chain_gradients(lin, steps, data, on_disk, fork_between); }, 4);
  CHECK(dir.files().empty());
}

TEST_CASE("two tiers: a snapshot file that cannot be read is an error with the OS's reason, not 'missing'",
          "[chain][two_tier][misuse]") {
  TempDir dir;
  Generator init(13);
  nn::Linear lin(5, 5, true, init);
  const auto steps = mlp_steps(lin, 12);
  {
    Tensor x = randn({2, 5}, init).requires_grad_();
    Tensor y = checkpoint_sequential(steps, x, policy::two_tier(0, 3, dir.path, {0, 0}));
    const std::vector<std::string> files = dir.files();
    REQUIRE(!files.empty());
    // As root, chmod 000 does not stop a read; a directory in the file's place does (EISDIR).
    for (const std::string& victim : files) {
      REQUIRE(std::remove(victim.c_str()) == 0);
      REQUIRE(::mkdir(victim.c_str(), 0700) == 0);
    }
    std::string message;
    try {
      sum(y).backward();
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(message.find("chain snapshot") != std::string::npos);
    CHECK(message.find(std::strerror(EISDIR)) != std::string::npos);
    CHECK(message.find("missing") == std::string::npos);
  }
  CHECK(dir.files().empty());  // the directories in the files' places went with the snapshots
}

TEST_CASE("two tiers: snapshot files go the moment nothing can send the chain's output a gradient, and jvp's "
          "tangent files when its dual level ends",
          "[chain][two_tier][forward_ad]") {
  TempDir dir;
  Generator init(14);
  nn::Linear lin(5, 5, true, init);
  const auto steps = mlp_steps(lin, 12);
  const Tensor data = randn({2, 5}, init), direction = randn({2, 5}, init);
  const Policy on_disk = policy::two_tier(0, 3, dir.path, {0, 0});
  SECTION("the output dropped without a backward") {
    {
      const Tensor y = checkpoint_sequential(steps, data.detach().requires_grad_(), on_disk);
      REQUIRE(!dir.files().empty());
    }
    CHECK(dir.files().empty());  // before the next recorded op, which prunes the tape
  }
  SECTION("jvp through the chain, its primal needing no gradient") {
    std::size_t inside = 0;
    {
      const auto [y, t] = jvp(
          [&](const Tensor& h) {
            Tensor out = checkpoint_sequential(steps, h, on_disk);
            inside = dir.files().size();
            return out;
          },
          data, direction);
      REQUIRE(inside > 0);
      // Each state on disk kept its tangent beside it while the level was open; the level ended.
      CHECK(dir.files().size() == inside / 2);
      CHECK(t.defined());
    }
    CHECK(dir.files().empty());
  }
  SECTION("backward after jvp: the states' files serve it, then go") {
    Tensor x = data.detach().requires_grad_();
    {
      const auto [y, t] = jvp([&](const Tensor& h) { return checkpoint_sequential(steps, h, on_disk); }, x, direction);
      REQUIRE(!dir.files().empty());
      sum(y * y).backward();
    }
    CHECK(x.grad().defined());
    CHECK(dir.files().empty());
  }
}

TEST_CASE("two tiers: a snapshot file whose removal fails is named and removed once it can be, not left silently",
          "[chain][two_tier][misuse]") {
  TempDir dir;
  Generator init(15);
  nn::Linear lin(5, 5, true, init);
  const auto steps = mlp_steps(lin, 12);
  const Tensor data = randn({2, 5}, init);
  const Policy on_disk = policy::two_tier(0, 3, dir.path, {0, 0});
  auto step = [&] {
    Tensor x = data.detach().requires_grad_();
    sum(checkpoint_sequential(steps, x, on_disk)).backward();
    REQUIRE(x.grad().defined());
  };
  // Removals under the directory fail as they do when it is made unwritable under the chain (the
  // seam, since root ignores a directory's permissions).
  detail::FileRemovals& removals = detail::FileRemovals::process();
  const std::string prefix = dir.path + "/";
  removals.fail_for_test([prefix](const std::string& path) { return path.compare(0, prefix.size(), prefix) == 0 ? EACCES : 0; });
  step();
  std::vector<std::string> files = dir.files();
  REQUIRE(!files.empty());
  std::vector<std::string> left = remove_left_files();
  std::sort(files.begin(), files.end());
  std::sort(left.begin(), left.end());
  CHECK(left == files);  // every file the chain could not remove, named
  removals.fail_for_test(nullptr);
  step();  // a later removal tries them again
  CHECK(dir.files().empty());
  CHECK(remove_left_files().empty());
}
