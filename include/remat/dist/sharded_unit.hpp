#pragma once
// What FullyShardedDataParallel (dist/fully_sharded.hpp) shards and reports: a unit (parameters
// gathered together and sharded together, laid end to end in one flat range, with its state
// within a step) and a rank's bytes by kind at one moment. Public: units() and peak_memory()
// return them.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "remat/core/memory.hpp"
#include "remat/core/tensor.hpp"
#include "remat/dist/context.hpp"

namespace remat::dist {

/// A rank's bytes by kind at one moment: when its live bytes peaked, or its model state
/// (FullyShardedDataParallel samples them at every op and backward op, and as each gradient
/// arrives, each reduction starts and each block is gathered).
struct ShardedMemory {
  std::size_t live = 0;         ///< all the allocator's live bytes then
  std::size_t parameters = 0;   ///< the blocks' parameter shards, and the root unit whole
  std::size_t gradients = 0;    ///< the gradients' shards, reductions in flight, local .grad not yet final
  std::size_t root_gradients = 0;  ///< of which the root's local .grad and reductions (beyond its shard)
  std::size_t gathered = 0;     ///< blocks' parameters gathered, and prefetches in flight
  std::size_t optimizer = 0;    ///< the FullyShardedAdamW's moments (none before its first step)
  std::size_t activations = 0;  ///< saved for backward (memory_stats().saved_activation_bytes)
  /// The model state: parameters, gradients, optimizer state and gathered blocks.
  std::size_t model_state() const { return parameters + gradients + optimizer + gathered; }
};

/// A unit: parameters gathered together and sharded together, laid end to end in one flat range.
struct ShardedUnit {
  /// One parameter's place in the flat range (`param` indexes FullyShardedDataParallel::parameters()).
  using Entry = FlatEntry;
  std::string name;              ///< "block 3", or "root"
  std::vector<Entry> entries;    ///< its parameters, in the model's order
  std::int64_t numel = 0;        ///< all its elements
  ShardLayout shards{0, 1};      ///< how they split over the ranks
  bool root = false;             ///< the root unit: parameters always whole
  /// This rank's shard of the parameters (the values the optimizer updates); none for the root, whose
  /// whole parameters hold its shard in place.
  Tensor params;
  Tensor grads;                  ///< this rank's shard of the averaged gradients
  std::int64_t gathers = 0;      ///< all-gathers of its parameters so far (prefetched or not)
  std::int64_t prefetched = 0;   ///< of which started ahead, while another unit ran
  std::int64_t reductions = 0;   ///< reduce-scatters of its parameters' gradients so far (one a parameter a step)

  // State within a step.
  bool gathered = false;      ///< its parameters' bytes are here (but those freed one by one)
  bool partly = false;        ///< some parameters were freed one by one, their gradients final
  bool stale = false;         ///< the shard changed since the last gather: the next one bumps versions
  bool grads_fresh = true;    ///< this backward's reductions write the gradient shard (else add to it)
  int waiting = 0;            ///< parameters whose gradients are not final yet
  /// Every gradient is final, but a node yet to run (or running) saved one of its parameters: it is
  /// released once no saved record holds any of them.
  bool release_waiting = false;
  /// Its backward runs in a walk that retains the graph: nodes that ran keep what they saved (for a
  /// later walk, which gathers it again first), so the release waits only for the node running.
  bool retained = false;
  /// Gathered by a forward inside backward (a replay that records), its own backward not begun:
  /// the order it was kept in (0: not kept). It may be let go meanwhile, since a node on its output
  /// gathers it again before any of its own.
  std::uint64_t kept = 0;
  /// A prefetch in flight: each parameter's bytes arriving in the storage it will take over.
  std::vector<std::unique_ptr<remat::detail::Storage>> ahead;
  std::vector<MPI_Request> ahead_requests;  ///< one all-gather per parameter
  /// The bytes of the prefetch in flight.
  std::size_t ahead_bytes() const {
    std::size_t n = 0;
    for (const auto& st : ahead) n += st->bytes();
    return n;
  }

  /// The number of elements of `rank`'s shard.
  std::int64_t shard_numel(int rank) const { return shards.counts[static_cast<std::size_t>(rank)]; }
  /// Where `rank`'s shard starts in the unit's range.
  std::int64_t shard_offset(int rank) const { return shards.offsets[static_cast<std::size_t>(rank)]; }
};

}  // namespace remat::dist
