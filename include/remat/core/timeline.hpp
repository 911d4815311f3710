#pragma once
// The recording behind remat::Trace: while a trace is active, every op's forward and backward,
// each checkpoint replay and chain action as nested spans, and the library's live and
// saved-for-backward bytes as counters. The writer, remat::Trace, is in
// remat/core/timeline_json.hpp: this header is on every tensor's include path (through memory.hpp),
// so it carries no JSON library.
//
// Off by default, and then free: each instrumented place costs one relaxed atomic load (a whole
// small train_gpt run under callgrind: +0.05% instructions).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace remat {
namespace detail {

/// The recording a Trace makes while it lives.
class Timeline {
 public:
  struct Event {
    char phase;        // 'B' begin, 'E' end, 'C' counter
    std::string name;  // span name (empty for 'E')
    const char* category;
    double us;         // since the trace started
    int thread;
    std::int64_t live = 0, saved = 0;  // counters
    const char* first = "live bytes";   // the counters' names
    const char* second = "saved bytes";
  };

  void begin(std::string name, const char* category) { push({'B', std::move(name), category, now(), thread(), 0, 0}); }
  void end(const char* category) { push({'E', {}, category, now(), thread(), 0, 0}); }
  /// The library's books after a change (called by the allocator under its own lock).
  void memory(std::int64_t live, std::int64_t saved) { push({'C', "memory", "memory", now(), 0, live, saved}); }
  /// Two counters of another kind (an offload store's RAM and disk bytes), as one track `name`.
  void counters(std::string name, const char* first, std::int64_t a, const char* second, std::int64_t b) {
    push({'C', std::move(name), "memory", now(), 0, a, b, first, second});
  }

  std::vector<Event> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(events_);
  }

 private:
  double now() const { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_).count(); }
  int thread() {
    std::lock_guard<std::mutex> lock(mutex_);
    return threads_.try_emplace(std::this_thread::get_id(), static_cast<int>(threads_.size()) + 1).first->second;
  }
  void push(Event e) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(e));
  }

  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::mutex mutex_;
  std::vector<Event> events_;
  std::map<std::thread::id, int> threads_;
};

inline std::atomic<Timeline*>& active_timeline() {
  static std::atomic<Timeline*> timeline{nullptr};
  return timeline;
}

/// RAII: a span on the active timeline, if any (nothing otherwise).
class TimelineSpan {
 public:
  TimelineSpan(const char* name, const char* category) : category_(category) {
    if ((timeline_ = active_timeline().load(std::memory_order_relaxed))) timeline_->begin(name, category);
  }
  /// A span whose name is made only when a trace records.
  template <class MakeName, class = decltype(std::string(std::declval<MakeName>()()))>
  TimelineSpan(const char* category, MakeName make_name) : category_(category) {
    if ((timeline_ = active_timeline().load(std::memory_order_relaxed))) timeline_->begin(make_name(), category);
  }
  ~TimelineSpan() {
    if (timeline_) timeline_->end(category_);
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  const char* category_;
  Timeline* timeline_ = nullptr;
};

}  // namespace detail
}  // namespace remat
