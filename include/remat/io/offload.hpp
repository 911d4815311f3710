#pragma once
// Offload: activations saved for backward written to disk while the forward goes on, and read back
// ahead of the backward that needs them — the third choice beside keeping a tensor in RAM and
// recomputing it. A saved-tensor store on the one seam (core/saved_tensor_hooks.hpp), so plain
// saved tensors, checkpoint boundaries and the outputs selective checkpointing keeps all take the
// same path; what a store declines stays with its node, in the books, as without it.
//
//   remat::Offload offload({.directory = "/var/tmp/act", .min_bytes = 1 << 20});
//   Tensor loss = model(x);   // large saved tensors are queued for writing as their nodes record
//   loss.backward();          // each read back before its node's backward asks for it
//
// How it moves. A pack hands the tensor to the store's I/O thread and returns at once: the compute
// threads never wait on a write. Once a file is written the store lets go of the tensor's RAM (the
// bytes are freed when nothing else holds them). Backward reads in the reverse order of the
// forward's saves, which the store knows, so when backward begins and at every read it starts reads
// of the next `prefetch` tensors on disk, into an arena of at most `arena_bytes` (what was read
// back stays there until its node has run its backward); a read that was not ready when backward
// asked for it is late (counted, and backward waits for it). Under retain_graph the tensors read
// back stay in RAM as long as the graph does. A tensor whose write has not ended when backward asks
// for it is taken from RAM as it is, and writes not begun when backward begins are called off:
// backward reads those tensors first, before a file could help (with a disk slower than the
// forward, the last tensors saved are still queued then).
//
// What it never offloads: tensors made before the scope began (parameters, the step's inputs: alive
// anyway), tensors under `min_bytes`, those `only` turns down, and anything saved inside a backward
// (a checkpoint's replay is backpropagated at once). Stores nest: inside a MemoryBudget, what the
// offload declines the budget keeps; a budget inside an Offload scope keeps every activation itself.
//
// Correct by construction: each file holds a header (which tensor, its shape, element type and byte
// count) and a checksum of its bytes; a file missing, truncated, swapped for another or altered is a
// remat::Error naming it, never a wrong gradient. A tensor written in place after it was saved is
// the same error it is in RAM while the tensor lives (and also when the write came while its file
// was being written); one written after its file was complete and gone by backward is not seen —
// the file holds the forward's values, so that gradient is still right. A write that fails (a full
// disk, or more than `disk_bytes` on disk) keeps the tensor in RAM, the step goes on, and stats()
// says which write failed and why. Files are removed by the I/O thread once their node has run its
// backward (or is freed by an exception's unwinding), all of them before the outermost backward
// returns (or, with reuse_files, renamed aside for later writes to overwrite: see the option); the
// scope's directory when the last of its tensors is gone; and at construction the directories of
// dead processes left under `directory` (named remat-offload-<pid>-<n> and -<pid>-kept; processes
// sharing the directory must share a pid namespace). A removal that fails (the directory made
// unwritable or unreadable under the scope, by another user or an administrator) is counted in
// stats() (removal_failures, first_removal_error) and tried again whenever a scope starts or ends,
// at Offload::remove_left_files() (which returns what is still there) and at exit, so that the
// files go once they can; what is still there at exit is named on stderr, and after a crash the
// next process's start removes the directory as a dead process's.
//
// The store's own RAM: the tensors waiting for their write (still in memory_stats()'s live bytes),
// the read-ahead arena (live bytes too), and a 2 MiB staging buffer for direct I/O (outside the
// books). Files are written with O_DIRECT where the file system takes it, so the page cache does
// not keep a second copy in RAM. The staging buffer is one huge page where the kernel grants it:
// O_DIRECT pins the buffer's pages for every transfer, and 512 small pages cost the I/O thread's
// core 0.04-0.08 s of system time per GiB on this project's VMs, one huge page 0.01 s.

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <algorithm>
#include <any>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "remat/core/bfloat16.hpp"
#include "remat/core/error.hpp"
#include "remat/core/file_io.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/observer.hpp"
#include "remat/core/saved_tensor.hpp"
#include "remat/core/saved_tensor_hooks.hpp"
#include "remat/core/session.hpp"
#include "remat/core/timeline.hpp"

