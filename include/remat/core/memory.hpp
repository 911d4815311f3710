#pragma once
// Memory accounting: every tensor byte goes through one counting allocator, so live, peak and
// saved-for-backward bytes are exact and tests can assert them to the byte.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/session.hpp"
#include "remat/core/timeline.hpp"

namespace remat {

/// The counting allocator's figures for tensor storage, in bytes unless said otherwise.
struct MemoryStats {
  std::size_t live_bytes = 0;        ///< tensor bytes allocated now
  std::size_t peak_bytes = 0;        ///< the most live_bytes has been since the last reset
  std::size_t saved_bytes = 0;       ///< of live_bytes, those held by tapes for backward
  std::size_t peak_saved_bytes = 0;  ///< the most saved_bytes has been since the last reset
  std::size_t allocations = 0;       ///< tensor storages allocated since start (a count)
  /// Of saved_bytes, those of parameters (and the autocast scope's copies of them): alive whatever
  /// the graph does, so no checkpointing policy or budget can change them.
  std::size_t saved_parameter_bytes = 0;
  /// Of saved_bytes, the rest (saved_bytes - saved_parameter_bytes): the activations a step keeps
  /// for backward, what checkpointing trades for recomputation and what a MemoryBudget caps.
  std::size_t saved_activation_bytes = 0;
  /// The most saved_activation_bytes has been since the last reset.
  std::size_t peak_saved_activation_bytes = 0;
};

namespace detail {

/// Alignment of every storage of kSmallStorage bytes or more: a cache line, which covers Eigen's
/// vectorised loads. Smaller ones take the build's vector width (operator new's own 16 bytes with
/// SSE): a tensor of a few dozen floats gains nothing from a cache line, and the allocator's
/// padding for one would cost it up to half its size again (a long chain of small states holds one
/// per step). Not less than the vector width, though: Eigen computes a row's head up to its first
/// aligned packet on the scalar path, whose exp and sqrt are other functions than the vectorised
/// ones, so a row's bits would depend on where malloc put the tensor (a replay's copy, say).
inline constexpr std::size_t kStorageAlignment = 64;
inline constexpr std::size_t kSmallStorage = 256;
#if defined(__AVX512F__)
inline constexpr std::size_t kSmallAlignment = 64;
#elif defined(__AVX__)
inline constexpr std::size_t kSmallAlignment = 32;
#else
inline constexpr std::size_t kSmallAlignment = 16;
#endif

struct ScopePeaks {
  std::size_t peak_bytes = 0;
  std::size_t peak_saved_bytes = 0;
  std::size_t peak_saved_activation_bytes = 0;
};

// GCC defines __SANITIZE_ADDRESS__ under -fsanitize=address; clang answers __has_feature.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REMAT_HAS_ASAN 1
#endif
#endif
#ifndef REMAT_HAS_ASAN
#define REMAT_HAS_ASAN 0
#endif

#if defined(__SANITIZE_ADDRESS__) || REMAT_HAS_ASAN
inline constexpr bool kRoundBlocks = false;     // exact sizes: a read past a tensor's end is caught
inline constexpr bool kCacheByDefault = false;  // let AddressSanitizer see every free
#else
inline constexpr bool kRoundBlocks = true;  // whole cache lines, so cached blocks fit more requests
inline constexpr bool kCacheByDefault = true;
#endif

/// The allocator and its books. Freed blocks are cached by size and handed out again (a training
/// step allocates the same shapes every time; fresh large blocks would cost page faults on every
/// step). Cached blocks are not tensor bytes: live and peak figures count tensors only.
class MemoryLedger {
 public:
  static MemoryLedger& instance() {
    static MemoryLedger ledger;
    return ledger;
  }
  ~MemoryLedger() { release_cache(); }

