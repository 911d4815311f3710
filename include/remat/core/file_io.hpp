#pragma once
// The few POSIX file calls that keep a tensor's bytes in a file (a chain's disk snapshots, the
// offload store): whole reads and writes through EINTR and short counts, and a descriptor closed
// on every path. Errors carry the OS's reason and the file's name.

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

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

/// Closes a file descriptor when it goes out of scope.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace remat::detail
