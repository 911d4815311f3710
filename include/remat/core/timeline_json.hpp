#pragma once
// remat::Trace, the timeline of a training step written as Chrome trace-event JSON, which Perfetto
// and chrome://tracing open (the recording itself is remat/core/timeline.hpp):
//
//   { remat::Trace trace("step.json"); loss = model.loss(x, y); loss.backward(); }  // written here
//
// One trace records at a time; it is process-wide, so OpenMP workers' allocations count too — end
// it when no other thread of yours is running library code, since one may still be writing to it.
//
// Its own header because it needs nlohmann/json, which core headers must not pull into every
// translation unit that uses a tensor; remat/remat.hpp includes it.

#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "remat/core/error.hpp"
#include "remat/core/timeline.hpp"

namespace remat {

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
        j["args"] = {{e.first, e.live}, {e.second, e.saved}};
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
