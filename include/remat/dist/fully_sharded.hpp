#pragma once
// dist::FullyShardedDataParallel — ZeRO stage 3, PyTorch's FSDP for remat: every rank runs the
// whole model on its share of the batch, but keeps only 1/N of each block's parameters. A block's
// parameters are all-gathered just before it runs and freed after, gradients are reduce-scattered
// as soon as a block's are final, and dist::FullyShardedAdamW updates each rank's shard.
//
// Units: each block of the model's BlockStack is one unit (its parameters gathered and sharded
// together); everything else (embeddings, final norm, head) is the root unit, which stays whole —
// PyTorch's root FSDP unit keeps its parameters from forward to backward too — and has its
// gradients and optimizer state sharded.
//
// Why checkpointing gathers a block once in backward: the wrapper sits around each block inside
// whatever runs the stack (BlockStack::set_block_wrapper), so a checkpoint's segment and its replay
// both go through it. After a block's forward its parameters are freed unless a backward through
// that very graph follows at once (a replay inside backward that records one); then they stay
// until the block's gradients are final. A block whose forward was freed is gathered again by a
// node on its output whose backward runs before any of the block's own. So per-block checkpointing
// and no checkpointing both gather each block twice a step (forward, backward), not three times.
// A parameter's Storage object stays the same throughout: nodes that saved it read the gathered
// bytes, and a read while it is sharded is an error naming the parameter and its unit.
//
// Why the gradients are one process's bits: each rank receives every rank's copy of its shard of a
// unit's gradients (all-to-all), adds them in rank order and divides by N, as DataParallel does;
// AdamW's element-wise update does not care where a shard begins (optim::AdamWStep). A unit's
// gradients become final when each parameter has taken as many contributions as in the first step
// (which reduces everything at its end, in unit order, and learns the counts).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/node.hpp"
#include "remat/core/observer.hpp"
#include "remat/dist/context.hpp"
#include "remat/nn/blocks.hpp"
#include "remat/nn/gpt.hpp"
#include "remat/nn/module.hpp"

namespace remat::dist {

/// How FullyShardedDataParallel starts.
struct FullyShardedOptions {
  /// Copy rank 0's parameters to every rank before sharding them.
  bool broadcast_parameters = true;
  /// Start the all-gather of the unit expected next while the current one runs: in forward the
  /// next block; in backward the next in the order the previous backward gathered them (the
  /// schedule's order: reverse for per-block checkpointing, the replay order of a chain), or the
  /// block before in the first backward. Two units' parameters are then here at once.
  bool prefetch = true;
  /// Units whose gradient reduction may be in flight at once (each holds its local gradients and
  /// every rank's copy of its shard: twice the unit's bytes). More overlap backward with
  /// communication; fewer bound the memory.
  std::size_t reductions_in_flight = 2;
};

/// A rank's bytes by kind at the moment its live bytes peaked (FullyShardedDataParallel samples
/// them at every op and backward op); the optimizer's state is its own (state_bytes()).
struct ShardedMemory {
  std::size_t live = 0;         ///< all the allocator's live bytes then
  std::size_t parameters = 0;   ///< the parameters' shards, and the root unit whole
  std::size_t gradients = 0;    ///< the gradients' shards, reductions in flight, local .grad
  std::size_t gathered = 0;     ///< blocks' parameters gathered, and prefetches in flight
  std::size_t activations = 0;  ///< saved for backward (memory_stats().saved_activation_bytes)
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
  Tensor params;                 ///< this rank's shard of the parameters (the values the optimizer updates)
  Tensor grads;                  ///< this rank's shard of the averaged gradients
  std::int64_t gathers = 0;      ///< all-gathers of its parameters so far (prefetched or not)
  std::int64_t prefetched = 0;   ///< of which started ahead, while another unit ran
  std::int64_t reductions = 0;   ///< reduce-scatters of its gradients so far