  void* allocate(std::size_t bytes) {
    const std::size_t block = block_size(bytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.live_bytes += bytes;
      ++stats_.allocations;
      stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
      for (ScopePeaks* s : scopes_) s->peak_bytes = std::max(s->peak_bytes, stats_.live_bytes);
      to_timeline();
      auto it = cache_.find(block);
      if (it != cache_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= block;
      }
    }
    if (p) return p;
    if (block >= kSmallStorage) return ::operator new(block, std::align_val_t{kStorageAlignment});
    if constexpr (kSmallAlignment > __STDCPP_DEFAULT_NEW_ALIGNMENT__)
      return ::operator new(block, std::align_val_t{kSmallAlignment});
    return ::operator new(block);
  }
  void deallocate(void* p, std::size_t bytes) {
    const std::size_t block = block_size(bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.live_bytes -= bytes;
      to_timeline();
      if (caching_) {
        cache_[block].push_back(p);
        cached_bytes_ += block;
        return;
      }
    }
    free_block(p, block);
  }
  /// Returns every cached block to the system (torch.cuda.empty_cache's counterpart).
  void release_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [block, blocks] : cache_)
      for (void* p : blocks) free_block(p, block);
    cache_.clear();
    cached_bytes_ = 0;
  }
  void set_caching(bool on) {
    { std::lock_guard<std::mutex> lock(mutex_); caching_ = on; }
    if (!on) release_cache();
  }
  std::size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_bytes_;
  }
  /// `bytes` join the saved-for-backward books, a parameter's or an activation's.
  void add_saved(std::size_t bytes, bool parameter) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.saved_bytes += bytes;
    (parameter ? stats_.saved_parameter_bytes : stats_.saved_activation_bytes) += bytes;
    stats_.peak_saved_bytes = std::max(stats_.peak_saved_bytes, stats_.saved_bytes);
    stats_.peak_saved_activation_bytes = std::max(stats_.peak_saved_activation_bytes, stats_.saved_activation_bytes);
    for (ScopePeaks* s : scopes_) {
      s->peak_saved_bytes = std::max(s->peak_saved_bytes, stats_.saved_bytes);
      s->peak_saved_activation_bytes = std::max(s->peak_saved_activation_bytes, stats_.saved_activation_bytes);
    }
    to_timeline();
  }
  void remove_saved(std::size_t bytes, bool parameter) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.saved_bytes -= bytes;
    (parameter ? stats_.saved_parameter_bytes : stats_.saved_activation_bytes) -= bytes;
    to_timeline();
  }
  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  void reset_peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes = stats_.live_bytes;
    stats_.peak_saved_bytes = stats_.saved_bytes;
    stats_.peak_saved_activation_bytes = stats_.saved_activation_bytes;
  }
  void open(ScopePeaks* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    s->peak_bytes = stats_.live_bytes;
    s->peak_saved_bytes = stats_.saved_bytes;
    s->peak_saved_activation_bytes = stats_.saved_activation_bytes;
    scopes_.push_back(s);
  }
  void close(ScopePeaks* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    scopes_.erase(std::remove(scopes_.begin(), scopes_.end(), s), scopes_.end());
  }

 private:
  /// The books after a change, to the trace that records (if one does). Under mutex_.
  void to_timeline() const {
    if (Timeline* t = active_timeline().load(std::memory_order_relaxed))
      t->memory(static_cast<std::int64_t>(stats_.live_bytes), static_cast<std::int64_t>(stats_.saved_bytes));
  }

  static std::size_t block_size(std::size_t bytes) {
    if (!kRoundBlocks) return std::max<std::size_t>(1, bytes);
    const std::size_t unit = bytes < kSmallStorage ? kSmallAlignment : kStorageAlignment;
    return std::max<std::size_t>(unit, (bytes + unit - 1) / unit * unit);
  }
  static void free_block(void* p, std::size_t block) {
    if (block >= kSmallStorage) ::operator delete(p, std::align_val_t{kStorageAlignment});
    else if constexpr (kSmallAlignment > __STDCPP_DEFAULT_NEW_ALIGNMENT__)
      ::operator delete(p, std::align_val_t{kSmallAlignment});
    else ::operator delete(p);
  }

  std::mutex mutex_;
  MemoryStats stats_;
  std::vector<ScopePeaks*> scopes_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;
  std::size_t cached_bytes_ = 0;
  bool caching_ = kCacheByDefault;
};

}  // namespace detail

/// The counting allocator's figures now: live, peak and saved bytes, and the allocation count.
inline MemoryStats memory_stats() { return detail::MemoryLedger::instance().stats(); }

/// Sets peak_bytes, peak_saved_bytes and peak_saved_activation_bytes to the current figures.
inline void reset_peak_memory_stats() { detail::MemoryLedger::instance().reset_peaks(); }

