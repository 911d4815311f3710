#pragma once
// Where a chain keeps a state it will come back to: in memory (counted as saved for backward while
// held), or in a file (the slower, larger tier: written once, read back on every restore). A file
// carries the tensor's shape, its byte count and a hash of its bytes; a file missing, truncated or
// altered between forward and backward is a remat::Error naming it, never a wrong gradient. The
// file is removed when the snapshot is dropped — after the backward, or during unwinding when an
// exception ends it early — so the directory is left as it was found; every I/O error carries the
// OS's reason.

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "remat/checkpoint/replay.hpp"
#include "remat/schedule/schedule.hpp"
#include "remat/core/error.hpp"
#include "remat/core/file_io.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

class Snapshot {
 public:
  virtual ~Snapshot() = default;
  /// The kept state (read back from its tier).
  virtual Tensor load() const = 0;
};

/// A kept state in memory, counted as saved for backward while held — or handed to the saved-tensor
/// store in force (an Offload scope, say), as a node's saved tensors are: SavedBy::chain.
class MemorySnapshot final : public Snapshot {
 public:
  explicit MemorySnapshot(const Tensor& t) {
    held_.emplace_back(t);
    pack_saved(held_, SaveContext{"chain snapshot", SavedBy::chain});
    held_.front().retain();
  }
  ~MemorySnapshot() override { held_.front().release(); }
  MemorySnapshot(const MemorySnapshot&) = delete;
  MemorySnapshot& operator=(const MemorySnapshot&) = delete;
  Tensor load() const override { return held_.front().get<float>("chain snapshot"); }

 private:
  std::vector<SavedTensor> held_;  // one: pack_saved takes a node's list
};

/// A kept state in a file of its own under `directory` (made absolute when the file is made).
/// Only the process that made the file removes it: a child forked after the forward holds copies
/// of the snapshots, and its exit must not delete the files its parent's backward will read.
class DiskSnapshot final : public Snapshot {
 public:
  DiskSnapshot(const Tensor& t, const std::string& directory, std::int64_t position)
      : shape_(t.shape()), owner_(::getpid()) {
    static std::atomic<std::uint64_t> serial{0};
    path_ = fmt::format("{}/remat-{}-{}-x{}.snapshot", absolute_directory(directory), owner_, serial.fetch_add(1),
                        position);
    bytes_ = t.nbytes();
    hash_ = fingerprint(t);
    Header header{kMagic, static_cast<std::uint64_t>(shape_.rank()), {}, bytes_, hash_};
    for (int d = 0; d < shape_.rank(); ++d) header.dims[d] = static_cast<std::uint64_t>(shape_[d]);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REMAT_CHECK(fd >= 0, "chain snapshot: cannot create '{}': {} (does the directory exist and is it writable?)", path_,
                std::strerror(errno));
    const bool written = write_fully(fd, &header, sizeof header) && write_fully(fd, t.data(), bytes_);
    const int write_error = errno;
    if (::close(fd) != 0 || !written) {
      const std::string why = std::strerror(written ? errno : write_error);
      ::unlink(path_.c_str());
      throw Error(fmt::format("chain snapshot: writing {} bytes to '{}' failed: {}", bytes_, path_, why));
    }
  }
  ~DiskSnapshot() override {
    if (::getpid() == owner_) FileRemovals::process().remove(path_, false);  // a failure is tried again later
  }
  DiskSnapshot(const DiskSnapshot&) = delete;
  DiskSnapshot& operator=(const DiskSnapshot&) = delete;

  Tensor load() const override {
    const FileDescriptor file{::open(path_.c_str(), O_RDONLY | O_CLOEXEC)};
    if (file.fd < 0) {
      const int why = errno;
      REMAT_CHECK(why != ENOENT, "chain snapshot: the file '{}' holding state {} is missing ({}); it was removed "
                  "between forward and backward", path_, shape_, std::strerror(why));
      throw Error(fmt::format("chain snapshot: cannot open the file '{}' holding state {}: {}", path_, shape_,
                              std::strerror(why)));
    }
    Header h{};
    bool ok = read_fully(file.fd, &h, sizeof h, path_) == sizeof h && h.magic == kMagic && h.bytes == bytes_ &&
              h.rank == static_cast<std::uint64_t>(shape_.rank()) && h.hash == hash_;
    for (int d = 0; ok && d < shape_.rank(); ++d) ok = h.dims[d] == static_cast<std::uint64_t>(shape_[d]);
    REMAT_CHECK(ok, "chain snapshot: the file '{}' does not hold the state of shape {} written to it (its header "
                "was changed or truncated)", path_, shape_);
    Tensor t(shape_);
    const std::size_t got = read_fully(file.fd, t.data(), bytes_, path_);
    REMAT_CHECK(got == bytes_, "chain snapshot: the file '{}' is truncated: {} of {} bytes of state {} left", path_, got,
                bytes_, shape_);
    char extra = 0;
    REMAT_CHECK(read_fully(file.fd, &extra, 1, path_) == 0, "chain snapshot: the file '{}' has bytes past its end", path_);
    REMAT_CHECK(fingerprint(t) == hash_,
                "chain snapshot: the bytes in '{}' changed since they were written (state {})", path_, shape_);
    return t;
  }

  const std::string& path() const { return path_; }

 private:
  static constexpr std::uint64_t kMagic = 0x31544e5350414d52ull;  // "RMAPSNT1"
  struct Header {
    std::uint64_t magic;
    std::uint64_t rank;
    std::uint64_t dims[Shape::kMaxRank];
    std::uint64_t bytes;
    std::uint64_t hash;
  };

  Shape shape_;
  ::pid_t owner_;
  std::string path_;
  std::size_t bytes_ = 0;
  std::uint64_t hash_ = 0;
};

}  // namespace remat::detail