  // State within a step.
  bool gathered = false;      ///< its parameters' bytes are here
  bool stale = false;         ///< the shard changed since the last gather: the next one bumps versions
  bool grads_fresh = true;    ///< the next reduction writes the gradient shard (else adds to it)
  int waiting = 0;            ///< parameters whose gradients are not final yet
  bool reduced = false;       ///< this step's reduction has started
  ///@{
  /// The reduction in flight: the local gradients, and every rank's copy of my shard.
  Tensor flat_grads, rows;
  ///@}
  ///@{
  /// Where each rank's copy lands in `rows` (MPI's counts and displacements).
  std::vector<int> row_counts, row_offsets;
  ///@}
  MPI_Request request = MPI_REQUEST_NULL;        ///< the reduction in flight (MPI_REQUEST_NULL when none)
  Tensor ahead;                                  ///< a prefetch in flight: the gathered parameters, end to end
  MPI_Request ahead_request = MPI_REQUEST_NULL;  ///< the prefetch's request

  /// The number of elements of `rank`'s shard.
  std::int64_t shard_numel(int rank) const { return shards.counts[static_cast<std::size_t>(rank)]; }
  /// Where `rank`'s shard starts in the unit's range.
  std::int64_t shard_offset(int rank) const { return shards.offsets[static_cast<std::size_t>(rank)]; }
};

/// ZeRO stage 3 over the blocks of a BlockStack model: each rank keeps 1/N of every block's
/// parameters, gathers a block's just before it runs (forward, or a checkpoint's replay) and frees
/// them after; gradients are averaged over ranks into each rank's shard. Use with
/// dist::FullyShardedAdamW. Wrappers on one thread must be destroyed in the reverse order of their
/// construction, and outlive the graphs built through them.
class FullyShardedDataParallel : private remat::Observer {
 public:
  /// `blocks[i]` is the module holding block i's parameters (stack runs blocks().size() == blocks.size()
  /// blocks); the model's other parameters form the root unit.
  FullyShardedDataParallel(Context& ctx, nn::Module& model, nn::BlockStack& stack, std::vector<nn::Module*> blocks,
                           FullyShardedOptions options = {})
      : ctx_(ctx), stack_(stack), prefetch_(options.prefetch), max_in_flight_(options.reductions_in_flight) {
    REMAT_CHECK(!stack.has_block_wrapper(), "FullyShardedDataParallel: the model's blocks are already wrapped (by "
                "another FullyShardedDataParallel?): one wrapper per model");
    REMAT_CHECK(options.reductions_in_flight >= 1, "FullyShardedDataParallel: reductions_in_flight must be at least 1, "
                "got {}", options.reductions_in_flight);
    REMAT_CHECK(stack.blocks().size() == blocks.size(), "FullyShardedDataParallel: the model runs {} blocks, {} block "
                "modules were given (one per block)", stack.blocks().size(), blocks.size());
    for (auto& [name, p] : model.named_parameters()) {
      REMAT_CHECK(p != nullptr && p->defined() && p->requires_grad(),
                  "FullyShardedDataParallel: parameter '{}' must be a defined tensor that requires grad", name);
      REMAT_CHECK(p->storage()->bytes() == p->nbytes(), "FullyShardedDataParallel: parameter '{}' of shape {} shares "
                  "its storage ({} B, it has {} B): each parameter needs its own", name, p->shape(),
                  p->storage()->bytes(), p->nbytes());
      if (index_.count(p->meta().get())) continue;  // a tied weight: one parameter under two names
      index_.emplace(p->meta().get(), params_.size());
      params_.push_back(p);
      names_.push_back(name);
    }
    unit_of_.assign(params_.size(), blocks.size());  // the root, unless a block claims it
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      REMAT_CHECK(blocks[b] != nullptr, "FullyShardedDataParallel: block module {} is null", b);
      for (auto& [name, p] : blocks[b]->named_parameters()) {
        auto it = index_.find(p->meta().get());
        REMAT_CHECK(it != index_.end(), "FullyShardedDataParallel: block {}'s parameter '{}' is not one of the "
                    "model's", b, name);
        REMAT_CHECK(unit_of_[it->second] == blocks.size(), "FullyShardedDataParallel: parameter '{}' is in block {} "
                    "and block {}: a unit's parameters must be its own", names_[it->second], unit_of_[it->second], b);
        unit_of_[it->second] = b;
      }
    }
    units_.resize(blocks.size() + 1);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      units_[u].name = u < blocks.size() ? "block " + std::to_string(u) : "root";
      units_[u].root = u == blocks.size();
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      ShardedUnit& u = units_[unit_of_[i]];
      u.entries.push_back({i, u.numel, params_[i]->numel()});
      u.numel += params_[i]->numel();
    }
    for (const ShardedUnit& u : units_) detail::mpi_count(u.numel, "FullyShardedDataParallel unit");
    detail::agree_across_ranks(ctx_, "FullyShardedDataParallel", "parameters and units", describe());
    if (options.broadcast_parameters) broadcast_parameters(ctx_, params_);
    seen_.assign(params_.size(), 0);
    away_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i)
      away_[i] = std::make_shared<const std::string>(fmt::format(
          "FullyShardedDataParallel: parameter '{}' of {} is sharded: its values are gathered only while its unit "
          "runs forward or backward (read it inside full_parameters())", names_[i], units_[unit_of_[i]].name));
    // Gathers start in the order units run, reductions in the order gradients become final: two
    // orders that interleave differently on each rank, hence two communicators.
    detail::check_mpi(MPI_Comm_dup(ctx_.comm(), &gather_comm_), "MPI_Comm_dup");
    detail::check_mpi(MPI_Comm_dup(ctx_.comm(), &reduce_comm_), "MPI_Comm_dup");
    stack_.set_block_wrapper([this](std::size_t i, nn::Block f) -> nn::Block {
      REMAT_CHECK(i + 1 < units_.size(), "FullyShardedDataParallel: the model runs block {}, the wrapper knows {} "
                  "blocks", i, units_.size() - 1);
      return [this, i, f = std::move(f)](const Tensor& x) { return run_unit(i, f, x); };
    });
    const int rank = ctx_.rank();
    for (ShardedUnit& u : units_) {
      u.shards = ShardLayout(u.numel, ctx_.world_size());
      const std::int64_t mine = u.shard_numel(rank);
      u.params = Tensor(Shape{mine});
      u.grads = Tensor(Shape{mine});
      remat::detail::flat(u.grads).setZero();
      take_back(u);
      u.row_counts.assign(static_cast<std::size_t>(ctx_.world_size()), static_cast<int>(mine));
      u.row_offsets.resize(static_cast<std::size_t>(ctx_.world_size()));
      for (int q = 0; q < ctx_.world_size(); ++q)
        u.row_offsets[static_cast<std::size_t>(q)] = q * static_cast<int>(mine);
      u.gathered = true;
      release(u);
    }
  }

  /// A GPT: one unit per Transformer block; embeddings, final norm and head are the root.
  FullyShardedDataParallel(Context& ctx, nn::GPT& gpt, FullyShardedOptions options = {})
      : FullyShardedDataParallel(ctx, gpt, gpt, block_modules(gpt), options) {}

  /// Gathers the parameters back, so the model is whole again (unless an exception is unwinding:
  /// the other ranks may not be here to gather with).
  ~FullyShardedDataParallel() override {
    stack_.set_block_wrapper({});
    for (ShardedUnit& u : units_) {
      if (u.request != MPI_REQUEST_NULL) MPI_Wait(&u.request, MPI_STATUS_IGNORE);
      if (u.ahead_request != MPI_REQUEST_NULL) MPI_Wait(&u.ahead_request, MPI_STATUS_IGNORE);
      u.ahead = Tensor();
    }
    if (std::uncaught_exceptions() == 0) {
      try {
        for (ShardedUnit& u : units_) gather(u);
      } catch (...) {
      }
    }
    MPI_Comm_free(&gather_comm_);
    MPI_Comm_free(&reduce_comm_);
  }
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// The parameters, each once (a tied weight under its first name).
  const std::vector<Tensor*>& parameters() const { return params_; }
  /// Their names, in the same order.
  const std::vector<std::string>& names() const { return names_; }
  /// The units: one per block, in block order, then the root.
  const std::vector<ShardedUnit>& units() const { return units_; }
  /// The MPI context it communicates through.
  const Context& context() const { return ctx_; }
  /// Units whose parameters are here now, the root apart: the gathered working set.
  std::size_t gathered_units() const {
    std::size_t n = 0;
    for (const ShardedUnit& u : units_) n += !u.root && u.gathered ? 1 : 0;
    return n;
  }
  /// The bytes by kind when live bytes peaked since the last reset_peak_memory() (or construction).
  const ShardedMemory& peak_memory() const { return peak_; }
  /// Starts measuring peak_memory() afresh.
  void reset_peak_memory() { peak_ = ShardedMemory{}; }

  /// Prefetched gathers that were dropped unused (the order was not the expected one).
  std::int64_t unused_prefetches() const { return unused_prefetches_; }
  /// All-gathers of parameters so far, over every unit.
  std::int64_t gathers() const {
    std::int64_t n = 0;
    for (const ShardedUnit& u : units_) n += u.gathers;
    return n;
  }

  /// Writes the full averaged gradients into every parameter's .grad (one all-gather per unit; a
  /// collective, for inspection and tests — the optimizer reads the shards).
  void gather_gradients() {
    for (ShardedUnit& u : units_) {
      const Tensor flat = gather_flat(u, u.grads);
      for (const ShardedUnit::Entry& e : u.entries) {
        Tensor* p = params_[e.param];
        if (!p->grad().defined()) p->meta()->grad = Tensor(p->shape());
        std::copy(flat.data() + e.offset, flat.data() + e.offset + e.numel, p->grad().data());
      }
    }
  }

  /// Clips the averaged gradients (the shards) by their global L2 norm, summed over shards in rank
  /// order, and returns the norm before clipping; the same on every rank (a collective).
  double clip_grad_norm(double max_norm) {
    REMAT_CHECK(max_norm > 0, "FullyShardedDataParallel::clip_grad_norm: max_norm must be positive, got {}", max_norm);
    double mine = 0;
    for (const ShardedUnit& u : units_) mine += remat::detail::flat(u.grads).cast<double>().square().sum();
    const double norm = detail::sharded_norm(ctx_, mine), scale = max_norm / (norm + 1e-6);
    if (scale < 1)
      for (ShardedUnit& u : units_) remat::detail::flat(u.grads) *= static_cast<float>(scale);
    return norm;
  }

  /// RAII: every parameter whole while it lives (PyTorch's summon_full_params with writeback); a
  /// collective when it begins. Read, save, load or evaluate the model inside it: forwards run
  /// without gathering, and what is written to the parameters goes back to the shards when it ends
  /// (each rank takes its slice of its own values: write the same on every rank).
  class FullParameters {
   public:
    /// Gathers every unit of `fsdp` (a collective).
    explicit FullParameters(FullyShardedDataParallel& fsdp) : fsdp_(fsdp) {
      for (ShardedUnit& u : fsdp_.units_) fsdp_.gather(u);
      ++fsdp_.pinned_;
    }
    ~FullParameters() {
      --fsdp_.pinned_;
      for (ShardedUnit& u : fsdp_.units_) {
        fsdp_.take_back(u);
        fsdp_.release(u);
      }
    }
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
  };
  /// A FullParameters guard: `{ auto whole = fsdp.full_parameters(); save(model); }`.
  FullParameters full_parameters() { return FullParameters(*this); }

 private:
  friend class FullyShardedAdamW;

  static std::vector<nn::Module*> block_modules(nn::GPT& gpt) {
    std::vector<nn::Module*> out;
    for (const auto& b : gpt.h) out.push_back(b.get());
    return out;
  }

  // Block i: gathered around its forward, and again before its backward if freed meanwhile.
  Tensor run_unit(std::size_t i, const nn::Block& f, const Tensor& x) {
    gather(units_[i]);
    Tensor y = f(x);
    const remat::detail::Session& s = remat::detail::session();
    const bool backward_follows = s.backward_depth > 0 && s.recording && s.grad_enabled;
    if (!backward_follows) release(units_[i]);
    if (!remat::detail::grad_needed(y)) return y;
    // y's data under a new node whose backward, the first of the block's, gathers the block.
    Tensor out(y.storage(), y.shape());
    remat::detail::record<float>("fsdp_gather", {y}, {&out}, {}, [this, i](remat::detail::BackwardContext<float>& ctx) {
      gather(units_[i]);
      ctx.accumulate(0, Tensor(ctx.grad_output().storage(), ctx.grad_output().shape()));
    });
    return out;
  }

  // This rank's shard of every rank's `shard` laid end to end (a counted tensor of the unit's size).
  Tensor gather_flat(const ShardedUnit& u, const Tensor& shard) {
    Tensor flat(Shape{u.numel});
    detail::check_mpi(MPI_Allgatherv(shard.data(), static_cast<int>(shard.numel()), MPI_FLOAT, flat.data(), u.shards.counts.data(), u.shards.offsets.data(), MPI_FLOAT,
                                     gather_comm_),
                      "MPI_Allgatherv");
    return flat;
  }

  // The unit's parameters from the shards into their own storages (the same Storage objects, so
  // nodes that saved them read the gathered bytes).
  void gather(ShardedUnit& u) {
    if (u.gathered && !u.stale) return;
    Tensor flat;
    if (u.ahead.defined()) {
      detail::check_mpi(MPI_Wait(&u.ahead_request, MPI_STATUS_IGNORE), "MPI_Wait");
      flat = std::move(u.ahead);
      u.ahead = Tensor();
      ++u.prefetched;
    } else {
      flat = gather_flat(u, u.params);
    }
    for (const ShardedUnit::Entry& e : u.entries) {
      remat::detail::Storage& st = *params_[e.param]->storage();
      if (!st.resident()) {
        remat::detail::Storage fresh(st.bytes());
        st.adopt(fresh);
      }
      std::copy(flat.data() + e.offset, flat.data() + e.offset + e.numel, static_cast<float*>(st.raw_data()));
      if (u.stale) st.bump_version();  // new values: a graph recorded before the step may not read them
    }
    u.stale = false;
    u.gathered = true;
    ++u.gathers;
    if (!u.root) prefetch_after(static_cast<std::size_t>(&u - units_.data()));
  }

  // Block i was just gathered: start gathering the one expected next.
  void prefetch_after(std::size_t i) {
    const std::size_t blocks = units_.size() - 1;
    std::size_t next = blocks;  // none
    if (remat::detail::session().backward_depth > 0) {
      backward_order_.push_back(i);
      const std::size_t at = backward_order_.size();
      if (at < last_backward_order_.size()) next = last_backward_order_[at];
      else if (last_backward_order_.empty() && i > 0) next = i - 1;  // the first backward: a stack's reverse order
    } else if (pinned_ == 0) {
      next = i + 1;
    }
    if (!prefetch_ || next >= blocks) return;
    ShardedUnit& n = units_[next];
    if ((n.gathered && !n.stale) || n.ahead.defined()) return;
    n.ahead = Tensor(Shape{n.numel});
    detail::check_mpi(MPI_Iallgatherv(n.params.data(), static_cast<int>(n.params.numel()), MPI_FLOAT, n.ahead.data(),
                                      n.shards.counts.data(), n.shards.offsets.data(), MPI_FLOAT, gather_comm_,
                                      &n.ahead_request),
                      "MPI_Iallgatherv");
  }

  // Lets prefetches in flight move on (MPI progresses a non-blocking collective inside its calls).
  void progress_prefetches() {
    for (ShardedUnit& u : units_)
      if (u.ahead_request != MPI_REQUEST_NULL) {
        int done = 0;
        detail::check_mpi(MPI_Test(&u.ahead_request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      }
  }

  // Prefetches nobody used (the shards are about to change, or the order was not the expected
  // one): completed on every rank alike, then dropped.
  void drop_prefetches() {
    for (ShardedUnit& u : units_)
      if (u.ahead.defined()) {
        detail::check_mpi(MPI_Wait(&u.ahead_request, MPI_STATUS_IGNORE), "MPI_Wait");
        u.ahead = Tensor();
        ++unused_prefetches_;
      }
  }

  // This rank's slice of the unit's whole parameters into its shard.
  void take_back(ShardedUnit& u) {
    const std::int64_t lo = u.shard_offset(ctx_.rank());
    detail::for_each_piece(u.entries, lo, lo + u.params.numel(), [&](const ShardedUnit::Entry& e, std::int64_t from, std::int64_t to) {
      const float* w = params_[e.param]->data() + (from - e.offset);
      std::copy(w, w + (to - from), u.params.data() + (from - lo));
    });
  }

  void release(ShardedUnit& u) {
    if (u.root || !u.gathered || pinned_ > 0) return;
    for (const ShardedUnit::Entry& e : u.entries) params_[e.param]->storage()->discard(away_[e.param]);
    u.gathered = false;
  }

  // Observer: ops and backward ops move the collectives in flight on (MPI progresses a
  // non-blocking collective only inside its calls), and a finished reduction frees its buffers.
  void op_begin(const OpOutput&) override {
    progress_in_flight();
    sample_memory();
  }
  void backward_op(const char*) override {
    progress_in_flight();
    sample_memory();
  }

  // The breakdown, when live bytes are at a new peak.
  void sample_memory() {
    const MemoryStats now = memory_stats();
    if (now.live_bytes <= peak_.live) return;
    ShardedMemory m;
    m.live = now.live_bytes;
    m.activations = now.saved_activation_bytes;
    for (const ShardedUnit& u : units_) {
      m.parameters += u.params.nbytes();
      m.gradients += u.grads.nbytes();
      if (u.flat_grads.defined()) m.gradients += u.flat_grads.nbytes() + u.rows.nbytes();
      if (u.ahead.defined()) m.gathered += u.ahead.nbytes();
      for (const FlatEntry& e : u.entries) {
        const Tensor* p = params_[e.param];
        if (u.gathered) (u.root ? m.parameters : m.gathered) += p->nbytes();
        if (p->grad().defined()) m.gradients += p->grad().nbytes();
      }
    }
    peak_ = m;
  }
  void progress_in_flight() {
    if (prefetch_) progress_prefetches();
    if (!pending_.empty()) progress(pending_.size());
  }

  // Observer: a parameter's gradient took a contribution.
  void leaf_grad(const void* leaf) override {
    auto it = index_.find(leaf);
    if (it == index_.end()) return;
    const std::size_t i = it->second;
    if (!step_started_) start_step();
    ++seen_[i];
    if (expected_.empty()) return;  // the first step learns the counts
    ShardedUnit& u = units_[unit_of_[i]];
    REMAT_CHECK(!u.reduced, "FullyShardedDataParallel: parameter '{}' took a gradient after {}'s gradients were "
                "reduced: it took {} contribution(s) in the first step and {} in this one. The graph must use each "
                "parameter as often in every step", names_[i], u.name, expected_[i], seen_[i]);
    if (seen_[i] == expected_[i] && --u.waiting == 0) reduce(u);
  }

  void backward_end(bool completed, bool outermost) override {
    if (!outermost) return;  // a dry run inside a backward is not the step's end
    last_backward_order_ = completed ? std::move(backward_order_) : std::vector<std::size_t>{};
    backward_order_.clear();
    drop_prefetches();
    if (!step_started_) return;
    if (!completed) {
      // Keep the communicators consistent: what was sent completes; nothing is added.
      for (ShardedUnit& u : units_)
        if (u.request != MPI_REQUEST_NULL) MPI_Wait(&u.request, MPI_STATUS_IGNORE);
      pending_.clear();
      for (ShardedUnit& u : units_) u.flat_grads = u.rows = Tensor();
      end_step();
      return;
    }
    if (expected_.empty()) expected_ = seen_;
    for (ShardedUnit& u : units_)
      if (!u.reduced) reduce(u);
    progress(0);
    end_step();
  }

  void start_step() {
    step_started_ = true;
    for (ShardedUnit& u : units_) {
      u.reduced = false;
      u.waiting = 0;
      if (!expected_.empty())
        for (const ShardedUnit::Entry& e : u.entries) u.waiting += expected_[e.param] > 0 ? 1 : 0;
    }
  }
  void end_step() {
    std::fill(seen_.begin(), seen_.end(), 0);
    step_started_ = false;
  }

  // The unit's local gradients leave .grad for a flat buffer; every rank gets every rank's copy
  // of its shard; the parameters go back to their shards.
  void reduce(ShardedUnit& u) {
    u.flat_grads = Tensor(Shape{u.numel});
    for (const ShardedUnit::Entry& e : u.entries) {
      Tensor* p = params_[e.param];
      const Tensor g = p->grad();
      float* to = u.flat_grads.data() + e.offset;
      if (g.defined()) std::copy(g.data(), g.data() + e.numel, to);
      else std::fill(to, to + e.numel, 0.0f);
      p->meta()->grad = Tensor();
    }
    const int n = ctx_.world_size();
    u.rows = Tensor(Shape{u.shard_numel(ctx_.rank()) * n});
    detail::check_mpi(MPI_Ialltoallv(u.flat_grads.data(), u.shards.counts.data(), u.shards.offsets.data(), MPI_FLOAT,
                                     u.rows.data(), u.row_counts.data(), u.row_offsets.data(), MPI_FLOAT, reduce_comm_,
                                     &u.request),
                      "MPI_Ialltoallv");
    u.reduced = true;
    ++u.reductions;
    release(u);
    pending_.push_back(&u);
    // Waits only to bound the buffers: a reduction completes when every rank has moved it on.
    progress(max_in_flight_);
  }

  // Sums what has arrived, in the order sent, waiting until at most `in_flight` reductions remain.
  void progress(std::size_t in_flight) {
    std::size_t done_count = 0;
    for (ShardedUnit* u : pending_) {
      int done = 0;
      if (pending_.size() - done_count > in_flight) {
        detail::check_mpi(MPI_Wait(&u->request, MPI_STATUS_IGNORE), "MPI_Wait");
        done = 1;
      } else {
        detail::check_mpi(MPI_Test(&u->request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      }
      if (!done) break;
      const int n = ctx_.world_size(), mine = static_cast<int>(u->shard_numel(ctx_.rank()));
      Tensor mean(Shape{mine});
      detail::sum_rows_in_rank_order(u->rows.data(), n, mine, mean.data());
      remat::detail::flat(mean) /= static_cast<float>(n);
      if (u->grads_fresh) remat::detail::flat(u->grads) = remat::detail::flat(mean);
      else remat::detail::flat(u->grads) += remat::detail::flat(mean);
      u->grads_fresh = false;
      u->flat_grads = u->rows = Tensor();
      ++done_count;
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done_count));
  }

  std::string describe() const {
    std::string s;
    for (std::size_t i = 0; i < params_.size(); ++i)
      s += fmt::format("parameter {} '{}' of shape {} in unit {}\n", i, names_[i], params_[i]->shape(), unit_of_[i]);
    return s;
  }

  Context& ctx_;
  nn::BlockStack& stack_;
  std::vector<Tensor*> params_;
  std::vector<std::string> names_;
  std::unordered_map<const void*, std::size_t> index_;  ///< autograd identity -> parameter
  std::vector<std::size_t> unit_of_;                    ///< per parameter
  std::vector<std::shared_ptr<const std::string>> away_;  ///< per parameter: the error a read meets while sharded
  std::vector<ShardedUnit> units_;
  std::vector<int> seen_, expected_;  ///< per parameter: contributions this step, and in the first
  bool step_started_ = false;
  int pinned_ = 0;  ///< FullParameters alive: nothing is released
  bool prefetch_;
  std::size_t max_in_flight_;
  std::vector<std::size_t> backward_order_, last_backward_order_;  ///< blocks gathered in backward, in order
  std::int64_t unused_prefetches_ = 0;
  ShardedMemory peak_;
  std::vector<ShardedUnit*> pending_;  ///< reductions in flight, in the order sent
  MPI_Comm gather_comm_ = MPI_COMM_NULL, reduce_comm_ = MPI_COMM_NULL;
};

}  // namespace remat::dist
