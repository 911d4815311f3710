#pragma once
// A timeline of a training step, in the Chrome trace-event format that Perfetto and
// chrome://tracing open: every op's forward and backward, each checkpoint replay and chain action
// as nested spans, and the library's live and saved-for-backward bytes as counter tracks.
//
//   { remat::Trace trace("step.json"); loss = model.loss(x, y); loss.backward(); }  // written here
//
// Off by default, and then free: each instrumented place costs one relaxed atomic load (a whole
// small train_gpt run under callgrind: +0.05% instructions). One trace records at a time; it is
// process-wide, so OpenMP workers' allocations count too — end it when no other thread of yours
// is running library code, since one may still be writing to it.

#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "remat/core/error.hpp"

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
  };

  void begin(std::string name, const char* category) { push({'B', std::move(name), category, now(), thread(), 0, 0}); }
  void end(const char* category) { push({'E', {}, category, now(), thread(), 0, 0}); }
  /// The library's books after a change (called by the allocator under its own lock).
  void memory(std::int64_t live, std::int64_t saved) { push({'C', "memory", "memory", now(), 0, live, saved}); }

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

/// RAII: records the timeline while it lives and writes it to `path` when it ends (or at stop()).
class Trace {
 public:
  /// Starts recording; the timeline goes to `path` (Chrome trace JSON) at the end.
  explicit Trace(std::string path) : path_(std::move(path)) {
    detail::Timeline* expected = nullptr;
    REMAT_CHECK(detail::active_timeline().compare_exchange_strong(expected, &timeline_),
                "Trace: another trace is recording; one at a time");
  }
  ~Trace() {
    try {
      stop();
    } catch (const std::exception&) {  // a destructor must not throw: stop() reports write errors to callers who call it
    }
  }
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  /// Stops recording and writes the file (once); a remat::Error if it cannot be written.
  void stop() {
    if (stopped_) return;
    stopped_ = true;
    detail::Timeline* self = &timeline_;
    detail::active_timeline().compare_exchange_strong(self, nullptr);
    nlohmann::json events = nlohmann::json::array();
    for (const detail::Timeline::Event& e : timeline_.take()) {
      nlohmann::json j = {{"ph", std::string(1, e.phase)}, {"cat", e.category}, {"ts", e.us}, {"pid", 1}, {"tid", e.thread}};
      if (e.phase == 'B') j["name"] = e.name;
      if (e.phase == 'C') {
        j["name"] = e.name;
        j["args"] = {{"live bytes", e.live}, {"saved bytes", e.saved}};
      }
      events.push_back(std::move(j));
    }
    errno = 0;
    std::ofstream out(path_);
    REMAT_CHECK(out.good(), "Trace: cannot write {}: {}", path_, std::strerror(errno));
    out << nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump() << "\n";
    out.flush();
    REMAT_CHECK(out.good(), "Trace: writing {} failed: {}", path_, std::strerror(errno));
  }

 private:
  std::string path_;
  detail::Timeline timeline_;
  bool stopped_ = false;
};

}  // namespace remat
