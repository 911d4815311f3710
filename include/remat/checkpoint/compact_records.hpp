#pragma once
// Steps a chain records in its forward pass, held by the tensors their backward reads and nothing
// else. A recorded step's graph — a node per op with its closure, edges and metadata — lives from
// forward until the step is reversed, and for a small step it outweighs what the nodes save many
// times over (an RNN cell with a 128-byte state: ~2 KB of graph per 128 bytes saved). So the chain
// runs such a step without nodes (its ops still report what their nodes would save), keeps those
// tensors, and when the step is reversed rebuilds its graph by running it again with every op
// either handed its kept outputs or skipping its compute: by the early-stop rule a backward reads
// nothing else, so no value is recomputed.
//
// A step whose backward would read a tensor the step made other than by an op (a factory, a user's
// kernel), or an op output already gone when it was saved, cannot be held this way and is recorded
// in full. Early stop off (CheckpointEarlyStop(false)) or value checking on turns this off too: it
// rests on the same assumption.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "remat/checkpoint/error.hpp"
#include "remat/checkpoint/segment_reads.hpp"
#include "remat/core/autograd.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/op_output.hpp"
#include "remat/core/saved_tensor.hpp"

namespace remat::detail {

/// Listens to a step's forward run without nodes: which op outputs (by position among the ops of
/// the step's scope) its nodes would save, held from the moment they are saved.
class CompactRecorder final : public ScopeListener {
 public:
  /// `input`: the step's input, which the executor supplies again when the step is rebuilt.
  explicit CompactRecorder(const Storage* input) : input_(input), first_serial_(next_storage_serial(false)) {}

  void produced(const OpOutput&, const std::vector<TensorRef>& values) override {
    std::vector<Made>& outs = outputs_.emplace_back();
    for (const TensorRef& v : values) {
      outs.push_back({v.storage, v.shape, v.dtype});
      made_at_[v.storage->serial()].push_back(static_cast<std::uint32_t>(outputs_.size() - 1));
    }
  }
  void nested(std::size_t) override { outputs_.emplace_back(); }  // a place with no outputs of its own

  void saved(const std::vector<SavedTensor>& saved) override {
    for (const SavedTensor& s : saved) {
      const Storage* storage = s.storage();
      if (storage == nullptr) continue;
      // The input (also when an op handed it out again as a view: the rebuild then needs both).
      if (storage == input_) input_read_ = true;
      if (auto it = made_at_.find(storage->serial()); it != made_at_.end()) {
        // Every op that handed out this storage (an output and the views of it) gets it back.
        for (std::uint32_t p : it->second) keep(p);
      } else if (storage != input_ && storage->serial() >= first_serial_) {
        complete_ = false;  // made in the step, not by one of its ops: a rebuild could not give it back
      }
    }
  }

  struct Output {
    std::uint32_t position;
    std::uint64_t version;  // when its node saved it
    TensorRef ref;
  };
  /// What the step's backward reads, gathered when its run ends (the recorder is a scoped hook).
  struct Notes {
    std::vector<Output> held;  // by position, each op's outputs in order
    bool input_read = false;
    bool complete = true;  // everything read is held, the input, or from before the step
  };
  Notes notes() const {
    Notes n{{}, input_read_, complete_};
    for (const auto& [p, outs] : kept_)
      for (const auto& [ref, version] : outs) n.held.push_back({p, version, ref});
    return n;
  }

 private:
  struct Made {
    std::weak_ptr<Storage> storage;
    Shape shape;
    const char* dtype;
  };
  void keep(std::uint32_t p) {
    if (kept_.count(p)) return;
    std::vector<std::pair<TensorRef, std::uint64_t>> outs;
    for (const Made& m : outputs_[p]) {
      std::shared_ptr<Storage> s = m.storage.lock();
      if (!s) {
        complete_ = false;  // another output of the op is gone: it cannot be handed back whole
        return;
      }
      const std::uint64_t version = s->version();
      outs.emplace_back(TensorRef{std::move(s), m.shape, m.dtype}, version);
    }
    kept_.emplace(p, std::move(outs));
  }

