#pragma once
// Where a chain keeps a state it will come back to: in memory (counted as saved for backward while
// held), or in a file (the slower, larger tier: written once, read back on every restore). A file
// carries the tensor's shape, its byte count and a hash of its bytes; a file missing, truncated or
// altered between forward and backward is a remat::Error naming it, never a wrong gradient. The
// file is removed when the snapshot is dropped — after the backward, or during unwinding when an
// exception ends it early — so the directory is left as it was found.

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "remat/checkpoint/replay.hpp"
#include "remat/core/error.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

class Snapshot {
 public:
  virtual ~Snapshot() = default;
  /// The kept state (read back from its tier).
  virtual Tensor load() const = 0;
};

/// A kept state in memory, counted as saved for backward while held.
class MemorySnapshot final : public Snapshot {
 public:
  explicit MemorySnapshot(const Tensor& t) : tensor_(t.detach()) { tensor_.storage()->retain_saved(); }
  ~MemorySnapshot() override { tensor_.storage()->release_saved(); }
  MemorySnapshot(const MemorySnapshot&) = delete;
  MemorySnapshot& operator=(const MemorySnapshot&) = delete;
  Tensor load() const override { return tensor_; }

 private:
  Tensor tensor_;
};

/// A kept state in a file of its own under `directory`.
class DiskSnapshot final : public Snapshot {
 public:
  DiskSnapshot(const Tensor& t, const std::string& directory, std::int64_t position) : shape_(t.shape()) {
    static std::atomic<std::uint64_t> serial{0};
    path_ = fmt::format("{}/remat-{}-{}-x{}.snapshot", directory, ::getpid(), serial.fetch_add(1), position);
    bytes_ = t.nbytes();
    hash_ = fingerprint(t);
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    REMAT_CHECK(out.good(), "chain snapshot: cannot create '{}' (does the directory exist and is it writable?)", path_);
    Header header{kMagic, static_cast<std::uint64_t>(shape_.rank()), {}, bytes_, hash_};
    for (int d = 0; d < shape_.rank(); ++d) header.dims[d] = static_cast<std::uint64_t>(shape_[d]);
    out.write(reinterpret_cast<const char*>(&header), sizeof header);
    out.write(static_cast<const char*>(static_cast<const void*>(t.data())), static_cast<std::streamsize>(bytes_));
    out.close();
    if (!out.good()) {
      std::remove(path_.c_str());
      throw Error(fmt::format("chain snapshot: writing {} bytes to '{}' failed (disk full?)", bytes_, path_));
    }
  }
  ~DiskSnapshot() override { std::remove(path_.c_str()); }
  DiskSnapshot(const DiskSnapshot&) = delete;
  DiskSnapshot& operator=(const DiskSnapshot&) = delete;

  Tensor load() const override {
    std::ifstream in(path_, std::ios::binary);
    REMAT_CHECK(in.good(), "chain snapshot: the file '{}' holding state {} is missing; it was removed between "
                "forward and backward", path_, shape_);
    Header h{};
    in.read(reinterpret_cast<char*>(&h), sizeof h);
    bool ok = in.gcount() == static_cast<std::streamsize>(sizeof h) && h.magic == kMagic && h.bytes == bytes_ &&
              h.rank == static_cast<std::uint64_t>(shape_.rank()) && h.hash == hash_;
    for (int d = 0; ok && d < shape_.rank(); ++d) ok = h.dims[d] == static_cast<std::uint64_t>(shape_[d]);
    REMAT_CHECK(ok, "chain snapshot: the file '{}' does not hold the state of shape {} written to it (its header "
                "was changed or truncated)", path_, shape_);
    Tensor t(shape_);
    in.read(static_cast<char*>(static_cast<void*>(t.data())), static_cast<std::streamsize>(bytes_));
    REMAT_CHECK(in.gcount() == static_cast<std::streamsize>(bytes_),
                "chain snapshot: the file '{}' is truncated: {} of {} bytes of state {} left", path_, in.gcount(),
                bytes_, shape_);
    REMAT_CHECK(in.peek() == std::char_traits<char>::eof(), "chain snapshot: the file '{}' has bytes past its end", path_);
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
  std::string path_;
  std::size_t bytes_ = 0;
  std::uint64_t hash_ = 0;
};

}  // namespace remat::detail
