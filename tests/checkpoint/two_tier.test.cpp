// Two storage tiers: snapshots in memory and in files.

#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <unistd.h>

#include "checkpoint/support_checkpoint.hpp"

using namespace remat;

namespace {

/// A fresh directory under /tmp, removed (if empty) at the end of the test.
struct TempDir {
  TempDir() {
    char name[] = "/tmp/remat-two-tier-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { ::rmdir(path.c_str()); }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(path.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(path + "/" + e->d_name);
      ::closedir(d);
    }
    return out;
  }
  std::string path;
};

std::vector<ChainStep> mlp_steps(nn::Linear& lin, std::int64_t L) {
  const ChainStep step = [&lin](const Tensor& h) { return h + dropout(tanh(lin(h)), 0.1) * 0.5f; };
  return std::vector<ChainStep>(static_cast<std::size_t>(L), step);
}

}  // namespace

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
  // Disk so slow that no disk slot pays: the memory-only binomial schedule, action for action.
  const Plan slow = remat::plan(policy::two_tier(2, 4, dir.path, {1e9, 1e9}), 1000);
  CHECK(slow.disk_writes == 0);
  CHECK(slow.materialise() == ram_only.materialise());
  REQUIRE_ERROR(policy::two_tier(0, 0, dir.path), "two_tier", "at least one");
  REQUIRE_ERROR(policy::two_tier(1, 2, ""), "two_tier", "directory");
}

TEST_CASE("two tiers: gradients with snapshots on disk equal the plain ones bitwise; the directory is left clean",
          "[chain][two_tier]") {
  TempDir dir;
  Generator init(8);
  nn::Linear lin(5, 5, true, init);
  const Tensor data = randn({2, 5}, init);
  const auto steps = mlp_steps(lin, 30);
  auto run = [&](const std::optional<Policy>& p) {
    lin.zero_grad();
    Tensor x = data.detach().requires_grad_();
    manual_seed(4);
    Tensor y = x;
    if (p) y = checkpoint_sequential(steps, x, *p);
    else for (const ChainStep& s : steps) y = s(y);
    if (p) CHECK(!dir.files().empty());  // the forward left snapshots on disk
    sum(y * y).backward();
    auto g = test::gradients(lin);
    g.push_back(x.grad().to_vector());
    return g;
  };
  const Policy all_disk = policy::two_tier(0, 4, dir.path, {0, 0});
  CHECK(remat::plan(all_disk, 30).disk_writes > 0);
  CHECK(run(all_disk) == run(std::nullopt));
  CHECK(dir.files().empty());
  CHECK(run(policy::two_tier(1, 3, dir.path, {0, 0})) == run(std::nullopt));
  CHECK(dir.files().empty());
}

TEST_CASE("two tiers: a snapshot file removed, truncated or altered is an error naming it; no file is left",
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
