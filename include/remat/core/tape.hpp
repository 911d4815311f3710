#pragma once
// The tape: a Wengert list of nodes, one per recorded op, walked in reverse by backward(). It has
// positions (mark, backward between two positions, reset to a position), which is what replays
// and chain schedules build on; nested tapes are ordinary tapes made current for a scope.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "remat/core/error.hpp"
#include "remat/core/node.hpp"

namespace remat {

/// A tape position: the number of nodes before it.
using TapePosition = std::size_t;

/// A Wengert list. The thread's root tape records by default; checkpoint replays push a nested
/// tape, record into it and walk it backward. Positions support mark / backward-between / reset.
class Tape {
 public:
  Tape() = default;
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
  ~Tape() { reset(0); }

  /// The current position: the number of nodes recorded so far.
  TapePosition position() const { return nodes_.size(); }
  /// The number of nodes.
  std::size_t size() const { return nodes_.size(); }
  /// The nodes in recording order.
  const std::vector<std::unique_ptr<detail::Node>>& nodes() const { return nodes_; }

  /// Records a node at the end.
  void push(std::unique_ptr<detail::Node> node) {
    // A backward that records its own ops (create_graph) pushes while it walks: pruning then
    // could drop a node that has run, and with it the only edge keeping alive the node now running.
    if (walking_ == 0) prune();
    nodes_.push_back(std::move(node));
  }

  /// Runs, newest first, every node in [to, from) whose outputs have gradients.
  void backward(TapePosition from, TapePosition to = 0, bool retain_graph = false) {
    REMAT_CHECK(to <= from && from <= nodes_.size(),
                "Tape::backward: positions [{}, {}) are not within the tape of {} nodes", to, from,
                nodes_.size());
    ++walking_;
    struct Walked {
      int& depth;
      ~Walked() { --depth; }
    } walked{walking_};
    for (TapePosition i = from; i-- > to;) {
      detail::Node& node = *nodes_[i];
      if (node.released()) continue;
      if (node.has_output_grad()) {
        node.run(retain_graph);
      } else if (!node.outputs_alive()) {
        node.release();  // unreachable: free what it saved now rather than at the next prune
      }
    }
    if (walking_ == 1) prune();
  }

  /// Drops every node at or after `to`, freeing what they saved.
  void reset(TapePosition to = 0) {
    while (nodes_.size() > to) nodes_.pop_back();
  }

  /// Finds the node with this id (ids increase along a tape); -1 when it is not here.
  std::ptrdiff_t find(std::uint64_t id) const {
    auto it = std::lower_bound(nodes_.begin(), nodes_.end(), id,
                               [](const auto& n, std::uint64_t v) { return n->id() < v; });
    if (it == nodes_.end() || (*it)->id() != id) return -1;
    return it - nodes_.begin();
  }

 private:
  // Nodes at the tail whose outputs are gone can never run: drop them, which in turn may make
  // their inputs' producers unreachable. This is what frees a graph that is never backpropagated.
  void prune() {
    while (!nodes_.empty() && (nodes_.back()->released() || !nodes_.back()->outputs_alive()))
      nodes_.pop_back();
  }

  std::vector<std::unique_ptr<detail::Node>> nodes_;
  int walking_ = 0;  // backward walks under way on this tape (one inside another: a node's own walk)
};

}  // namespace remat