  const Storage* input_;
  std::uint64_t first_serial_;
  std::vector<std::vector<Made>> outputs_;
  std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> made_at_;
  std::map<std::uint32_t, std::vector<std::pair<TensorRef, std::uint64_t>>> kept_;
  bool input_read_ = false;
  bool complete_ = true;
};

/// The compactly recorded steps of one chain, newest last. Held tensors are saved for backward as
/// the nodes that would hold them are: counted in memory_stats(), or handed to the saved-tensor
/// store in force (SavedBy::chain). Per step: a saved record per held tensor and 16 bytes.
class CompactRecords {
 public:
  static constexpr std::uint32_t kInput = ~std::uint32_t{0};  // position of a held step input

  struct Held {
    std::uint32_t position;
    std::uint64_t serial;  // the storage's, to find a step's input among the step before's outputs
    SavedTensor saved;     // version-checked (and unpacked, when a store holds it) when read
  };
  /// One step: its held outputs, and where its input is (an entry of its own or of the step
  /// before it, whose output it is), or nowhere when its backward does not read it.
  struct Step {
    const Held* first;
    const Held* last;
    const Held* input;
    bool output_requires_grad;
  };

  CompactRecords() = default;
  CompactRecords(const CompactRecords&) = delete;
  CompactRecords& operator=(const CompactRecords&) = delete;
  ~CompactRecords() { clear(); }

  bool has(std::int64_t step) const { return find(step) != nullptr; }
  bool empty() const { return records_.empty(); }
  bool any_requires_grad() const {
    for (const Record& r : records_)
      if (r.output_requires_grad) return true;
    return false;
  }

  /// Holds step `step` (after every step held so far) as its recorder noted it; `input` is its
  /// input, with the version it had when the step read it.
  void add(std::int64_t step, CompactRecorder::Notes notes, const Tensor& input, std::uint64_t input_version,
           bool output_requires_grad) {
    REMAT_ASSERT(records_.empty() || records_.back().step < step);
    REMAT_CHECK(step < kInput && held_.size() < kInput, "chain: too many steps to hold compactly ({})", step);
    Record r{static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(held_.size()), kNone, output_requires_grad};
    std::vector<SavedTensor> saved;
    std::vector<std::uint32_t> positions;
    std::vector<std::uint64_t> serials;
    for (CompactRecorder::Output& o : notes.held) {
      saved.emplace_back(o.ref);
      saved.back().set_saved_version(o.version);
      positions.push_back(o.position);
      serials.push_back(o.ref.storage->serial());
    }
    if (notes.input_read) {
      // The step before usually holds it already, as its own output.
      if (!records_.empty())
        for (std::uint32_t k = records_.back().first; k < r.first; ++k)
          if (held_[k].serial == input.storage()->serial()) r.input = k;
      if (r.input == kNone) {
        r.input = static_cast<std::uint32_t>(held_.size() + saved.size());
        saved.emplace_back(input);
        saved.back().set_saved_version(input_version);
        positions.push_back(kInput);
        serials.push_back(input.storage()->serial());
      }
    }
    pack_saved(saved, SaveContext{"chain step", SavedBy::chain});
    for (std::size_t k = 0; k < saved.size(); ++k) {
      saved[k].retain();
      held_.push_back({positions[k], serials[k], std::move(saved[k])});
    }
    records_.push_back(r);
  }

  Step get(std::int64_t step) const {
    const Record* r = find(step);
    REMAT_ASSERT(r != nullptr);
    const std::size_t end = r + 1 == records_.data() + records_.size() ? held_.size() : (r + 1)->first;
    const Held* base = held_.data();
    const Held* last = base + end;
    if (last != base + r->first && (last - 1)->position == kInput) --last;  // its own input, not an op's output
    return {base + r->first, last, r->input == kNone ? nullptr : base + r->input, r->output_requires_grad};
  }

