// Offload (io/offload.hpp): saved activations written to files by an I/O thread and read back
// ahead of backward — gradients bitwise those in RAM, every bad file an error naming it, a failed
// write kept in RAM, the directory left clean.

#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/support_checkpoint.hpp"
#include "remat/core/timeline_json.hpp"
#include "remat/io/offload.hpp"

using namespace remat;
namespace fs = std::filesystem;

namespace {

/// The files in the scope's directory (empty when it is gone).
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// A GPT step's gradients, with the forward under an Offload scope of `options` (or none), and
/// the scope's stats.
std::pair<std::vector<std::vector<float>>, OffloadStats> gpt_gradients(const char* policy,
                                                                       std::optional<OffloadOptions> options,
                                                                       std::size_t* books = nullptr) {
  test::GptStep s(policy);
  manual_seed(9);
  const std::size_t base = memory_stats().saved_bytes;
  Tensor loss;
  OffloadStats stats;
  std::optional<Offload> offload;
  if (options) offload.emplace(*options);
  loss = s.loss();
  if (offload) offload->flush();
  if (books) *books = memory_stats().saved_bytes - base;
  loss.backward();
  if (offload) {
    stats = offload->stats();
    CHECK(files_in(offload->directory()).empty());  // each file went with its node's backward
    const std::string dir = offload->directory();
    offload.reset();
    CHECK_FALSE(fs::exists(dir));
  }
  return {test::gradients(s.gpt), stats};
}

}  // namespace

