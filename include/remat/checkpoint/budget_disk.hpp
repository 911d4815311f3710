#pragma once
// A MemoryBudget's files (BudgetOffload): one directory per budget, an output's bytes per file,
// synced and dropped from the page cache so RAM holds no copy, checked against a hash when read
// back; and the speeds, measured as it goes, that weigh the disk against recomputing. The budget
// decides and keeps the books (checkpoint/runtime_budget.hpp); this is only the disk.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "remat/core/error.hpp"
#include "remat/core/file_io.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/memory.hpp"

namespace remat {

/// A MemoryBudget's second way to make room: an output it would discard is written to a file and
/// read back when backward needs it, where that is quicker than recomputing it.
struct BudgetOffload {
  /// Where the files go: a subdirectory per budget (`remat-budget-<pid>-<n>`), removed when it ends
  /// (those a process that died left are removed when a budget starts).
  std::string directory;
  ///@{
  /// First guesses, each used until the budget has timed its own: the disk's bytes per second
  /// each way (its writes and reads), and the seconds a flop of recomputing takes (its
  /// recomputations; an element-wise op's bytes count as flops, as in the discard heuristic).
  double disk_bytes_per_second = 1e9;
  double seconds_per_flop = 2.2e-12;
  ///@}
};

namespace detail {

class BudgetDisk {
 public:
  explicit BudgetDisk(BudgetOffload options) : options_(std::move(options)) {
    static std::atomic<std::uint64_t> budgets{0};
    REMAT_CHECK(!options_.directory.empty(), "MemoryBudget: BudgetOffload needs a directory for its files");
    remove_dead_process_directories(options_.directory, "remat-budget-");
    directory_ = fmt::format("{}/remat-budget-{}-{}", options_.directory, ::getpid(),
                             budgets.fetch_add(1, std::memory_order_relaxed));
    REMAT_CHECK(::mkdir(directory_.c_str(), 0700) == 0 || errno == EEXIST,
                "MemoryBudget: cannot make the directory '{}' for its files: {}", directory_, std::strerror(errno));
  }
  ~BudgetDisk() {
    // The directory with whatever is left in it; a removal that fails is tried again later.
    FileRemovals::process().remove(directory_, true);
  }
  BudgetDisk(const BudgetDisk&) = delete;
  BudgetDisk& operator=(const BudgetDisk&) = delete;

  /// Whether writing `bytes` out and reading them back would take less time than recomputing what
  /// the discard heuristic prices at `recompute_cost`, each at the speed measured so far.
  bool quicker(std::size_t bytes, double recompute_cost) const {
    const double write_speed = write_seconds_ > 0 ? written_ / write_seconds_ : options_.disk_bytes_per_second;
    const double read_speed = read_seconds_ > 0 ? read_ / read_seconds_ : options_.disk_bytes_per_second;
    const double per_cost = recomputed_ > 0 ? recompute_seconds_ / recomputed_ : options_.seconds_per_flop;
    const double b = static_cast<double>(bytes);
    return b / write_speed + b / read_speed < recompute_cost * per_cost;
  }
  /// A recomputation priced at `cost` took `seconds`: recomputing's measured speed.
  void recomputed(double cost, double seconds) {
    recomputed_ += cost;
    recompute_seconds_ += seconds;
  }

  /// Writes the storage's bytes to a file of its own and syncs it (the page cache let go); the
  /// seconds it took, or nothing, leaving nothing behind, when the disk refuses.
  std::optional<double> write(const Storage& s) {
    const auto start = std::chrono::steady_clock::now();
    const std::string path = fmt::format("{}/{}.bin", directory_, s.serial());
    bool ok = false;
    {
      FileDescriptor f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
      ok = f.fd >= 0 && write_fully(f.fd, s.raw_data(), s.bytes()) && ::fdatasync(f.fd) == 0;
      if (ok) ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    if (!ok) {
      FileRemovals::process().remove(path, false);
      return std::nullopt;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    written_ += static_cast<double>(s.bytes());
    write_seconds_ += seconds;
    files_[s.serial()] = {path, s.bytes(), checksum64(s.raw_data(), s.bytes())};
    return seconds;
  }

  /// Whether the output of storage `serial` is in a file.
  bool holds(std::uint64_t serial) const { return files_.count(serial) > 0; }

  /// The file of `serial` read into `fresh` (of its bytes) and removed, checked against what was
  /// written: a missing, short or altered file is a remat::Error naming it. The seconds it took.
  double read(std::uint64_t serial, Storage& fresh) {
    const File file = files_.at(serial);
    files_.erase(serial);
    struct Unlink {
      const std::string& path;
      ~Unlink() { FileRemovals::process().remove(path, false); }  // read or refused, the file has served
    } unlink{file.path};
    REMAT_ASSERT(fresh.bytes() == file.bytes);
    const auto start = std::chrono::steady_clock::now();
    {
      FileDescriptor f{::open(file.path.c_str(), O_RDONLY | O_CLOEXEC)};
      REMAT_CHECK(f.fd >= 0, "MemoryBudget: cannot open '{}', where a discarded output of {} B was written: {}",
                  file.path, file.bytes, std::strerror(errno));
      const std::size_t got = read_fully(f.fd, fresh.raw_data(), file.bytes, file.path, "MemoryBudget");
      char extra = 0;
      REMAT_CHECK(got == file.bytes && read_fully(f.fd, &extra, 1, file.path, "MemoryBudget") == 0,
                  "MemoryBudget: the file '{}' does not hold the {} B written to it", file.path, file.bytes);
      ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    REMAT_CHECK(checksum64(fresh.raw_data(), file.bytes) == file.hash,
                "MemoryBudget: the file '{}' was altered since it was written (its bytes' hash differs)", file.path);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    read_ += static_cast<double>(file.bytes);
    read_seconds_ += seconds;
    return seconds;
  }

  /// The file of `serial`, if any, removed: its output is back another way, or gone for good.
  void drop(std::uint64_t serial) {
    if (auto f = files_.find(serial); f != files_.end()) {
      FileRemovals::process().remove(f->second.path, false);
      files_.erase(f);
    }
  }

 private:
  struct File {
    std::string path;
    std::size_t bytes = 0;
    std::uint64_t hash = 0;
  };
  BudgetOffload options_;
  std::string directory_;
  std::unordered_map<std::uint64_t, File> files_;  // by storage serial
  // Measured: bytes and seconds of writes and of reads, heuristic cost and seconds of recomputations.
  double written_ = 0, write_seconds_ = 0, read_ = 0, read_seconds_ = 0, recomputed_ = 0, recompute_seconds_ = 0;
};

}  // namespace detail
}  // namespace remat
