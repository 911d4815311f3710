#pragma once
// The gradient half of FullyShardedDataParallel (dist/fully_sharded.hpp): each parameter's
// gradient leaves its .grad as soon as it is final and is reduce-scattered on its own, so a unit's
// whole local gradient never waits for its last parameter: what is in flight is a parameter or a
// few (FullyShardedOptions::reductions_in_flight).
//
// Why the shards hold one process's bits: each rank sends every other rank that rank's piece of its
// local gradient (all-to-all, straight from where it lies) and adds the copies of its own piece
// itself, in rank order, then divides by N, as DataParallel does; MPI is never asked to add.
//
// Why a communicator of its own: reductions start in the order gradients become final, gathers in
// the order units run; the two orders interleave differently on each rank, and MPI matches
// collectives on one communicator by the order they were started.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "remat/core/tensor.hpp"
#include "remat/dist/context.hpp"

namespace remat::dist::detail {

/// Where one parameter lies across the ranks' shards: each rank's piece of it (count, and offset
/// within the parameter; 0 where a rank holds none), as MPI's all-gathers and all-to-alls take it.
struct Pieces {
  std::vector<int> counts, offsets;
};

/// Parameters' gradients on their way to this rank's shards, in the order sent, at most a fixed
/// number holding buffers at once. MPI moves a non-blocking collective on only inside its calls:
/// progress() is called at every op and backward op.
class ShardReductions {
 public:
  /// One parameter's gradient in flight: its local gradient (sent from where it lies) and the other
  /// ranks' copies of this rank's piece of it, in rank order.
  struct Reduction {
    std::size_t param = 0;
    Tensor local, rows;
    int count = 0, offset = 0;    ///< this rank's piece of the parameter
    float* into = nullptr;        ///< where the average of the piece goes in the shard
    bool overwrite = true;        ///< written there, or added (a further backward before the step)
    // MPI reads the counts until the reduction completes: they live as long as it.
    std::vector<int> send_counts, send_offsets, recv_counts, recv_offsets;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  /// Reductions over `ctx`'s ranks (on a duplicate of its communicator), `max_in_flight` at most.
  ShardReductions(const Context& ctx, std::size_t max_in_flight)
      : rank_(ctx.rank()), ranks_(ctx.world_size()), max_in_flight_(max_in_flight) {
    check_mpi(MPI_Comm_dup(ctx.comm(), &comm_), "MPI_Comm_dup");
  }
  /// Waits for what was sent (the other ranks are sending too), then frees the communicator.
  ~ShardReductions() {
    abandon();
    MPI_Comm_free(&comm_);
  }
  ShardReductions(const ShardReductions&) = delete;
  ShardReductions& operator=(const ShardReductions&) = delete;

  /// Before a reduction's buffers are made: waits until one more fits.
  void make_room() { progress(max_in_flight_ - 1); }

  /// Sends parameter `param`'s local gradient `local`, laid across the ranks as `pieces`: to each
  /// other rank its piece; the average of this rank's piece goes to `into` (null when this rank
  /// holds none of it) once every copy has arrived (written when `overwrite`, else added). Call
  /// poll() after: what has arrived is finished there.
  void send(std::size_t param, Tensor local, const Pieces& pieces, float* into, bool overwrite) {
    Reduction r;
    r.param = param;
    r.local = std::move(local);
    const auto me = static_cast<std::size_t>(rank_);
    r.count = pieces.counts[me];
    r.offset = pieces.offsets[me];
    r.into = into;
    r.overwrite = overwrite;
    const auto size = static_cast<std::size_t>(ranks_);
    r.send_counts.assign(size, 0);
    r.send_offsets.assign(size, 0);
    r.recv_counts.assign(size, 0);
    r.recv_offsets.assign(size, 0);
    for (int q = 0; q < ranks_; ++q) {
      if (q == rank_) continue;
      const auto k = static_cast<std::size_t>(q);
      r.send_counts[k] = pieces.counts[k];
      r.send_offsets[k] = pieces.offsets[k];
      r.recv_counts[k] = r.count;
      r.recv_offsets[k] = other_slot(q) * r.count;
    }
    if (r.count > 0 && ranks_ > 1) r.rows = Tensor(Shape{static_cast<std::int64_t>(r.count) * (ranks_ - 1)});
    static float nothing = 0;  // a receive buffer for no elements
    check_mpi(MPI_Ialltoallv(r.local.data(), r.send_counts.data(), r.send_offsets.data(), MPI_FLOAT,
                             r.rows.defined() ? r.rows.data() : &nothing, r.recv_counts.data(), r.recv_offsets.data(),
                             MPI_FLOAT, comm_, &r.request),
              "MPI_Ialltoallv");
    pending_.push_back(std::move(r));
    last_sent_.push_back(param);
    if (last_sent_.size() > max_in_flight_) last_sent_.pop_front();
  }