  /// Drops the newest step.
  void drop(std::int64_t step) {
    REMAT_ASSERT(!records_.empty() && records_.back().step == step);
    while (held_.size() > records_.back().first) {
      held_.back().saved.release();
      held_.pop_back();
    }
    records_.pop_back();
  }

  void clear() {
    while (!records_.empty()) drop(records_.back().step);
  }

 private:
  static constexpr std::uint32_t kNone = ~std::uint32_t{0};
  struct Record {
    std::uint32_t step;
    std::uint32_t first;  // its first entry in held_
    std::uint32_t input;  // entry holding its input, or kNone
    bool output_requires_grad;
  };
  const Record* find(std::int64_t step) const {
    auto it = std::lower_bound(records_.begin(), records_.end(), step,
                               [](const Record& r, std::int64_t s) { return static_cast<std::int64_t>(r.step) < s; });
    return it != records_.end() && it->step == step ? &*it : nullptr;
  }
  std::vector<Held> held_;
  std::vector<Record> records_;
};

/// A compactly held step's rebuild, for the decider of its scope (run_parts.hpp): each op is
/// handed its held outputs, or makes its outputs without computing them (nothing reads them), and
/// records its node as usual; as a listener it checks that the step runs the ops it ran in forward.
class CompactRebuild final : public ScopeListener {
 public:
  /// `ops`: the hash of the op sequence the step ran in forward (SegmentReads::ops).
  CompactRebuild(const CompactRecords::Step& step, std::uint64_t ops, std::string who)
      : next_(step.first), last_(step.last), forward_ops_(ops), who_(std::move(who)) {}

  /// The held outputs of the op at `out.position`, or none (then it is skipped).
  std::vector<TensorRef> reuse(const OpOutput& out) {
    const auto position = static_cast<std::uint32_t>(out.position);
    if (next_ == last_ || next_->position != position) return {};
    std::vector<TensorRef> refs;
    std::size_t bytes = 0;
    for (; next_ != last_ && next_->position == position; ++next_) {
      const std::size_t k = refs.size();
      if (k >= out.count) break;
      // The held tensor, checked against in-place writes since it was held (and read back from the
      // store that keeps it, if one does).
      const TensorRef held = next_->saved.ref(who_.c_str());
      refs.push_back({held.storage, out.shapes ? out.shapes[k] : out.shape,
                      out.dtypes ? out.dtypes[k] : (k == 0 ? out.dtype : nullptr)});
      bytes += held.storage->bytes();
    }
    if (refs.size() != out.count || bytes != out.bytes || (next_ != last_ && next_->position == position))
      throw CheckpointError(fmt::format("{}: op #{} '{}' made {} output(s) of {} bytes when the step was rebuilt, but {} "
                                        "of {} bytes in forward; a step must compute the same thing every time it runs",
                                        who_, position, out.op.name(), out.count, out.bytes, refs.size(), bytes));
    return refs;
  }

  void produced(const OpOutput& out, const std::vector<TensorRef>&) override {
    ++ops_made_;
    ops_ = hash_op(ops_, out);
  }
  void saved(const std::vector<SavedTensor>&) override {}
  void nested(std::size_t) override { ops_ = hash_nested(ops_); }

  /// A remat::Error when the rebuild ran other ops than the forward (its graph would route
  /// gradients through outputs handed to the wrong ops).
  void finish() const {
    if (ops_ != forward_ops_)
      throw CheckpointError(fmt::format("{}: the step ran other ops (or other shapes) when rebuilt than in forward ({} "
                                        "op(s) now); a step must compute the same thing every time it runs",
                                        who_, ops_made_));
    if (next_ != last_)
      throw CheckpointError(fmt::format("{}: the step ran {} op(s) when rebuilt, but its forward held the output of op #{}; "
                                        "a step must compute the same thing every time it runs",
                                        who_, ops_made_, next_->position));
  }

 private:
  const CompactRecords::Held* next_;
  const CompactRecords::Held* last_;
  std::uint64_t forward_ops_;
  std::uint64_t ops_ = kEmptyOpHash;
  std::string who_;
  std::uint32_t ops_made_ = 0;
};

}  // namespace remat::detail