TEST_CASE("Offload: gradients bitwise those in RAM under every policy, files gone after backward",
          "[offload][hooks]") {
  test::TempDir dir;
  for (const char* policy : {"none", "blocks", "selective", "sqrt"}) {
    INFO("policy " << policy);
    std::size_t plain_books = 0, books = 0;
    const auto [plain, none] = gpt_gradients(policy, std::nullopt, &plain_books);
    OffloadOptions o;
    o.directory = dir.path;
    o.min_bytes = 0;
    const auto [offloaded, stats] = gpt_gradients(policy, o, &books);
    CHECK(offloaded == plain);
    CHECK(stats.offloaded > 0);
    // A chain (sqrt) drops the graphs it records in forward for its own compact records (packed
    // again, as the chain's): what the first nodes packed goes unwritten or unread, so only files
    // and reads are matched there.
    if (std::string(policy) != "sqrt") CHECK(stats.files_written == stats.offloaded);
    CHECK(stats.files_written > 0);
    if (std::string(policy) != "sqrt") CHECK(stats.reads == stats.files_written);  // each read back once
    else CHECK(stats.reads <= stats.files_written);
    CHECK(stats.write_failures == 0);
    CHECK(stats.ram_bytes == 0);
    CHECK(stats.disk_bytes == 0);
    CHECK(books < plain_books);  // what the nodes hold themselves: parameters, inputs, int64 targets
  }
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("Offload: reuse_files overwrites the files a scope let go in the next scope, gradients bitwise",
          "[offload][hooks]") {
  test::TempDir dir;
  const std::string kept = fmt::format("{}/remat-offload-{}-kept", dir.path, ::getpid());
  const auto [plain, none] = gpt_gradients("none", std::nullopt);
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  o.reuse_files = true;
  const auto [first_grads, first] = gpt_gradients("none", o);
  CHECK(first_grads == plain);
  CHECK(first.files_reused == 0);
  // Every file of the step was kept (no more than the scope's peak on disk), none left in its directory.
  CHECK(files_in(kept).size() == first.files_written);
  CHECK(files_in(dir.path) == std::vector<std::string>{kept});
  const auto [second_grads, second] = gpt_gradients("none", o);
  CHECK(second_grads == plain);
  CHECK(second.files_written == first.files_written);
  CHECK(second.files_reused == second.files_written);  // the same sizes: each write found its file
  CHECK(second.reads == second.files_written);
  CHECK(files_in(kept).size() == second.files_written);
  const std::size_t kept_files = files_in(kept).size();
  CHECK(Offload::remove_kept_files() == kept_files);
  CHECK_FALSE(fs::exists(kept));
  CHECK(files_in(dir.path).empty());
  CHECK(Offload::remove_kept_files() == 0);
}

TEST_CASE("Offload: a kept file of another size, or grown while kept, is cut to size when reused", "[offload]") {
  test::TempDir dir;
  const std::string kept = fmt::format("{}/remat-offload-{}-kept", dir.path, ::getpid());
  Generator g(60);
  // 8 rows: two new files; 8 again, one of them grown by 8 KiB while kept; 3 rows: the larger files.
  for (std::int64_t rows : {std::int64_t{8}, std::int64_t{8}, std::int64_t{3}}) {
    INFO(rows << " rows, " << files_in(kept).size() << " files kept");
    Tensor x = randn({rows, 1000}, g).requires_grad_();
    sum(tanh(tanh(x) * 2.0f)).backward();
    const std::vector<float> plain = x.grad().to_vector();
    x.zero_grad();
    const bool first = !fs::exists(kept);
    if (!first) fs::resize_file(files_in(kept).front(), fs::file_size(files_in(kept).front()) + 8192);
    OffloadOptions o;
    o.directory = dir.path;
    o.min_bytes = 0;
    o.prefetch = 0;
    o.reuse_files = true;
    Offload offload(o);
    Tensor y = sum(tanh(tanh(x) * 2.0f));  // each tanh keeps its output: two files
    offload.flush();
    CHECK(offload.stats().files_written == 2);
    CHECK(offload.stats().files_reused == (first ? 0 : 2));
    y.backward();
    CHECK(offload.stats().reads == 2);
    CHECK(x.grad().to_vector() == plain);
    CHECK(files_in(kept).size() == 2);
  }
  CHECK(Offload::remove_kept_files() == 2);
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("Offload: read-ahead and the counts of late reads", "[offload][hooks]") {
  test::TempDir dir;
  for (std::size_t prefetch : {std::size_t{0}, std::size_t{3}}) {
    OffloadOptions o;
    o.directory = dir.path;
    o.min_bytes = 0;
    o.prefetch = prefetch;
    const auto [grads, stats] = gpt_gradients("none", o);
    INFO("prefetch " << prefetch << ": " << stats.reads << " reads, " << stats.late_reads << " late");
    CHECK(stats.reads > 0);
    if (prefetch == 0) CHECK(stats.late_reads == stats.reads);  // nothing read ahead: backward waits for each
    else CHECK(stats.late_reads <= stats.reads);
    CHECK(stats.peak_ram_bytes > 0);
  }
}

TEST_CASE("Offload: a missing, truncated, swapped or altered file is an error naming it", "[offload][hooks]") {
  test::TempDir dir;
  Generator g(61);
  for (const char* damage : {"missing", "truncated", "swapped", "altered", "extended"}) {
    INFO(damage);
    Tensor x = randn({32, 64}, g).requires_grad_();
    Tensor y;
    std::string scope_dir;
    {
      OffloadOptions o;
      o.directory = dir.path;
      o.min_bytes = 0;
      o.prefetch = 0;
      Offload offload(o);
      scope_dir = offload.directory();
      Tensor a = tanh(x * 2.0f);  // tanh keeps its output: file t0
      y = sum(tanh(a * 3.0f));    // and this one: file t1
      offload.flush();
      CHECK(offload.stats().files_written == 2);
      CHECK(saved_tensors().str().find("offload: on disk") != std::string::npos);
    }
    const std::string t0 = scope_dir + "/t0.bin", t1 = scope_dir + "/t1.bin";
    REQUIRE(fs::exists(t0));
    REQUIRE(fs::exists(t1));
    const std::string& victim = t1;  // backward reads the last save first
    if (std::string(damage) == "missing") {
      fs::remove(victim);
      REQUIRE_ERROR(y.backward(), "offload", victim.c_str(), "missing");
    } else if (std::string(damage) == "truncated") {
      fs::resize_file(victim, fs::file_size(victim) - 4096);
      REQUIRE_ERROR(y.backward(), "offload", victim.c_str(), "truncated");
    } else if (std::string(damage) == "extended") {
      fs::resize_file(victim, fs::file_size(victim) + 4096);
      REQUIRE_ERROR(y.backward(), "offload", victim.c_str(), "extended");
    } else if (std::string(damage) == "swapped") {
      fs::rename(t0, scope_dir + "/tmp");
      fs::rename(t1, t0);
      fs::rename(scope_dir + "/tmp", t1);
      REQUIRE_ERROR(y.backward(), "offload", victim.c_str(), "holds another tensor");
    } else {
      std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(4096 + 100);
      f.put('\x5a');
      f.close();
      REQUIRE_ERROR(y.backward(), "offload", victim.c_str(), "changed since they were written");
    }
    y = Tensor();  // the graph goes, and with it the files and the scope's directory
    current_tape().reset();
    CHECK_FALSE(fs::exists(scope_dir));
  }
}

TEST_CASE("Offload: a write past the disk limit keeps the tensor in RAM, the step completes bitwise",
          "[offload][hooks]") {
  test::TempDir dir;
  Generator g(62);
  Tensor x = randn({32, 64}, g).requires_grad_();
  auto run = [&](std::optional<OffloadOptions> o, OffloadStats* stats) {
    x.zero_grad();
    std::optional<Offload> offload;
    if (o) offload.emplace(*o);
    Tensor a = tanh(x * 2.0f);
    Tensor y = sum(tanh(a * 3.0f));
    if (offload) offload->flush();
    if (offload) *stats = offload->stats();
    y.backward();
    return x.grad().to_vector();
  };
  OffloadStats stats;
  const std::vector<float> plain = run(std::nullopt, &stats);
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  o.disk_bytes = 4096 + 32 * 64 * 4;  // one file's worth
  const std::vector<float> limited = run(o, &stats);
  CHECK(limited == plain);
  CHECK(stats.files_written == 1);
  CHECK(stats.write_failures == 1);
  CHECK(stats.ram_bytes == 32 * 64 * 4);  // the one that stayed
  CHECK(stats.first_write_error.find("disk limit of 12288 B") != std::string::npos);
  CHECK(stats.first_write_error.find("stays in RAM") != std::string::npos);
}

TEST_CASE("Offload: a saved tensor written in place after it was offloaded is the error it is in RAM",
          "[offload][hooks]") {
  test::TempDir dir;
  Generator g(63);
  Tensor w = randn({16, 16}, g).requires_grad_();
  Tensor h = w * 2.0f;
  Tensor y, t;  // t lives on, as the in-RAM run's node would keep it
  {
    OffloadOptions o;
    o.directory = dir.path;
    o.min_bytes = 0;
    Offload offload(o);
    y = sum(h * h);  // mul saves h (made before the scope: declined) ...
    t = tanh(h);
    y = y + sum(t * t);  // ... and t, made inside: offloaded
    offload.flush();
    CHECK(offload.stats().files_written >= 1);
    t.data()[0] = 7.0f;
  }
  REQUIRE_ERROR(y.backward(), "mul", "modified in place");
}

TEST_CASE("Offload: directories of dead processes are removed at the start, others are left", "[offload]") {
  test::TempDir dir;
  const ::pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(child > 0);
  ::waitpid(child, nullptr, 0);  // a pid no process has now
  const std::string dead = fmt::format("{}/remat-offload-{}-7", dir.path, child);
  const std::string alive = fmt::format("{}/remat-offload-1-3", dir.path);  // pid 1 lives
  const std::string other = dir.path + "/remat-offload-notes";
  for (const std::string& d : {dead, alive, other}) {
    fs::create_directory(d);
    std::ofstream(d + "/t0.bin") << "x";
  }
  {
    OffloadOptions o;
    o.directory = dir.path;
    Offload offload(o);
    CHECK(offload.stats().stale_removed == 1);
    CHECK_FALSE(fs::exists(dead));
    CHECK(fs::exists(alive));
    CHECK(fs::exists(other));
  }
  for (const std::string& d : {alive, other}) fs::remove_all(d);
}

namespace {

/// Makes removals under `dir` fail as a directory made unwritable under the scope does (another
/// user's chmod), and undoes it. Root ignores a directory's permissions, so as root the failure is
/// the store's test seam instead, with the errno the chmod gives everyone else.
struct RemovalBlocker {
  void block(const std::string& dir) {
    if (::geteuid() == 0)
      detail::FileRemovals::process().fail_for_test(
          [dir](const std::string& path) { return path.compare(0, dir.size(), dir) == 0 ? EACCES : 0; });
    else
      fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);  // r-x: files read, none removed
    blocked = dir;
  }
  void unblock() {
    if (blocked.empty()) return;
    if (::geteuid() == 0) detail::FileRemovals::process().fail_for_test(nullptr);
    else fs::permissions(blocked, fs::perms::owner_all);
    blocked.clear();
  }
  ~RemovalBlocker() { unblock(); }
  std::string blocked;
};

}  // namespace

TEST_CASE("Offload: files a scope could not remove are counted, and removed once they can be", "[offload]") {
  test::TempDir dir;
  Generator g(64);
  Tensor x = randn({32, 64}, g).requires_grad_();
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  o.prefetch = 0;
  RemovalBlocker blocker;
  // A scope whose directory is made unwritable after its files were written: backward reads them,
  // their removals fail, and so does the directory's at the scope's end.
  auto step_with_removals_blocked = [&] {
    Offload offload(o);
    const std::string scope_dir = offload.directory();
    Tensor y = sum(tanh(tanh(x) * 2.0f));  // each tanh keeps its output: two files
    offload.flush();
    REQUIRE(files_in(scope_dir).size() == 2);
    blocker.block(scope_dir);
    y.backward();
    const OffloadStats stats = offload.stats();
    CHECK(stats.reads == 2);
    CHECK(stats.removal_failures == 2);
    CHECK(stats.first_removal_error.find(scope_dir + "/t") != std::string::npos);
    CHECK(stats.first_removal_error.find(std::strerror(EACCES)) != std::string::npos);
    CHECK(stats.disk_bytes == 0);
    return scope_dir;
  };

  const std::string first = step_with_removals_blocked();
  CHECK(files_in(first).size() == 2);  // the scope has ended; its files are still there ...
  const std::vector<std::string> left = Offload::remove_left_files();  // ... and named
  CHECK(left == std::vector<std::string>{first, first + "/t0.bin", first + "/t1.bin"});
  blocker.unblock();
  {  // the next scope's start removes them
    Offload next(o);
    CHECK_FALSE(fs::exists(first));
    CHECK(Offload::remove_left_files().empty());
  }
  CHECK(files_in(dir.path).empty());

  const std::string second = step_with_removals_blocked();
  blocker.unblock();
  CHECK(fs::exists(second));
  CHECK(Offload::remove_left_files().empty());  // asked for
  CHECK_FALSE(fs::exists(second));
  CHECK(files_in(dir.path).empty());

  // At exit: the process's list of removals left is tried again as it is destroyed.
  const std::string file = dir.path + "/left.bin";
  std::ofstream(file) << "x";
  {
    detail::FileRemovals removals;
    removals.fail_for_test([](const std::string&) { return EACCES; });
    CHECK(removals.remove(file, false).find("cannot remove '" + file + "'") != std::string::npos);
    CHECK(removals.retry() == std::vector<std::string>{file});
    removals.fail_for_test(nullptr);
    CHECK(fs::exists(file));
  }
  CHECK_FALSE(fs::exists(file));
}

TEST_CASE("Offload: float32 written as bfloat16 gives SaveInBFloat16's gradients, bitwise", "[offload][bf16]") {
  test::TempDir dir;
  // Under a chain (sqrt) too: what the chain holds (its snapshots, its compact records) is not
  // rounded, since replays start from it.
  for (const char* policy : {"blocks", "sqrt"}) {
    INFO(policy);
    std::vector<std::vector<float>> rounded;
    {
      test::GptStep s(policy);
      manual_seed(9);
      Tensor loss;
      {
        SaveInBFloat16 scope;
        loss = s.loss();
      }
      loss.backward();
      rounded = test::gradients(s.gpt);
    }
    OffloadOptions o;
    o.directory = dir.path;
    o.min_bytes = 0;
    o.bfloat16 = true;
    const auto [offloaded, stats] = gpt_gradients(policy, o);
    CHECK(offloaded == rounded);
    CHECK(stats.files_written > 0);
  }
}

TEST_CASE("Offload: around a checkpoint or inside its function, the gradients are those in RAM", "[offload]") {
  test::TempDir dir;
  Generator g(64);
  Tensor x = randn({32, 64}, g).requires_grad_();
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  auto block = [&](bool inner) {
    return [&, inner](const Tensor& a) {
      std::optional<Offload> offload;
      if (inner) offload.emplace(o);  // a checkpointed forward records nothing; a replay packs nothing
      return tanh(tanh(a * 2.0f) * 3.0f);
    };
  };
  auto run = [&](bool outer, bool inner) {
    x.zero_grad();
    std::optional<Offload> offload;
    if (outer) offload.emplace(o);
    Tensor y = sum(tanh(checkpoint(block(inner), x)));
    std::size_t written = 0;
    if (offload) {
      offload->flush();
      written = offload->stats().files_written;
    }
    y.backward();
    return std::make_pair(x.grad().to_vector(), written);
  };
  const auto plain = run(false, false);
  const auto outside = run(true, false);
  const auto inside = run(false, true);
  CHECK(outside.first == plain.first);
  CHECK(inside.first == plain.first);
  CHECK(outside.second == 1);  // the tanh after the segment; x was made before the scope
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("Offload: the policy predicate is told the op and who saves", "[offload]") {
  test::TempDir dir;
  std::vector<std::pair<std::string, SavedBy>> asked;
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  o.only = [&](const AnyTensor&, const SaveContext& c) {
    asked.emplace_back(std::string(c.op), c.by);
    return c.by == SavedBy::checkpoint;
  };
  Generator g(65);
  Tensor x = randn({8, 8}, g).requires_grad_();
  Tensor y;
  {
    Offload offload(o);
    Tensor h = x * 2.0f;
    y = sum(tanh(checkpoint(CheckpointOptions{"seg"}, [](const Tensor& a) { return tanh(a); }, h)));
    offload.flush();
    CHECK(offload.stats().files_written == 1);
  }
  REQUIRE(asked.size() == 2);
  CHECK(asked[0] == std::make_pair(std::string("seg"), SavedBy::checkpoint));
  CHECK(asked[1] == std::make_pair(std::string("tanh"), SavedBy::op));
  y.backward();
  CHECK(x.grad().defined());
}

TEST_CASE("Offload: a chain's snapshots go through the store, gradients bitwise", "[offload][chain]") {
  test::TempDir dir;
  const auto [plain, none] = gpt_gradients("sqrt", std::nullopt);
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  o.only = [](const AnyTensor&, const SaveContext& c) { return c.by == SavedBy::chain; };
  const auto [offloaded, stats] = gpt_gradients("sqrt", o);
  CHECK(offloaded == plain);
  CHECK(stats.files_written > 0);
  CHECK(stats.reads > 0);
}

TEST_CASE("Offload inside a MemoryBudget: large tensors go to files, the budget caps what stays, gradients bitwise",
          "[offload][budget]") {
  test::TempDir dir;
  const auto plain = gpt_gradients("none", std::nullopt).first;
  struct Run {
    std::vector<std::vector<float>> grads;
    OffloadStats offload;
    BudgetLog log;
    std::size_t peak = 0;  // of the activation bytes saved in RAM
  };
  auto run = [&](std::optional<std::size_t> budget) {
    test::GptStep s("none");
    manual_seed(9);
    Run r;
    {
      std::optional<MemoryBudget> guard;
      if (budget) guard.emplace(*budget);
      MemoryScope scope;
      {
        OffloadOptions o;
        o.directory = dir.path;
        o.min_bytes = 4096;  // the MLP's (2, 12, 64) activations; the budget keeps the rest
        o.wait_for_writes = true;
        Offload offload(o);  // inside the budget: asked first
        s.loss().backward();
        r.offload = offload.stats();
      }
      r.peak = scope.peak_saved_activation_bytes() - scope.start_saved_activation_bytes();
      if (guard) r.log = guard->last_log();
    }
    r.grads = test::gradients(s.gpt);
    return r;
  };
  const Run offloaded = run(std::nullopt);
  REQUIRE(offloaded.grads == plain);
  REQUIRE(offloaded.offload.files_written > 0);
  const std::size_t budget = offloaded.peak * 3 / 4;
  const Run both = run(budget);
  INFO("offload alone keeps " << offloaded.peak << " B in RAM at most; under a budget of " << budget << " B: "
                              << both.peak << " B, " << both.log.discards << " discards");
  CHECK(both.grads == plain);
  CHECK(both.offload.files_written == offloaded.offload.files_written);
  CHECK(both.log.discards > 0);
  CHECK(both.peak <= budget);
  CHECK(files_in(dir.path).empty());
}

TEST_CASE("Offload: a trace shows the writes and reads on the I/O thread and the store's bytes", "[offload][trace]") {
  test::TempDir dir;
  const std::string path = dir.path + "/offload.trace.json";
  OffloadOptions o;
  o.directory = dir.path;
  o.min_bytes = 0;
  {
    Trace trace(path);
    gpt_gradients("blocks", o);
  }
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  std::set<int> io_threads, op_threads;
  std::size_t writes = 0, reads = 0, counters = 0;
  std::int64_t most_ram = 0;
  for (const auto& e : j.at("traceEvents")) {
    const std::string ph = e.at("ph"), cat = e.at("cat");
    if (ph == "B" && cat == "offload") {
      const std::string name = e.at("name");
      writes += name.rfind("offload write", 0) == 0;
      reads += name.rfind("offload read", 0) == 0;
      io_threads.insert(e.at("tid").get<int>());
    } else if (ph == "B") {
      op_threads.insert(e.at("tid").get<int>());
    } else if (ph == "C" && e.at("name") == "offload store") {
      ++counters;
      most_ram = std::max<std::int64_t>(most_ram, e.at("args").at("RAM bytes"));
    }
  }
  fs::remove(path);
  CHECK(writes > 0);
  CHECK(reads > 0);
  CHECK(counters > 0);
  CHECK(most_ram > 0);
  REQUIRE(io_threads.size() == 1);
  CHECK(op_threads.count(*io_threads.begin()) == 0);  // its own thread, apart from the ops'
}

TEST_CASE("Offload: bad options are errors", "[offload]") {
  REQUIRE_ERROR(Offload(OffloadOptions{}), "Offload", "directory is empty");
  OffloadOptions o;
  o.directory = "/proc/remat-cannot-be-here";
  REQUIRE_ERROR(Offload(o), "Offload", "cannot make the directory", "/proc/remat-cannot-be-here");
}