namespace remat {

/// What an Offload scope writes, and how it reads ahead.
struct OffloadOptions {
  /// Where the files go: the scope makes a subdirectory of its own (made if missing).
  std::string directory;
  /// Saved tensors smaller than this stay in RAM.
  std::size_t min_bytes = std::size_t{1} << 20;
  /// Which tensors to offload, among those the rules above allow (all, when empty).
  std::function<bool(const AnyTensor&, const SaveContext&)> only;
  /// How many tensors on disk are read ahead of the one backward reads.
  std::size_t prefetch = 4;
  /// The most bytes read back and not yet let go by their nodes (one read is always allowed).
  std::size_t arena_bytes = std::size_t{256} << 20;
  /// Float32 tensors written as their bfloat16 rounding (half the bytes; lossy, as SaveInBFloat16,
  /// which also leaves what a chain holds exact: its replays start from it).
  bool bfloat16 = false;
  /// The most bytes on disk at once: a write beyond it fails as on a full disk.
  std::size_t disk_bytes = std::numeric_limits<std::size_t>::max();
  /// O_DIRECT writes and reads (bypass the page cache) where the file system takes them.
  bool direct_io = true;
  /// Files let go are kept, renamed, for later writes of the same size (in this scope or a later one
  /// on the same directory) instead of removed: overwriting a file's blocks wrote 2.6-2.7 GB/s on
  /// this project's VMs against 1.3-1.6 for new files, and a rename is cheap where an unlink of a
  /// 2 MiB file blocked for 0.5 ms. The kept files stay on disk between steps, in
  /// `<directory>/remat-offload-<pid>-kept`, never more bytes than one scope had on disk at once;
  /// they go when the process exits, at Offload::remove_kept_files(), or at the next start if the
  /// process died. Off by default, because then nothing is left on disk after backward.
  bool reuse_files = false;
  /// Backward begins only once every queued write has ended, none called off, so each offloaded
  /// tensor goes through its file: for runs whose RAM must not hold them, and for tests of the
  /// files (by default the writes not begun are called off and those tensors read from RAM).
  bool wait_for_writes = false;
};

/// What an Offload scope has done.
struct OffloadStats {
  std::size_t offloaded = 0;       ///< tensors handed to the I/O thread
  std::size_t declined = 0;        ///< saved tensors left with their nodes
  std::size_t files_written = 0;   ///< writes that ended well
  std::size_t bytes_written = 0;   ///< their file bytes (headers and padding included)
  std::size_t write_failures = 0;  ///< writes that failed: those tensors stayed in RAM
  std::size_t writes_called_off = 0;  ///< writes not begun when backward began: read from RAM instead
  std::size_t files_reused = 0;    ///< writes over a kept file (OffloadOptions::reuse_files)
  std::string first_write_error;   ///< what the first failed write said
  std::size_t reads = 0;           ///< files read back
  std::size_t bytes_read = 0;      ///< their file bytes
  std::size_t late_reads = 0;      ///< reads backward waited for (not read ahead in time)
  std::size_t from_ram = 0;        ///< tensors backward took before their write ended
  std::size_t ram_bytes = 0;       ///< bytes the store holds in RAM now: waiting for a write, read ahead
  std::size_t peak_ram_bytes = 0;  ///< the most ram_bytes has been
  std::size_t disk_bytes = 0;      ///< bytes in files now
  std::size_t peak_disk_bytes = 0; ///< the most disk_bytes has been
  std::size_t stale_removed = 0;   ///< directories of dead processes removed at construction
  /// Files the scope could not remove when they were let go (their bytes are no longer in
  /// disk_bytes): each is tried again when a scope starts or ends, at Offload::remove_left_files()
  /// and at exit.
  std::size_t removal_failures = 0;
  std::string first_removal_error;  ///< what the first failed removal said
  double write_seconds = 0;        ///< the I/O thread's time writing
  double read_seconds = 0;         ///< the I/O thread's time reading
  double wait_seconds = 0;         ///< backward's time waiting for late reads
  bool direct_io = false;          ///< whether the files went through O_DIRECT
};

namespace detail {

/// The files Offload scopes let go under one directory, kept for later writes (reuse_files): one
/// pool per directory for the process, so a scope made for each step finds the files of the last.
class OffloadKeptFiles {
 public:
  /// The pool of `root` (made on first use, and anew in a forked child, whose copy of its
  /// parent's pool names the parent's files).
  static std::shared_ptr<OffloadKeptFiles> of(const std::string& root) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    std::shared_ptr<OffloadKeptFiles>& pool = registry()[root];
    if (!pool || pool->owner_ != ::getpid()) pool = std::make_shared<OffloadKeptFiles>(root);
    return pool;
  }
  /// Removes the kept files of every directory; how many there were.
  static std::size_t remove_all() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    std::size_t removed = 0;
    for (auto& [root, pool] : registry()) removed += pool->clear();
    return removed;
  }

  explicit OffloadKeptFiles(const std::string& root)
      : owner_(::getpid()), dir_(fmt::format("{}/remat-offload-{}-kept", root, owner_)) {}
  ~OffloadKeptFiles() { clear(); }
  OffloadKeptFiles(const OffloadKeptFiles&) = delete;
  OffloadKeptFiles& operator=(const OffloadKeptFiles&) = delete;

