#pragma once
// What the tape holds for backward right now: each saved tensor with the op that saved it, its
// shape and bytes, and the total with shared storage counted once (JAX's print_saved_residuals).

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/core/autograd.hpp"

namespace remat {

/// One tensor saved for backward, as saved_tensors() lists it.
struct SavedTensorInfo {
  std::string op;     ///< the op (or checkpoint segment) that saved it
  /// Its shape.
  Shape shape;
  /// Its element type's name ("float32", ...).
  std::string dtype;
  std::size_t bytes;  ///< bytes of its storage
  bool shared;        ///< its storage is also saved by an entry listed earlier (not counted again)
  bool discarded = false;    ///< a memory budget discarded its bytes; backward recomputes them
  double rebuild_flops = 0;  ///< what recomputing it would cost (when discarded)
  bool packed = false;       ///< saved-tensor hooks hold it (bytes: its size when packed; not counted)
  std::string where;         ///< what the hooks that hold it say of it ("on disk …"), if anything
};

/// What the tape holds for backward right now, one entry per saved tensor.
struct SavedTensorReport {
  /// Every saved tensor, in tape order.
  std::vector<SavedTensorInfo> entries;
  std::size_t total_bytes = 0;  ///< unique resident storages only: what the tape actually keeps alive
  std::size_t discarded_bytes = 0;  ///< unique storages a memory budget discarded (recomputed on use)
  std::size_t packed_bytes = 0;  ///< tensors saved-tensor hooks hold, at their size when packed

  /// A table: op, shape, dtype and bytes per entry, then the totals.
  std::string str() const {
    std::string out = fmt::format("{:<24} {:<22} {:<8} {:>12}\n", "op", "shape", "dtype", "bytes");
    for (const SavedTensorInfo& e : entries)
      out += fmt::format("{:<24} {:<22} {:<8} {:>12}{}{}\n", e.op, e.shape, e.dtype, e.bytes, e.shared ? " (shared)" : "",
                         e.discarded ? fmt::format(" (discarded; rebuild {:.3g} flop)", e.rebuild_flops)
                         : e.packed ? fmt::format(" (packed by saved-tensor hooks{}{})", e.where.empty() ? "" : ": ", e.where)
                                    : std::string());
    out += fmt::format("{} saved tensors, {} bytes held for backward", entries.size(), total_bytes);
    if (discarded_bytes) out += fmt::format(", {} bytes discarded (recomputed when backward reads them)", discarded_bytes);
    if (packed_bytes) out += fmt::format(", {} bytes packed by saved-tensor hooks", packed_bytes);
    out += "\n";
    return out;
  }
};

/// Lists what `tape`'s unreleased nodes hold for backward, oldest first.
inline SavedTensorReport saved_tensors(const Tape& tape = current_tape()) {
  SavedTensorReport report;
  std::vector<const detail::Storage*> seen;
  for (const auto& node : tape.nodes()) {
    if (node->released()) continue;
    for (const detail::SavedTensor& s : node->saved()) {
      const detail::PackedState state = s.packed() ? s.packed_state() : detail::PackedState{};
      if (s.packed() && state.storage == nullptr) {
        report.packed_bytes += s.packed_bytes();
        report.entries.push_back(
            {node->name(), s.shape(), s.dtype(), s.packed_bytes(), false, false, 0.0, true, state.where});
        continue;
      }
      // In RAM: kept by the node, or by a store that keeps it there (a memory budget, which may
      // have discarded its bytes for now).
      const detail::Storage* storage = s.packed() ? state.storage : s.storage();
      const std::size_t bytes = s.packed() ? s.packed_bytes() : s.bytes();
      const bool shared = std::find(seen.begin(), seen.end(), storage) != seen.end();
      const bool discarded = storage != nullptr && !storage->resident();
      if (!shared) {
        seen.push_back(storage);
        (discarded ? report.discarded_bytes : report.total_bytes) += bytes;
      }
      report.entries.push_back(
          {node->name(), s.shape(), s.dtype(), bytes, shared, discarded, discarded ? state.rebuild_flops : 0.0, false, {}});
    }
  }
  return report;
}

/// Prints saved_tensors(tape) as a table.
inline void print_saved_tensors(const Tape& tape = current_tape()) { fmt::print("{}", saved_tensors(tape).str()); }

}  // namespace remat