  /// Finishes what has arrived, without waiting.
  void poll() { progress(max_in_flight_); }

  /// Finishes what has arrived, in the order sent, waiting until at most `in_flight` remain.
  void progress(std::size_t in_flight) {
    while (!pending_.empty()) {
      Reduction& r = pending_.front();
      int done = 0;
      if (pending_.size() > in_flight) {
        check_mpi(MPI_Wait(&r.request, MPI_STATUS_IGNORE), "MPI_Wait");
        done = 1;
      } else {
        check_mpi(MPI_Test(&r.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      }
      if (!done) break;
      average_into_shard(r);
      pending_.pop_front();
    }
  }

  /// Waits for every reduction sent and drops them unaveraged: the communicator stays consistent
  /// (the other ranks complete theirs) and nothing more is added to the shards.
  void abandon() {
    for (Reduction& r : pending_) MPI_Wait(&r.request, MPI_STATUS_IGNORE);
    pending_.clear();
  }

  /// The reductions in flight, in the order sent.
  const std::deque<Reduction>& pending() const { return pending_; }
  /// The parameters of the last reductions sent, as many as may be in flight, whether or not they
  /// have completed: a quantity the same on every rank.
  const std::deque<std::size_t>& last_sent() const { return last_sent_; }
  /// The step ended, every reduction completed: none counts as possibly in flight.
  void forget_sent() { last_sent_.clear(); }

 private:
  // Where rank q's copy of this rank's piece lands among the other ranks' copies.
  int other_slot(int q) const { return q < rank_ ? q : q - 1; }

  // Every rank's copy of this rank's piece, added in rank order and divided by N: the bits one
  // process gets adding the ranks' micro-batch gradients in that order.
  void average_into_shard(const Reduction& r) {
    const std::int64_t count = r.count;
    if (count <= 0) return;
    using ConstVec = Eigen::Map<const Eigen::ArrayXf>;
    auto copy_of = [&](int q, std::int64_t at, std::int64_t k) {
      return ConstVec((q == rank_ ? r.local.data() + r.offset : r.rows.data() + other_slot(q) * count) + at, k);
    };
    // A block at a time through a buffer on the stack: no allocation the size of the piece.
    constexpr std::int64_t kBlock = 256;
    alignas(64) float buffer[kBlock];
    for (std::int64_t at = 0; at < count; at += kBlock) {
      const std::int64_t k = std::min(kBlock, count - at);
      Eigen::Map<Eigen::ArrayXf> sum(buffer, k), out(r.into + at, k);
      sum = copy_of(0, at, k);
      for (int q = 1; q < ranks_; ++q) sum += copy_of(q, at, k);
      sum /= static_cast<float>(ranks_);
      if (r.overwrite) out = sum;
      else out += sum;
    }
  }

  int rank_, ranks_;
  std::size_t max_in_flight_;
  std::deque<Reduction> pending_;
  std::deque<std::size_t> last_sent_;
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace remat::dist::detail