  /// Renames a kept file of at least `bytes` (the smallest) to `path`; its size, or 0 when none.
  std::size_t take(std::size_t bytes, const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = files_.lower_bound(bytes); it != files_.end(); it = files_.erase(it)) {
      const std::size_t size = it->first;
      const bool moved = ::rename(it->second.c_str(), path.c_str()) == 0;
      kept_bytes_ -= size;
      if (moved) {
        files_.erase(it);
        return size;
      }  // removed behind our back: forget it, try the next
    }
    return 0;
  }
  /// Keeps the file at `path` (of `bytes`), unless the pool would then hold more than the most any
  /// scope had on disk at once (the caller's so far is `peak`); false when the caller is to remove it.
  bool keep(const std::string& path, std::size_t bytes, std::size_t peak) {
    std::lock_guard<std::mutex> lock(mutex_);
    cap_ = std::max(cap_, peak);
    if (kept_bytes_ + bytes > cap_) return false;
    if (files_.empty()) {
      std::error_code ec;
      std::filesystem::create_directory(dir_, ec);
    }
    std::string to = fmt::format("{}/f{}.bin", dir_, next_++);
    if (::rename(path.c_str(), to.c_str()) != 0) return false;
    files_.emplace(bytes, std::move(to));
    kept_bytes_ += bytes;
    return true;
  }

 private:
  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<std::string, std::shared_ptr<OffloadKeptFiles>>& registry() {
    static FileRemovals& removals = FileRemovals::process();  // made first: its exit report comes after the pools go
    static std::map<std::string, std::shared_ptr<OffloadKeptFiles>> pools;  // removed at exit
    (void)removals;
    return pools;
  }
  /// Removes the kept files, in the process that kept them only: a forked child's exit must not
  /// take its parent's.
  std::size_t clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (::getpid() != owner_) return 0;
    const std::size_t n = files_.size();
    files_.clear();
    kept_bytes_ = 0;
    FileRemovals::process().remove(dir_, true);
    return n;
  }

  ::pid_t owner_;
  std::string dir_;
  std::mutex mutex_;
  std::multimap<std::size_t, std::string> files_;  // by size
  std::size_t kept_bytes_ = 0, cap_ = 0;
  std::uint64_t next_ = 0;
};

/// The store behind an Offload scope: its records, its I/O thread and its files. Shared by the
/// scope and every handle a node keeps, so backward may run after the scope ended; the last of them
/// joins the thread and removes the directory. The I/O thread holds no handle, so it never ends it.
class OffloadCore {
 public:
  static constexpr std::size_t kBlock = 4096;             // O_DIRECT's alignment of offsets and sizes
  static constexpr std::size_t kStaging = std::size_t{2} << 20;  // a huge page on x86-64
  static constexpr std::uint64_t kMagic = 0x31464f54414d4552ull;  // "REMATOF1"

