#pragma once
// What a chain's schedule holds for backward, predicted storage by storage as the executor
// (chain.hpp) holds it and memory_stats() counts it: plan()'s byte figures and the budget
// planner's charges.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "remat/schedule/action_stream.hpp"
#include "remat/core/error.hpp"

namespace remat::detail {

/// Step i's recorded bytes split by who else may hold them: its input x_i (when it reads it), its
/// output x_{i+1} (when it saves it and a step follows; the last step's output is its own), and
/// the rest, parameters and what only its reversal saves left out.
struct RecordedBytes {
  std::size_t input = 0, output = 0, own = 0;
};
inline RecordedBytes recorded_bytes(const std::vector<StepCost>& costs, std::int64_t i) {
  const StepCost& c = costs[static_cast<std::size_t>(i)];
  RecordedBytes b;
  b.input = c.reads_input ? c.state_bytes : 0;
  b.output = c.saves_output && static_cast<std::size_t>(i) + 1 < costs.size() ? costs[static_cast<std::size_t>(i) + 1].state_bytes : 0;
  const std::size_t shared = b.input + b.output + c.param_bytes + c.reverse_bytes;
  b.own = c.activation_bytes > shared ? c.activation_bytes - shared : 0;
  return b;
}

/// The bytes the executor (chain.hpp) holds for backward as a schedule runs, counted as
/// memory_stats() counts them: per storage, once however many hold it. A snapshot of x_i and the
/// recorded step that reads x_i hold one storage; so do a step that saves its output and the next
/// one reading it, and steps sharing parameters. A step recorded in forward with `compact` is
/// held without its parameters, which it saves again for the moment it is rebuilt and reversed.
class SavedBytesModel {
 public:
  explicit SavedBytesModel(const std::vector<StepCost>& costs) : costs_(costs) {}
  std::size_t bytes() const { return bytes_; }
  std::size_t peak() const { return peak_; }

  void advance() { current_ = next_id_++; }
  void snapshot(std::int64_t i, bool disk) {
    kept_.emplace_back(i, current_);
    const auto k = static_cast<std::size_t>(i);
    if (!disk) hold(current_, k < costs_.size() ? costs_[k].state_bytes : 0);
    else kept_.back().second |= kDisk;
  }
  void restore(std::int64_t i) {
    const std::uint64_t id = find(kept_, i)->second;
    current_ = id & kDisk ? next_id_++ : id;  // a file is read back into a new tensor
  }
  void free(std::int64_t i) {
    auto it = find(kept_, i);
    if (!(it->second & kDisk)) release(it->second);
    kept_.erase(it);
  }
  void record(std::int64_t i, bool forward) {
    const StepCost& c = costs_[static_cast<std::size_t>(i)];
    const RecordedBytes b = recorded_bytes(costs_, i);
    Held h{i, b.input ? current_ : 0, 0, b.own ? next_id_++ : 0, 0, forward && c.compact};
    current_ = next_id_++;
    if (b.output) h.output = current_;
    if (c.param_bytes) h.params = c.params ? kShared | c.params : next_id_++;
    hold(h.input, b.input);
    hold(h.output, b.output);
    hold(h.own, b.own);
    hold(h.params, c.param_bytes);  // a compact step's graph exists until it is held compactly
    if (h.compact) release(h.params);
    recorded_.push_back(h);
  }
  void reverse(std::int64_t i) {
    const StepCost& c = costs_[static_cast<std::size_t>(i)];
    auto it = find(recorded_, i);
    if (it->compact) hold(it->params, c.param_bytes);  // rebuilt: its nodes save the parameters again
    peak_ = std::max(peak_, bytes_ + c.reverse_bytes);
    for (std::uint64_t id : {it->input, it->output, it->own, it->params}) release(id);
    recorded_.erase(it);
  }

 private:
  static constexpr std::uint64_t kShared = std::uint64_t{1} << 63, kDisk = std::uint64_t{1} << 62;
  struct Held {
    std::int64_t step;
    std::uint64_t input, output, own, params;  // storage ids, 0 for none
    bool compact;
  };
  void hold(std::uint64_t id, std::size_t bytes) {
    if (id == 0) return;
    auto& [b, refs] = books_[id];
    if (refs++ == 0) {
      b = bytes;
      bytes_ += bytes;
      peak_ = std::max(peak_, bytes_);
    }
  }
  void release(std::uint64_t id) {
    if (id == 0) return;
    auto it = books_.find(id);
    if (--it->second.second == 0) {
      bytes_ -= it->second.first;
      books_.erase(it);
    }
  }
  // Newest first: schedules restore, free and reverse what they made last.
  template <class V>
  static typename V::iterator find(V& v, std::int64_t i) {
    auto it = v.end();
    while (it != v.begin())
      if (step_of(*--it) == i) return it;
    REMAT_ASSERT(false);
    return v.end();
  }
  static std::int64_t step_of(const std::pair<std::int64_t, std::uint64_t>& k) { return k.first; }
  static std::int64_t step_of(const Held& h) { return h.step; }

  const std::vector<StepCost>& costs_;
  std::unordered_map<std::uint64_t, std::pair<std::size_t, int>> books_;  // id -> bytes, holders
  std::vector<std::pair<std::int64_t, std::uint64_t>> kept_;
  std::vector<Held> recorded_;
  std::uint64_t current_ = 1, next_id_ = 2;
  std::size_t bytes_ = 0, peak_ = 0;
};

}  // namespace remat::detail