/// Bytes of freed tensor storage kept for reuse (not counted in live_bytes).
inline std::size_t cached_memory_bytes() { return detail::MemoryLedger::instance().cached_bytes(); }
/// Returns the cached blocks to the system.
inline void empty_cache() { detail::MemoryLedger::instance().release_cache(); }
/// Turns block caching on or off (off under AddressSanitizer by default, so it sees every free).
inline void set_allocator_caching(bool on) { detail::MemoryLedger::instance().set_caching(on); }

/// Measures the peaks between its construction and now; scopes nest and do not disturb the global
/// peaks. Typical use: `MemoryScope scope; step(); scope.peak_bytes() - scope.start_bytes()`.
class MemoryScope {
 public:
  MemoryScope() : start_(memory_stats()) { detail::MemoryLedger::instance().open(&peaks_); }
  ~MemoryScope() { detail::MemoryLedger::instance().close(&peaks_); }
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

  /// live_bytes when the scope was constructed.
  std::size_t start_bytes() const { return start_.live_bytes; }
  /// saved_bytes when the scope was constructed.
  std::size_t start_saved_bytes() const { return start_.saved_bytes; }
  /// The most live_bytes has been since the scope was constructed.
  std::size_t peak_bytes() const { return peaks_.peak_bytes; }
  /// The most saved_bytes has been since the scope was constructed.
  std::size_t peak_saved_bytes() const { return peaks_.peak_saved_bytes; }
  /// saved_activation_bytes when the scope was constructed.
  std::size_t start_saved_activation_bytes() const { return start_.saved_activation_bytes; }
  /// The most saved_activation_bytes has been since the scope was constructed (parameters apart).
  std::size_t peak_saved_activation_bytes() const { return peaks_.peak_saved_activation_bytes; }
  /// Peak above the level at construction: what the measured code needed on top.
  std::size_t peak_bytes_above_start() const { return peaks_.peak_bytes - start_.live_bytes; }

 private:
  MemoryStats start_;
  detail::ScopePeaks peaks_;
};

namespace detail {

/// Serial numbers of storages, in order of creation: a storage with a serial below a mark taken
/// when a scope began was made before it (a checkpoint tells its parameters and inputs from what
/// its segment computed this way).
inline std::uint64_t next_storage_serial(bool take) {
  static std::atomic<std::uint64_t> next{1};
  return take ? next.fetch_add(1, std::memory_order_relaxed) : next.load(std::memory_order_relaxed);
}

class Storage;

/// The saved-for-backward activation bytes of the graphs one thread builds (parameters apart):
/// what that thread's MemoryBudget caps, so that two threads under two budgets do not steer each
/// other's decisions. A storage
/// remembers the books it joined (a backward may run, and free it, on another thread), and the
/// books outlive their thread while a storage still counts in them.
class ThreadSavedBooks {
 public:
  std::size_t saved_bytes() const { return saved_.load(std::memory_order_relaxed); }
  /// The most saved_bytes() has been since reset_peak().
  std::size_t peak_saved_bytes() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(saved_bytes(), std::memory_order_relaxed); }