  explicit OffloadCore(OffloadOptions options) : options_(std::move(options)) {
    REMAT_CHECK(!options_.directory.empty(), "Offload: OffloadOptions::directory is empty; name where the files go");
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(options_.directory, ec);
    REMAT_CHECK(!ec && fs::is_directory(options_.directory), "Offload: cannot make the directory '{}': {}",
                options_.directory, ec ? ec.message() : std::string("not a directory"));
    stats_.stale_removed = remove_dead_process_directories(options_.directory, "remat-offload-");
    FileRemovals::process().retry();  // what earlier scopes could not remove
    static std::atomic<std::uint64_t> scopes{0};
    dir_ = (fs::absolute(options_.directory) /
            fmt::format("remat-offload-{}-{}", ::getpid(), scopes.fetch_add(1, std::memory_order_relaxed)))
               .string();
    fs::create_directory(dir_, ec);
    REMAT_CHECK(!ec, "Offload: cannot make the directory '{}': {}", dir_, ec.message());
    staging_ = static_cast<unsigned char*>(std::aligned_alloc(kStaging, kStaging));
    REMAT_CHECK(staging_ != nullptr, "Offload: cannot allocate its {} B staging buffer", kStaging);
#ifdef MADV_HUGEPAGE
    ::madvise(staging_, kStaging, MADV_HUGEPAGE);  // a request: small pages where it is refused
#endif
    std::memset(staging_, 0, kStaging);  // its page faulted in here, not in the first write
    direct_ = options_.direct_io;
    if (options_.reuse_files)
      kept_ = OffloadKeptFiles::of(fs::absolute(options_.directory).lexically_normal().string());
    worker_ = std::thread([this] { work(); });
  }
  ~OffloadCore() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    worker_.join();
    std::free(staging_);
    FileRemovals& removals = FileRemovals::process();
    removals.remove(dir_, true);  // with the files of records dropped mid-write, if any
    removals.retry();             // and what earlier scopes could not remove
  }
  OffloadCore(const OffloadCore&) = delete;
  OffloadCore& operator=(const OffloadCore&) = delete;

  const std::string& directory() const { return dir_; }
  const OffloadOptions& options() const { return options_; }

  OffloadStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    OffloadStats s = stats_;
    s.direct_io = direct_used_;
    return s;
  }

  /// A new record for `t`, queued for writing; its sequence number.
  std::uint64_t add(const AnyTensor& t, const SaveContext& context) {
    const std::shared_ptr<Storage>& storage = t.ref().storage;
    Record r;
    r.ram = t.ref();
    r.original = storage;
    r.version = storage->version();
    r.op = std::string(context.op);
    r.shape = t.shape();
    r.dtype = t.dtype();
    // As SaveInBFloat16: never what a chain holds, since its replays start from it.
    r.narrow = options_.bfloat16 && t.is<float>() && context.by != SavedBy::chain;
    r.bytes = storage->bytes();
    r.payload = r.narrow ? r.bytes / 2 : r.bytes;
    std::lock_guard<std::mutex> lock(mutex_);
    const std::uint64_t seq = next_seq_++;
    r.path = fmt::format("{}/t{}.bin", dir_, seq);
    records_.emplace(seq, std::move(r));
    writes_.push_back(seq);
    ++stats_.offloaded;
    hold(records_.at(seq).bytes);
    wake_.notify_one();
    return seq;
  }

  void declined() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.declined;
  }

  /// The tensor of record `seq` for backward: from RAM, from the read-ahead arena, or read now.
  TensorRef take(std::uint64_t seq) {
    std::unique_lock<std::mutex> lock(mutex_);
    Record& r = records_.at(seq);
    TensorRef out;
    if (r.state == State::queued_write || r.state == State::writing || r.state == State::kept) {
      ++stats_.from_ram;
      out = r.ram;
    } else {
      if (r.state == State::on_disk && r.error.empty()) {
        r.state = State::read_queued;
        arena_ += r.bytes;
        hold(r.bytes);
        reads_.push_front(seq);
        wake_.notify_one();
      }
      if (r.state == State::read_queued || r.state == State::reading) {
        ++stats_.late_reads;
        const auto start = std::chrono::steady_clock::now();
        changed_.wait(lock, [&] { return r.state != State::read_queued && r.state != State::reading; });
        stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      if (!r.error.empty()) throw Error(r.error);
      REMAT_ASSERT(r.state == State::loaded);
      // Kept until the node lets go (right after its backward): a backward may read a saved tensor
      // more than once, and should not read its file twice.
      out = r.ram;
      r.taken = true;
    }
    if (r.poisoned)
      throw Error(modified_in_place(r.op, fmt::format("a tensor of shape {} (offloaded to '{}')", r.shape, r.path),
                                    r.version + 1, r.version, "while it was being written to disk"));
    read_ahead(records_.find(seq));
    return out;
  }

  /// Backward begins: writes not begun yet are called off (writing what backward reads first from
  /// RAM would cost the disk twice for nothing), and the reads of the last tensors on disk start.
  void backward_begins() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (options_.wait_for_writes) changed_.wait(lock, [&] { return writes_.empty() && !busy_writing_; });
    for (std::uint64_t seq : writes_) {
      const auto it = records_.find(seq);
      if (it == records_.end() || it->second.state != State::queued_write) continue;
      it->second.state = State::kept;
      ++stats_.writes_called_off;
    }
    writes_.clear();
    read_ahead(records_.end());
    changed_.notify_all();
  }

  /// Record `seq`'s node let go of it: its file and RAM go.
  void drop(std::uint64_t seq) {
    TensorRef ram;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = records_.find(seq);
      if (it == records_.end()) return;
      Record& r = it->second;
      ram = std::move(r.ram);
      if (r.state == State::queued_write || r.state == State::writing || r.state == State::kept) release(r.bytes);
      if (r.state == State::read_queued || r.state == State::reading || r.state == State::loaded) {
        arena_ -= r.bytes;
        release(r.bytes);
      }
      if (r.file) {
        // Unlinked by the I/O thread: ext4 took 0.5 ms to unlink a 2 MiB file here, all but 20 µs
        // of it waiting, which a compute thread would spend idle (and its team with it).
        removals_.push_back({r.path, file_size(r)});
        r.file = false;
        wake_.notify_one();
      }
      records_.erase(it);  // a write or read under way finds it gone and cleans up after itself
      changed_.notify_all();
    }
  }

  /// The outermost backward returned: the files its nodes let go are unlinked before it returns to
  /// the caller (most already were, beside the backward).
  void backward_ended() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return removals_.empty() && !busy_removing_; });
  }

  /// Waits until every write queued so far has ended.
  void flush() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return writes_.empty() && !busy_writing_; });
  }

  /// Where record `seq` is, in words.
  std::string describe(std::uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = records_.find(seq);
    if (it == records_.end()) return "offload: released";
    const Record& r = it->second;
    switch (r.state) {
      case State::queued_write: return fmt::format("offload: in RAM, to be written to '{}'", r.path);
      case State::writing: return fmt::format("offload: in RAM, being written to '{}'", r.path);
      case State::kept: return "offload: in RAM (its write failed, or was called off when backward began)";
      case State::on_disk: return fmt::format("offload: on disk, '{}'", r.path);
      case State::read_queued:
      case State::reading: return fmt::format("offload: being read back from '{}'", r.path);
      case State::loaded: return fmt::format("offload: read back ahead of backward, from '{}'", r.path);
    }
    return {};
  }

 private:
  enum class State { queued_write, writing, on_disk, read_queued, reading, loaded, kept };

  struct Record {
    TensorRef ram;  // until written (or for good, when the write failed); when read back
    std::weak_ptr<Storage> original;
    std::uint64_t version = 0;
    std::string op, path;
    Shape shape;
    const char* dtype = nullptr;
    bool narrow = false;
    std::size_t bytes = 0, payload = 0;  // in RAM; in the file after the header
    State state = State::queued_write;
    bool file = false, poisoned = false, taken = false;
    std::uint64_t checksum = 0;
    std::string error;  // a failed read's message, thrown to backward
  };

  struct Header {
    std::uint64_t magic, seq, rank, dims[Shape::kMaxRank], bytes, payload, narrow, checksum;
    char dtype[16];
  };
  static_assert(sizeof(Header) <= kBlock);

  static std::size_t file_size(const Record& r) { return kBlock + round_up(r.payload); }
  static std::size_t round_up(std::size_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

  void hold(std::size_t bytes) {
    stats_.ram_bytes += bytes;
    stats_.peak_ram_bytes = std::max(stats_.peak_ram_bytes, stats_.ram_bytes);
    to_timeline();
  }
  void release(std::size_t bytes) {
    stats_.ram_bytes -= bytes;
    to_timeline();
  }
  /// Removes the first file queued for removal (or keeps it, under reuse_files). Called with the
  /// lock held; drops it for the unlink.
  void remove_queued(std::unique_lock<std::mutex>& lock) {
    const Removal removal = std::move(removals_.front());
    removals_.pop_front();
    busy_removing_ = true;
    const std::size_t peak = stats_.peak_disk_bytes;
    lock.unlock();
    const std::string error = remove_file(removal.path, removal.bytes, peak);
    lock.lock();
    busy_removing_ = false;
    stats_.disk_bytes -= removal.bytes;
    removal_failed(error);
    to_timeline();
  }
  /// A file let go: kept for a later write (reuse_files), or unlinked; why it could not be, or
  /// empty. Without the lock.
  std::string remove_file(const std::string& path, std::size_t bytes, std::size_t peak) {
    if (kept_ && kept_->keep(path, bytes, peak)) return {};
    return FileRemovals::process().remove(path, false);
  }
  /// Counts a removal that failed (`error` empty: none did). Under mutex_.
  void removal_failed(const std::string& error) {
    if (error.empty()) return;
    ++stats_.removal_failures;
    if (stats_.first_removal_error.empty()) stats_.first_removal_error = "offload: " + error;
  }
  /// The store's RAM and disk bytes after a change, to the trace that records (if one does).
  void to_timeline() const {
    if (Timeline* t = active_timeline().load(std::memory_order_relaxed))
      t->counters("offload store", "RAM bytes", static_cast<std::int64_t>(stats_.ram_bytes), "disk bytes",
                  static_cast<std::int64_t>(stats_.disk_bytes));
  }

  /// Queues reads of the next `prefetch` records before `from` (in backward's order). Under mutex_.
  void read_ahead(std::map<std::uint64_t, Record>::iterator from) {
    std::size_t ahead = 0;
    bool queued = false;
    for (auto it = from; it != records_.begin() && ahead < options_.prefetch;) {
      Record& r = (--it)->second;
      if (r.state == State::read_queued || r.state == State::reading || (r.state == State::loaded && !r.taken)) {
        ++ahead;
      } else if (r.state == State::on_disk && r.error.empty()) {
        if (arena_ > 0 && arena_ + r.bytes > options_.arena_bytes) break;
        r.state = State::read_queued;
        arena_ += r.bytes;
        hold(r.bytes);
        reads_.push_back(it->first);
        queued = true;
        ++ahead;
      }
    }
    if (queued) wake_.notify_one();
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !reads_.empty() || !removals_.empty() || !writes_.empty(); });
      // Reads first (backward waits for them), then removals, so that a write's disk limit sees
      // every file let go before it.
      if (!reads_.empty()) {
        const std::uint64_t seq = reads_.front();
        reads_.pop_front();
        read(lock, seq);
      } else if (!removals_.empty()) {
        remove_queued(lock);
      } else if (!writes_.empty()) {
        const std::uint64_t seq = writes_.front();
        writes_.pop_front();
        busy_writing_ = true;
        write(lock, seq);
        busy_writing_ = false;
      } else if (stop_) {
        return;
      }
      changed_.notify_all();
    }
  }

  /// Opens `path` (O_DIRECT first, where wanted and taken).
  int open_file(const std::string& path, int flags) {
    if (direct_) {
      const int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
      if (fd >= 0 || errno != EINVAL) {
        if (fd >= 0) direct_used_ = true;
        return fd;
      }
      direct_ = false;  // this file system does not take O_DIRECT: buffered from now on
      if (flags & O_CREAT) ::unlink(path.c_str());
    }
    return ::open(path.c_str(), flags, 0600);
  }

  /// Writes record `seq`'s file. Called with the lock held; drops it for the I/O.
  void write(std::unique_lock<std::mutex>& lock, std::uint64_t seq) {
    auto it = records_.find(seq);
    if (it == records_.end() || it->second.state != State::queued_write) return;
    Record& r = it->second;
    r.state = State::writing;
    const TensorRef t = r.ram;
    const std::string path = r.path;
    const bool narrow = r.narrow;
    const std::size_t payload = r.payload, size = file_size(r);
    std::string failure;
    if (stats_.disk_bytes + size > options_.disk_bytes)
      failure = fmt::format("the store's disk limit of {} B would be passed ({} B on disk, {} B more)",
                            options_.disk_bytes, stats_.disk_bytes, size);
    else
      stats_.disk_bytes += size;  // reserved while writing
    std::uint64_t checksum = 0;
    bool reused = false;
    const auto start = std::chrono::steady_clock::now();
    if (failure.empty()) {
      lock.unlock();
      failure = write_file(path, t, seq, narrow, payload, size, checksum, reused);
      lock.lock();
      if (!failure.empty()) stats_.disk_bytes -= size;
    }
    stats_.files_reused += reused;
    stats_.write_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    it = records_.find(seq);
    if (it == records_.end()) {  // dropped while we wrote
      if (failure.empty()) {
        stats_.disk_bytes -= size;
        const std::size_t peak = stats_.peak_disk_bytes;
        lock.unlock();
        const std::string error = remove_file(path, size, peak);
        lock.lock();
        removal_failed(error);
      }
      return;
    }
    Record& done = it->second;
    if (!failure.empty()) {
      ++stats_.write_failures;
      if (stats_.first_write_error.empty())
        stats_.first_write_error = fmt::format("offload: writing a tensor of shape {} saved by {} to '{}' failed: {}; "
                                               "it stays in RAM", t.shape, done.op, path, failure);
      done.state = State::kept;
      return;
    }
    ++stats_.files_written;
    stats_.bytes_written += size;
    to_timeline();
    stats_.peak_disk_bytes = std::max(stats_.peak_disk_bytes, stats_.disk_bytes);
    done.file = true;
    done.checksum = checksum;
    done.poisoned = t.storage->version() != done.version;  // written in place while we copied it
    done.state = State::on_disk;
    done.ram = {};  // the bytes go when nothing else holds them
    release(done.bytes);
  }

  std::string write_file(const std::string& path, const TensorRef& t, std::uint64_t seq, bool narrow,
                         std::size_t payload, std::size_t size, std::uint64_t& checksum, bool& reused) {
    TimelineSpan span("offload", [&] { return fmt::format("offload write t{} ({} B)", seq, payload); });
    const std::size_t kept = kept_ ? kept_->take(size, path) : 0;
    const FileDescriptor file{kept > 0 ? open_file(path, O_WRONLY | O_CLOEXEC)
                                       : open_file(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC)};
    if (file.fd < 0) return fmt::format("cannot create the file: {}", std::strerror(errno));
    reused = kept > 0;
    // A larger kept file loses its tail (the blocks that stay are overwritten in place); so does one
    // grown since it was kept, or the read would find it extended.
    struct ::stat st {};
    if (reused && (::fstat(file.fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != size) &&
        ::ftruncate(file.fd, static_cast<::off_t>(size)) != 0)
      return std::strerror(errno);
    const auto* src = static_cast<const unsigned char*>(t.storage->raw_data());
    std::uint64_t h = kFnvOffset;
    std::size_t done = 0;
    // The header goes last, with the checksum: the block is written first as zeros.
    std::memset(staging_, 0, kBlock);
    if (!write_fully(file.fd, staging_, kBlock)) return std::strerror(errno);
    while (done < payload) {
      const std::size_t n = std::min(kStaging, payload - done);
      if (narrow) {
        narrow_to_bfloat16(reinterpret_cast<const float*>(src) + done / 2, reinterpret_cast<bfloat16*>(staging_),
                           static_cast<std::int64_t>(n / 2));
        h = checksum64(staging_, n, h);
      } else {
        h = copy_checksum64(staging_, src + done, n, h);
      }
      const std::size_t padded = round_up(n);
      std::memset(staging_ + n, 0, padded - n);
      if (!write_fully(file.fd, staging_, padded)) return std::strerror(errno);
      done += n;
    }
    Header header{};
    header.magic = kMagic;
    header.seq = seq;
    header.rank = static_cast<std::uint64_t>(t.shape.rank());
    for (int d = 0; d < t.shape.rank(); ++d) header.dims[d] = static_cast<std::uint64_t>(t.shape[d]);
    header.bytes = t.storage->bytes();
    header.payload = payload;
    header.narrow = narrow;
    header.checksum = h;
    std::snprintf(header.dtype, sizeof header.dtype, "%s", t.dtype);
    std::memset(staging_, 0, kBlock);
    std::memcpy(staging_, &header, sizeof header);
    if (::pwrite(file.fd, staging_, kBlock, 0) != static_cast<::ssize_t>(kBlock)) return std::strerror(errno);
    checksum = h;
    return {};
  }

  /// Reads record `seq`'s file back into fresh storage. Called with the lock held; drops it for the I/O.
  void read(std::unique_lock<std::mutex>& lock, std::uint64_t seq) {
    auto it = records_.find(seq);
    if (it == records_.end() || it->second.state != State::read_queued) return;
    Record& r = it->second;
    r.state = State::reading;
    Record copy;  // what the read needs, for use without the lock
    copy.op = r.op;
    copy.path = r.path;
    copy.shape = r.shape;
    copy.dtype = r.dtype;
    copy.narrow = r.narrow;
    copy.bytes = r.bytes;
    copy.payload = r.payload;
    copy.checksum = r.checksum;
    const auto start = std::chrono::steady_clock::now();
    lock.unlock();
    auto storage = std::make_shared<Storage>(copy.bytes);
    std::string error = read_file(copy, seq, *storage);
    lock.lock();
    stats_.read_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    it = records_.find(seq);
    if (it == records_.end()) return;  // dropped while we read: the storage goes with us
    Record& done = it->second;
    ++stats_.reads;
    stats_.bytes_read += file_size(done);
    if (!error.empty()) {
      done.error = std::move(error);
      done.state = State::on_disk;
      arena_ -= done.bytes;
      release(done.bytes);
      return;
    }
    done.ram = TensorRef{std::move(storage), done.shape, done.dtype};
    done.state = State::loaded;
  }

  std::string read_file(const Record& r, std::uint64_t seq, Storage& into) {
    const Shape& shape = r.shape;
    const char* dtype = r.dtype;
    TimelineSpan span("offload", [&] { return fmt::format("offload read t{} ({} B)", seq, r.payload); });
    const std::string what = fmt::format("the file '{}' holding a tensor of shape {} saved by {}", r.path, shape, r.op);
    const FileDescriptor file{open_file(r.path, O_RDONLY | O_CLOEXEC)};
    if (file.fd < 0) {
      const int why = errno;
      return why == ENOENT ? fmt::format("offload: {} is missing ({}); it was removed between forward and backward",
                                         what, std::strerror(why))
                           : fmt::format("offload: cannot open {}: {}", what, std::strerror(why));
    }
    struct ::stat st {};
    if (::fstat(file.fd, &st) != 0) return fmt::format("offload: cannot stat {}: {}", what, std::strerror(errno));
    const std::size_t expected = file_size(r);
    if (static_cast<std::size_t>(st.st_size) != expected)
      return fmt::format("offload: {} is {} B where {} B were written (truncated or extended)", what,
                         static_cast<std::size_t>(st.st_size), expected);
    try {
      if (read_fully(file.fd, staging_, kBlock, r.path, "offload") != kBlock)
        return fmt::format("offload: {} is truncated", what);
      Header h{};
      std::memcpy(&h, staging_, sizeof h);
      bool same = h.magic == kMagic && h.rank == static_cast<std::uint64_t>(shape.rank()) && h.bytes == r.bytes &&
                  h.payload == r.payload && h.narrow == static_cast<std::uint64_t>(r.narrow) &&
                  std::strncmp(h.dtype, dtype, sizeof h.dtype) == 0;
      for (int d = 0; same && d < shape.rank(); ++d) same = h.dims[d] == static_cast<std::uint64_t>(shape[d]);
      if (!same || h.seq != seq)
        return fmt::format("offload: {} holds another tensor (its header says #{}, this is #{}): was it swapped or "
                           "overwritten?", what, h.magic == kMagic ? h.seq : 0, seq);
      auto* dst = static_cast<unsigned char*>(into.raw_data());
      std::uint64_t sum = kFnvOffset;
      std::size_t done = 0;
      while (done < r.payload) {
        const std::size_t n = std::min(kStaging, r.payload - done), padded = round_up(n);
        if (read_fully(file.fd, staging_, padded, r.path, "offload") != padded)
          return fmt::format("offload: {} is truncated", what);
        if (r.narrow) {
          sum = checksum64(staging_, n, sum);
          widen_from_bfloat16(reinterpret_cast<const bfloat16*>(staging_), reinterpret_cast<float*>(dst) + done / 2,
                              static_cast<std::int64_t>(n / 2));
        } else {
          sum = copy_checksum64(dst + done, staging_, n, sum);
        }
        done += n;
      }
      if (sum != r.checksum || h.checksum != r.checksum)
        return fmt::format("offload: the bytes in {} changed since they were written (checksum)", what);
    } catch (const Error& e) {
      return e.what();
    }
    return {};
  }

  OffloadOptions options_;
  std::string dir_;
  unsigned char* staging_ = nullptr;  // the I/O thread's alone
  bool direct_ = true, direct_used_ = false;
  std::shared_ptr<OffloadKeptFiles> kept_;  // reuse_files: where files let go are kept

  std::mutex mutex_;
  std::condition_variable wake_, changed_;
  std::map<std::uint64_t, Record> records_;  // by sequence: the forward's order of saves
  std::deque<std::uint64_t> writes_, reads_;
  struct Removal {
    std::string path;
    std::size_t bytes;
  };
  std::deque<Removal> removals_;  // files of records let go, for the I/O thread to unlink
  std::uint64_t next_seq_ = 0;
  std::size_t arena_ = 0;
  bool busy_writing_ = false, busy_removing_ = false, stop_ = false;
  OffloadStats stats_;
  std::thread worker_;  // last: started when everything it reads exists
};

