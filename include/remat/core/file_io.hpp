#pragma once
// The few POSIX file calls that keep a tensor's bytes in a file (a chain's disk snapshots, the
// offload store): whole reads and writes through EINTR and short counts, and a descriptor closed
// on every path. Errors carry the OS's reason and the file's name.

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>

#include <fcntl.h>
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

/// Closes a file descriptor when it goes out of scope.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace remat::detail
