#pragma once
// The few POSIX file calls that keep a tensor's bytes in a file (a chain's disk snapshots, the
// offload store, a memory budget's disk): whole reads and writes through EINTR and short counts, a
// descriptor closed on every path, and removals that are tried again until they succeed
// (FileRemovals). Errors carry the OS's reason and the file's name.

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "remat/core/error.hpp"

namespace remat::detail {

/// Reads up to `size` bytes (fewer only at the end of the file); an error names `who`, the file
/// and the OS's reason.
inline std::size_t read_fully(int fd, void* out, std::size_t size, const std::string& path,
                              const char* who = "chain snapshot") {
  std::size_t done = 0;
  while (done < size) {
    const ::ssize_t n = ::read(fd, static_cast<char*>(out) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    REMAT_CHECK(n >= 0, "{}: cannot read the file '{}': {}", who, path, std::strerror(errno));
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  return done;
}

/// Writes all `size` bytes, or returns false with errno telling why.
inline bool write_fully(int fd, const void* data, std::size_t size) {
  std::size_t done = 0;
  while (done < size) {
    const ::ssize_t n = ::write(fd, static_cast<const char*>(data) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = ENOSPC;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
  }
  return true;
}

/// Removes the directories under `root` named `<prefix><pid>-<n>` whose process has died (a store
/// that writes files makes one per scope so named, and removes it itself unless the process dies
/// first); returns how many.
inline std::size_t remove_dead_process_directories(const std::string& root, std::string_view prefix) {
  std::size_t removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0 || !entry.is_directory(ec)) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || end == nullptr || *end != '-' || pid == static_cast<long>(::getpid())) continue;
    if (::kill(static_cast<::pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    std::filesystem::remove_all(entry.path(), ec);
    if (!ec) ++removed;
  }
  return removed;
}

/// Every removal of a file remat wrote for a while (offloaded tensors, a chain's disk snapshots, a
/// memory budget's files) goes through here, and the ones that fail are remembered and tried
/// again: at every later removal, when an Offload scope starts or ends, at remove_left_files() and
/// at exit (this object's destructor), whatever made them fail (a directory made unwritable or
/// unreadable under the store) may have passed by then. What is still there at exit is named on
/// stderr: the process cannot say it later. Process-wide (every store, thread and directory), and
/// anew in a forked child, whose copy names its parent's files.
class FileRemovals {
 public:
  /// The process's list. Never destroyed: a store's file may be removed by a static's destructor
  /// at exit, after a function-local static would be gone; what is left is tried once more and
  /// named at exit (std::atexit) instead.
  static FileRemovals& process() {
    static FileRemovals* const removals = [] {
      auto* made = new FileRemovals;  // NOLINT: deliberately never deleted (above)
      std::atexit([] { process().retry_and_report(); });
      return made;
    }();
    return *removals;
  }
  FileRemovals() = default;
  ~FileRemovals() { retry_and_report(); }
  FileRemovals(const FileRemovals&) = delete;
  FileRemovals& operator=(const FileRemovals&) = delete;

  /// Removes the file at `path` (a directory, with what it holds, when `directory`); empty when it
  /// is gone, else why not: it is then remembered and tried again later.
  std::string remove(const std::string& path, bool directory) {
    if (pending_.load(std::memory_order_relaxed)) retry();  // what could not go before may go now
    const int error = remove_now(path, directory);
    if (error == 0) return {};
    std::lock_guard<std::mutex> lock(mutex_);
    mine();
    left_.emplace(path, directory);
    pending_.store(true, std::memory_order_relaxed);
    return fmt::format("cannot remove '{}': {}; tried again at later removals and at exit", path,
                       std::strerror(error));
  }
  /// Tries every path remembered again; those still there (a directory's before what it holds).
  std::vector<std::string> retry() {
    std::map<std::string, bool> paths;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mine();
      paths = left_;
    }
    std::vector<std::string> still;
    for (const auto& [path, directory] : paths) {
      if (remove_now(path, directory) != 0) still.push_back(path);
      else forget(path);
    }
    return still;
  }
  /// retry(), then names on stderr what is still there (at exit: the process cannot say it later).
  void retry_and_report() {
    const std::vector<std::string> still = retry();
    if (still.empty()) return;
    std::string names;
    for (const std::string& path : still) names += "\n  " + path;
    std::fprintf(stderr, "remat: %zu file(s) or directories it wrote could not be removed at exit:%s\n", still.size(),
                 names.c_str());
  }
  /// Tests: a removal of a path for which `fail` returns an errno value fails with it, as a
  /// directory made unwritable makes it fail (which tests running as root cannot: root ignores a
  /// directory's permissions). Empty: every removal is tried for real.
  void fail_for_test(std::function<int(const std::string&)> fail) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_ = std::move(fail);
  }

 private:
  /// 0 when `path` is gone, else the errno of the removal that failed.
  int remove_now(const std::string& path, bool directory) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (const int injected = fail_ ? fail_(path) : 0) return injected;
    }
    // remove(3), as the stores called it: a file, or an empty directory in its place.
    if (!directory) return std::remove(path.c_str()) == 0 || errno == ENOENT ? 0 : errno;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    return ec.value();
  }
  void forget(const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    left_.erase(path);
    pending_.store(!left_.empty(), std::memory_order_relaxed);
  }
  /// Under mutex_: a forked child starts with nothing to retry (the paths are its parent's).
  void mine() {
    if (owner_ == ::getpid()) return;
    owner_ = ::getpid();
    left_.clear();
    pending_.store(false, std::memory_order_relaxed);
  }

  std::mutex mutex_;
  ::pid_t owner_ = ::getpid();
  std::map<std::string, bool> left_;  // path -> whether a directory; sorted, so a directory comes before its files
  std::function<int(const std::string&)> fail_;
  std::atomic<bool> pending_{false};  // left_ is not empty (read without the lock: a hint)
};

/// Closes a file descriptor when it goes out of scope.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace remat::detail

namespace remat {

/// Tries again every removal of a file remat wrote that failed (an offloaded tensor, a chain's disk
/// snapshot, a memory budget's file, their directories: a directory made unwritable under the
/// store, say); returns the paths still there. Failed removals are also tried again at later
/// removals and at exit, where what is left is named on stderr.
inline std::vector<std::string> remove_left_files() { return detail::FileRemovals::process().retry(); }

}  // namespace remat