/// What a node keeps of an offloaded tensor: its record in the store, dropped with the node.
struct OffloadHandle {
  OffloadHandle(std::shared_ptr<OffloadCore> c, std::uint64_t s) : core(std::move(c)), seq(s) {}
  ~OffloadHandle() { core->drop(seq); }
  OffloadHandle(const OffloadHandle&) = delete;
  OffloadHandle& operator=(const OffloadHandle&) = delete;
  std::shared_ptr<OffloadCore> core;
  std::uint64_t seq;
};

/// Starts the reads of the last tensors saved when an outermost backward begins.
class OffloadReadAhead final : public Observer {
 public:
  explicit OffloadReadAhead(std::shared_ptr<OffloadCore> core) : core_(std::move(core)) {}
  void backward_begin(bool outermost) override {
    if (outermost) core_->backward_begins();
  }
  void backward_end(bool /*completed*/, bool outermost) override {
    if (outermost) core_->backward_ended();
  }

 private:
  std::shared_ptr<OffloadCore> core_;
};

}  // namespace detail

/// RAII: while it lives, large tensors saved for backward on this thread are offloaded to files
/// (the header's comment says which, and how they come back).
class Offload {
 public:
  /// Starts the store: makes options.directory if needed, removes the directories dead processes
  /// left there, makes this scope's own directory inside it, starts the I/O thread and installs the
  /// pack and unpack hooks on this thread. Throws remat::Error when a directory cannot be made.
  explicit Offload(OffloadOptions options)
      : core_(std::make_shared<detail::OffloadCore>(std::move(options))),
        born_(detail::next_storage_serial(false)),
        read_ahead_(core_),
        hooks_([core = core_, born = born_](const AnyTensor& t, const SaveContext& c) { return pack(core, born, t, c); },
               unpack, describe) {}
  Offload(const Offload&) = delete;
  Offload& operator=(const Offload&) = delete;