  void add(std::size_t bytes) {
    const std::size_t now = saved_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void remove(std::size_t bytes) { saved_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> saved_{0};
  std::atomic<std::size_t> peak_{0};
};

/// This thread's books of saved bytes.
inline const std::shared_ptr<ThreadSavedBooks>& thread_saved_books() {
  std::shared_ptr<ThreadSavedBooks>& books = session().saved_books;
  if (!books) books = std::make_shared<ThreadSavedBooks>();
  return books;
}

/// The bytes behind one or more tensors (reshape shares it). `version` counts in-place writes so a
/// tensor saved for backward and modified afterwards is an error, not a wrong gradient; `saved_refs`
/// counts how many saved-for-backward records hold it, so shared storage is counted as saved once.
/// A parameter's storage (marked by the module that owns it) counts in the books apart from the
/// activations. A storage is bytes and nothing more: it never calls up. A saved-tensor store that
/// keeps tensors in RAM (a memory budget) may free a storage's bytes while only saved records hold
/// it (discard) and put recomputed ones back (adopt); whoever reads it meanwhile goes through the
/// store's unpack, which brings the bytes back first.
class Storage {
 public:
  explicit Storage(std::size_t bytes)
      : data_(MemoryLedger::instance().allocate(bytes)), bytes_(bytes), serial_(next_storage_serial(true)) {}
  ~Storage() {
    if (!data_) return;  // discarded, or its buffer was handed to another storage
    if (saved_refs_ > 0) leave_saved_books();
    MemoryLedger::instance().deallocate(data_, bytes_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const {
    if (!data_ && away_) throw Error(*away_);
    REMAT_CHECK(data_ != nullptr, "tensor access: the bytes of this tensor ({} B) were discarded under a memory "
                "budget and are read other than through the node that saved it (or after the budget could no "
                "longer recompute them)", bytes_);
    return data_;
  }
  std::size_t bytes() const { return bytes_; }
  std::uint64_t version() const { return version_; }
  void bump_version() { ++version_; }
  /// Whether its float32 values are bfloat16 values now (a product under autocast rounded them, as
  /// PyTorch's are bfloat16): a node saving it keeps it in 16 bits at no loss. An in-place write
  /// since the mark clears it.
  bool bfloat16_exact() const { return exact_mark_ == version_ + 1; }
  /// Marks its values bfloat16 values as of its current version.
  void mark_bfloat16_exact() { exact_mark_ = version_ + 1; }
  std::uint64_t serial() const { return serial_; }

  void retain_saved() {
    if (saved_refs_ == 0 && data_) join_saved_books();
    ++saved_refs_;
  }
  void release_saved() {
    if (--saved_refs_ > 0) return;
    if (data_) leave_saved_books();
  }
  int saved_refs() const { return saved_refs_; }

  /// Whether it is a parameter's (or a copy alive as long as one): in the books apart.
  bool parameter() const { return parameter_; }
  /// Marks it a parameter's; a storage counted as saved moves to the parameters' side of the books.
  void mark_parameter() {
    if (parameter_) return;
    const bool counted = saved_refs_ > 0 && data_;
    if (counted) leave_saved_books();
    parameter_ = true;
    if (counted) join_saved_books();
  }

  // --- for a store that discards and recomputes (a memory budget) ---------------------------------
  /// Whether the bytes are here (not discarded).
  bool resident() const { return data_ != nullptr; }
  /// The bytes, or null when discarded.
  void* raw_data() const { return data_; }
  /// Frees the bytes; the handle, shape and version stay. Saved books drop them while away.
  /// `why`, when given, is the error a read meets meanwhile (a sharded parameter names its unit).
  void discard(std::shared_ptr<const std::string> why = nullptr) {
    away_ = std::move(why);
    if (!data_) return;
    if (saved_refs_ > 0) leave_saved_books();
    MemoryLedger::instance().deallocate(data_, bytes_);
    data_ = nullptr;
  }
  /// Takes `fresh`'s bytes (a recomputation of this storage's contents) as its own.
  void adopt(Storage& fresh) {
    REMAT_ASSERT(!data_ && fresh.data_ && fresh.bytes_ == bytes_);
    data_ = fresh.data_;
    fresh.data_ = nullptr;  // live bytes move with the buffer: fresh's allocation is now ours
    away_.reset();
    if (saved_refs_ > 0) join_saved_books();
  }

 private:
  // The process's books and the saving thread's.
  void join_saved_books() {
    MemoryLedger::instance().add_saved(bytes_, parameter_);
    if (parameter_) return;
    books_ = thread_saved_books();
    books_->add(bytes_);
  }
  void leave_saved_books() {
    MemoryLedger::instance().remove_saved(bytes_, parameter_);
    if (!books_) return;
    books_->remove(bytes_);
    books_.reset();
  }

  void* data_;
  std::size_t bytes_;
  std::uint64_t serial_;
  std::uint64_t version_ = 0;
  std::uint64_t exact_mark_ = 0;  // version + 1 when its values were marked bfloat16 values; 0: never
  int saved_refs_ = 0;
  bool parameter_ = false;
  std::shared_ptr<ThreadSavedBooks> books_;  // while saved: the books these bytes count in
  std::shared_ptr<const std::string> away_;  // while discarded: what a read is told, when set
};

}  // namespace detail
}  // namespace remat
