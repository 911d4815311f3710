#pragma once
// What a checkpointed segment's backward will read, learnt while its forward runs (which records
// no nodes, but whose ops still report what their nodes would save):
//   - the last op output a backward reads: a replay computes up to it and no further (early stop);
//   - the tensors made before the segment that its ops save — parameters, buffers, captured
//     tensors — with their versions, so an in-place write to one between forward and backward is
//     the same error it is without checkpointing, not a replay from changed values (under
//     autocast, the parameters whose cached bfloat16 copies they save: a replay would cast a
//     changed parameter again).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "remat/core/autocast.hpp"
#include "remat/core/error.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/saved_tensor.hpp"

namespace remat::detail {

/// Folds one op output report into a hash of a run's op sequence (names and shapes): two runs of
/// a step that made the same ops in the same order with the same shapes hash alike.
inline std::uint64_t hash_op(std::uint64_t h, const OpOutput& out) {
  auto mix = [&h](std::uint64_t v) { h = fnv1a_mix(h, v); };
  for (const char* c = out.op.name(); *c; ++c) mix(static_cast<unsigned char>(*c));
  for (std::size_t k = 0; k < out.count; ++k) {
    const Shape& shape = out.shapes ? out.shapes[k] : out.shape;
    mix(static_cast<std::uint64_t>(shape.rank()));
    for (std::int64_t d : shape) mix(static_cast<std::uint64_t>(d));
  }
  return h;
}
inline constexpr std::uint64_t kEmptyOpHash = kFnvOffset;
/// Folds a nested scope's place into a hash of a run's op sequence (hash_op).
inline std::uint64_t hash_nested(std::uint64_t h) { return fnv1a_mix(h, ~std::uint64_t{0}); }

struct SegmentReads {
  /// Position (among the op outputs the segment reports, from 0) of the last output a backward
  /// reads; -1 when it reads none.
  std::ptrdiff_t last_needed = -1;

  struct Outside {
    std::weak_ptr<Storage> storage;
    Shape shape;
    std::uint64_t version;
  };
  std::vector<Outside> outside;
  /// The segment's op sequence, hashed (hash_op).
  std::uint64_t ops = kEmptyOpHash;

  /// A remat::Error when a tensor the segment read from outside was written in place since.
  void check_versions(const std::string& who) const {
    for (const Outside& o : outside) {
      const std::shared_ptr<Storage> s = o.storage.lock();
      if (s && s->version() != o.version)
        throw Error(modified_in_place(who, fmt::format("a tensor of shape {}", o.shape), s->version(), o.version,
                                      "(the segment reads it, e.g. a parameter updated before backward)"));
    }
  }
};

/// Listens to a segment's (or a chain step's) first run: notes which storage each op made and at
/// which position, hashes the op sequence, and reads the saves reported in its scope. (The scope
/// hands the saves of tensors from outside it to the enclosing scope when it ends.)
class SegmentReadsListener final : public ScopeListener {
 public:
  explicit SegmentReadsListener(SegmentReads& reads) : reads_(reads), first_serial_(next_storage_serial(false)) {}

  void produced(const OpOutput& out, const std::vector<TensorRef>& values) override {
    for (const TensorRef& v : values) made_at_[v.storage->serial()] = static_cast<std::ptrdiff_t>(out.position);
    took_place(out.position, out.began_serial);
    reads_.ops = hash_op(reads_.ops, out);
  }

  void nested(std::size_t position) override {
    took_place(position, ended_serial_);  // it began after the place before it ended, or later
    reads_.ops = hash_nested(reads_.ops);
  }

  void saved(const std::vector<SavedTensor>& saved) override {
    for (const SavedTensor& s : saved) {
      const Storage* storage = s.storage();
      if (storage == nullptr) continue;
      if (auto it = made_at_.find(storage->serial()); it != made_at_.end()) {
        reads_.last_needed = std::max(reads_.last_needed, it->second);
      } else if (const auto source = autocast_source(*storage)) {
        // A parameter's bfloat16 copy (autocast's cache): a replay casts the parameter again
        // unless it is unchanged, so the parameter is what the segment reads, version and all.
        if (const auto p = source->storage.lock(); p && seen_outside_.insert(p->serial()).second)
          reads_.outside.push_back({source->storage, source->shape, source->version});
      } else if (storage->serial() >= first_serial_) {
        // Made inside the segment but not by one of its ops (a factory, a user's own kernel, a
        // nested scope, an autocast copy of a product's operand made before the product ran): it
        // may depend on any place that had begun when it was made, so all of those are needed —
        // and none after (a GPT block's last product saves the bfloat16 copy of its input, made
        // before the product: the product itself need not run again).
        reads_.last_needed = std::max(reads_.last_needed, places_begun_by(storage->serial()) - 1);
      } else if (seen_outside_.insert(storage->serial()).second) {
        reads_.outside.push_back({s.shared_storage(), s.shape(), s.version()});
      }
    }
  }

 private:
  static std::optional<AutocastCache::Source> autocast_source(const Storage& s) {
    const AutocastCache* cache = session().autocast_cache.get();
    return s.parameter() && cache ? cache->source_of(&s) : std::nullopt;
  }

  void took_place(std::size_t position, std::uint64_t began_serial) {
    began_.resize(position + 1, began_serial);
    began_[position] = began_serial;
    ended_serial_ = next_storage_serial(false);
  }

  /// How many of the places taken so far had begun when the storage of serial `serial` was made.
  std::ptrdiff_t places_begun_by(std::uint64_t serial) const {
    return std::upper_bound(began_.begin(), began_.end(), serial) - began_.begin();
  }

  SegmentReads& reads_;
  std::uint64_t first_serial_;
  std::uint64_t ended_serial_ = first_serial_;    // when the last place taken ended
  std::vector<std::uint64_t> began_;              // per place taken (ops and nested scopes): when it began
  std::unordered_map<std::uint64_t, std::ptrdiff_t> made_at_;
  std::unordered_set<std::uint64_t> seen_outside_;
};

}  // namespace remat::detail