  /// What the store has done so far.
  OffloadStats stats() const { return core_->stats(); }
  /// The directory this scope's files are in (removed when its last tensor is gone).
  const std::string& directory() const { return core_->directory(); }
  /// Waits until every write queued so far has ended (written, or failed and kept in RAM).
  void flush() const { core_->flush(); }
  /// Removes the files scopes with OffloadOptions::reuse_files kept for reuse, in every directory
  /// (scopes alive then go on, writing new files); how many there were.
  static std::size_t remove_kept_files() { return detail::OffloadKeptFiles::remove_all(); }
  /// Tries again to remove the files and directories Offload scopes could not (a directory made
  /// unwritable or unreadable under them; stats().removal_failures counts them); those still there.
  /// Scopes also try whenever one starts or ends, and the process at exit (remat::remove_left_files()
  /// is the same for every store's files).
  static std::vector<std::string> remove_left_files() { return remat::remove_left_files(); }

 private:
  using Handle = detail::OffloadHandle;

  static std::any pack(const std::shared_ptr<detail::OffloadCore>& core, std::uint64_t born, const AnyTensor& t,
                       const SaveContext& context) {
    const detail::Storage& s = *t.ref().storage;
    const OffloadOptions& o = core->options();
    const bool offload = detail::session().backward_depth == 0 && !s.parameter() && s.serial() >= born &&
                         s.resident() && s.bytes() >= o.min_bytes &&
                         (!o.only || o.only(t, context));
    if (!offload) {
      core->declined();
      return {};
    }
    return std::make_shared<const Handle>(core, core->add(t, context));
  }

  static AnyTensor unpack(const std::any& packed) {
    const auto& h = std::any_cast<const std::shared_ptr<const Handle>&>(packed);
    return AnyTensor(h->core->take(h->seq));
  }

  static std::string describe(const std::any& packed) {
    const auto& h = std::any_cast<const std::shared_ptr<const Handle>&>(packed);
    return h->core->describe(h->seq);
  }

  std::shared_ptr<detail::OffloadCore> core_;
  std::uint64_t born_;  // storages with lower serials existed before the scope
  detail::OffloadReadAhead read_ahead_;
  SavedTensorHooks hooks_;
};

}  // namespace remat
