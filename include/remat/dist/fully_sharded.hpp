#pragma once
// dist::FullyShardedDataParallel — ZeRO stage 3, PyTorch's FSDP for remat: every rank runs the
// whole model on its share of the batch, but keeps only 1/N of each block's parameters. A block's
// parameters are all-gathered just before it runs and freed after, each parameter's gradient is
// reduce-scattered as soon as it is final, and dist::FullyShardedAdamW updates each rank's shard.
//
// Units: each block of the model's BlockStack is one unit (its parameters gathered and sharded
// together); everything else (embeddings, final norm, head) is the root unit, which stays whole —
// PyTorch's root FSDP unit keeps its parameters from forward to backward too — and has its
// gradients and optimizer state sharded (its shard of parameters is its slice of the whole ones).
//
// Why checkpointing gathers a block once in backward: the wrapper sits around each block inside
// whatever runs the stack (BlockStack::set_block_wrapper), so a checkpoint's segment and its replay
// both go through it. After a block's forward its parameters are freed unless a backward through
// that very graph follows (a replay inside backward that records one); then they stay until the
// block's gradients are final and no node reads them. A block whose forward was freed is gathered
// again by a node on its output whose backward runs before any of the block's own. So per-block
// checkpointing and no checkpointing both gather each block twice a step (forward, backward), not
// three times. A replay that records several blocks before reversing them (sqrt, uniform:k with
// k > 2, a checkpoint() around several blocks) keeps only the last one it recorded beside the one
// it runs: the others are freed as it goes on and gathered again by that node, so two blocks at
// most are here under every schedule, for k - 2 more gathers a replayed segment of k blocks.
// A parameter's Storage object stays the same throughout: nodes that saved it read the gathered
// bytes, and a read while it is sharded is an error naming the parameter and its unit.
//
// Why the gradients are one process's bits: each rank receives every other rank's copy of its piece
// of a parameter's gradient (all-to-all, sent from the .grad where it lies), adds them to its own
// in rank order and divides by N, as DataParallel does; AdamW's element-wise update does not care
// where a shard begins (optim::AdamWStep). A parameter's gradient is final when it has taken as
// many contributions as in the first step, which learns the counts; in it, a node recorded before a
// block's ops (so run after all of them in backward) reduces the block's gradients and frees it
// once it has run as often as the block ran forward. Reducing parameter by parameter rather than
// unit by unit keeps a unit's whole local gradient from waiting for its last parameter: what is in
// flight is one parameter.
//
// Why the model state stays within 16Ψ/N + two blocks (+ the root beyond its shard: its whole
// parameters, and its gradients until reduced): in backward a parameter whose gradient is final
// and which no node holds any more is freed at once, so a block shrinks as its backward proceeds
// (a block whose gradients are all final goes as a whole by the same rule: not while a node that
// saved one of its parameters is yet to run or running — a product hands its first operand its
// gradient before it reads that operand for the other's, so a gate written g * x gets the block's
// last gradient while its node still reads g), and the next block's prefetch starts only when it
// fits beside what is here and the largest gradient still to come. Every quantity that decision weighs comes from the graph and the sizes
// (whole parameters, gradients, saved records, the last reductions sent — never whether one has
// completed, nor who else holds a parameter on this rank), so every rank starts the same
// all-gathers in the same order. A parameter read in backward must be saved by the node reading
// it, as everywhere in remat (a closure holding it keeps its bytes on that rank; one holding only
// a pointer reads it sharded: an error naming it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/error.hpp"
#include "remat/core/factory.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/node.hpp"
#include "remat/core/observer.hpp"
#include "remat/dist/context.hpp"
#include "remat/dist/shard_reduction.hpp"
#include "remat/dist/sharded_adamw_base.hpp"
#include "remat/dist/sharded_unit.hpp"
#include "remat/nn/blocks.hpp"
#include "remat/nn/gpt.hpp"
#include "remat/nn/module.hpp"

namespace remat::dist {

/// How FullyShardedDataParallel starts.
struct FullyShardedOptions {
  /// Copy rank 0's parameters to every rank before sharding them.
  bool broadcast_parameters = true;
  /// Start the all-gather of the unit expected next while the current one runs: under a chain
  /// schedule (binomial, sqrt, uniform, budget) the block its plan runs next, forward or backward;
  /// otherwise the next block in forward and the one before in backward (the order autograd
  /// reverses a stack in, with or without per-block checkpointing). Nothing is traced: the order
  /// holds from the first step. Two units' parameters are then here at once.
  bool prefetch = true;
  /// Start a prefetch only once it fits: the blocks' parameters here, the prefetches in flight, the
  /// gradients not yet averaged into the shards and the largest one still to come stay within two
  /// of the largest block's parameters, the same on every rank. The model state then stays within
  /// 16Ψ/N + two blocks + the root's parameters beyond its shard; in backward the next block starts
  /// arriving once the current one has freed enough (its parameters are freed one by one as their
  /// gradients are final). False starts it as soon as the order names it and fits beside the
  /// blocks' parameters here and arriving (two blocks at most): more overlap, and up to one
  /// parameter's gradient and its reduction more.
  bool prefetch_within_two_units = true;
  /// Parameters whose gradient reduction may be in flight at once (each holds its local gradient
  /// and the other ranks' copies of this rank's piece of it). More overlap backward with
  /// communication; one keeps the model state closest to 16Ψ/N plus two gathered blocks.
  std::size_t reductions_in_flight = 1;
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
      : ctx_(ctx),
        stack_(stack),
        prefetch_(options.prefetch),
        within_two_units_(options.prefetch_within_two_units),
        max_in_flight_(options.reductions_in_flight) {
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
    reduced_.assign(params_.size(), 0);
    forward_runs_.assign(blocks.size() + 1, 0);
    reversed_.assign(blocks.size() + 1, 0);
    entry_of_.resize(params_.size());
    for (const ShardedUnit& u : units_)
      for (std::size_t k = 0; k < u.entries.size(); ++k) entry_of_[u.entries[k].param] = k;
    away_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i)
      away_[i] = std::make_shared<const std::string>(fmt::format(
          "FullyShardedDataParallel: parameter '{}' of {} is sharded: its values are gathered only while its unit "
          "runs forward or backward (read it inside full_parameters())", names_[i], units_[unit_of_[i]].name));
    // Gathers start in the order units run, reductions in the order gradients become final: two
    // orders that interleave differently on each rank, hence two communicators.
    detail::check_mpi(MPI_Comm_dup(ctx_.comm(), &gather_comm_), "MPI_Comm_dup");
    stack_.set_block_wrapper([this](std::size_t i, nn::Block f) -> nn::Block {
      REMAT_CHECK(i + 1 < units_.size(), "FullyShardedDataParallel: the model runs block {}, the wrapper knows {} "
                  "blocks", i, units_.size() - 1);
      return [this, i, f = std::move(f)](const Tensor& x) { return run_unit(i, f, x); };
    });
    const int rank = ctx_.rank(), n = ctx_.world_size();
    reduction_bytes_.resize(params_.size());
    own_refs_.resize(params_.size());
    pieces_.resize(params_.size());
    done_with_.assign(params_.size(), 0);
    for (ShardedUnit& u : units_) {
      u.shards = ShardLayout(u.numel, n);
      const std::int64_t mine = u.shard_numel(rank);
      if (!u.root) u.params = Tensor(Shape{mine});
      if (!u.root) two_blocks_ = std::max(two_blocks_, 2 * static_cast<std::size_t>(u.numel) * sizeof(float));
      for (const ShardedUnit::Entry& e : u.entries) {
        Pieces& pc = pieces_[e.param];
        pc.counts.resize(static_cast<std::size_t>(n));
        pc.offsets.resize(static_cast<std::size_t>(n));
        for (int q = 0; q < n; ++q) {
          const auto [from, to] = detail::overlap(e, u.shard_offset(q), u.shard_offset(q) + u.shard_numel(q));
          pc.counts[static_cast<std::size_t>(q)] = static_cast<int>(to - from);
          pc.offsets[static_cast<std::size_t>(q)] = to > from ? static_cast<int>(from - e.offset) : 0;
        }
        // Its local gradient and the other ranks' copies of the widest piece: the same on every rank.
        const int widest = *std::max_element(pc.counts.begin(), pc.counts.end());
        reduction_bytes_[e.param] = sizeof(float) * static_cast<std::size_t>(e.numel + std::int64_t{n - 1} * widest);
        own_refs_[e.param] = params_[e.param]->storage().use_count();
      }
      u.grads = Tensor(Shape{mine});
      remat::detail::flat(u.grads).setZero();
      take_back(u);
      u.gathered = true;
      release(u);
    }
    // Last: no MPI call follows the gather communicator's duplicate above (so every rank makes
    // the same calls in the same order), and a constructor that throws before here frees nothing
    // collectively on one rank alone.
    reductions_.emplace(ctx_, max_in_flight_);
  }

  /// A GPT: one unit per Transformer block; embeddings, final norm and head are the root.
  FullyShardedDataParallel(Context& ctx, nn::GPT& gpt, FullyShardedOptions options = {})
      : FullyShardedDataParallel(ctx, gpt, gpt, block_modules(gpt), options) {}

  /// Gathers the parameters back, so the model is whole again (unless an exception is unwinding:
  /// the other ranks may not be here to gather with).
  ~FullyShardedDataParallel() override {
    stack_.set_block_wrapper({});
    reductions_->abandon();
    for (ShardedUnit& u : units_) {
      MPI_Waitall(static_cast<int>(u.ahead_requests.size()), u.ahead_requests.data(), MPI_STATUSES_IGNORE);
      u.ahead.clear();
      u.ahead_requests.clear();
    }
    if (std::uncaught_exceptions() == 0) {
      try {
        for (ShardedUnit& u : units_) gather(u);
      } catch (...) {
      }
    }
    MPI_Comm_free(&gather_comm_);
    reductions_.reset();
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
  /// The bytes by kind when the model state (ShardedMemory::model_state) peaked, over the same time.
  const ShardedMemory& peak_model_state() const { return peak_state_; }
  /// Starts measuring peak_memory() and peak_model_state() afresh.
  void reset_peak_memory() { peak_ = peak_state_ = ShardedMemory{}; }

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

  using Pieces = detail::Pieces;

  static std::vector<nn::Module*> block_modules(nn::GPT& gpt) {
    std::vector<nn::Module*> out;
    for (const auto& b : gpt.h) out.push_back(b.get());
    return out;
  }

  // Block i: gathered around its forward, and again before its backward if freed meanwhile.
  Tensor run_unit(std::size_t i, const nn::Block& f, const Tensor& x) {
    const remat::detail::Session& s = remat::detail::session();
    const bool backward_follows = s.backward_depth > 0 && s.recording && s.grad_enabled;
    if (s.backward_depth > 0) let_go_kept(i);
    gather(units_[i]);
    Tensor y = f(expected_.empty() ? mark_block_start(i, x) : x);
    if (!backward_follows) release(units_[i]);
    else if (pinned_ == 0) units_[i].kept = ++kept_serial_;  // for its backward, which follows later
    if (!remat::detail::grad_needed(y)) return y;
    // y's data under a new node whose backward, the first of the block's, gathers the block.
    Tensor out(y.storage(), y.shape());
    remat::detail::record<float>("fsdp_gather", {y}, {&out}, {}, [this, i](remat::detail::BackwardContext<float>& ctx) {
      ShardedUnit& u = units_[i];
      u.kept = 0;  // its backward begins: here until its gradients are final and nothing reads it
      u.retained = ctx.retain_graph();
      const bool here = u.gathered && !u.stale && !u.partly;
      gather(u);
      if (here) prefetch_after(i);  // kept since its forward: ask for what the schedule needs after it
      ctx.accumulate(0, Tensor(ctx.grad_output().storage(), ctx.grad_output().shape()));
    });
    return out;
  }

  // Before block i runs forward inside backward: of the blocks kept for a backward not begun (a
  // replay records several before reversing them), the one kept last stays and the others go, so
  // that with block i two blocks at most are here. Each is gathered again by the node on its
  // output, whose backward runs before any of its own: a replayed segment of k > 2 blocks costs
  // k - 2 gathers more, and its last two reverse without one. Decided from the graph's order alone
  // (the same on every rank).
  void let_go_kept(std::size_t i) {
    std::uint64_t newest = 0;
    for (std::size_t k = 0; k < units_.size(); ++k)
      if (k != i) newest = std::max(newest, units_[k].kept);
    for (std::size_t k = 0; k < units_.size(); ++k)
      if (k != i && units_[k].kept != 0 && units_[k].kept != newest) release(units_[k]);
  }

  // The first step, before the counts are known: x's data under a node recorded before any of the
  // block's ops, so backward (walking the tape in reverse) runs it after all of them. Once it has
  // run as often as the block ran forward with grad enabled (a model run twice before one
  // backward has two), every gradient of the block is final: block_done reduces them and frees
  // the block. A block whose count is never reached is reduced at the step's end.
  Tensor mark_block_start(std::size_t i, const Tensor& x) {
    const remat::detail::Session& s = remat::detail::session();
    if (s.backward_depth == 0 && s.grad_enabled) ++forward_runs_[i];
    if (!remat::detail::grad_needed(x)) return x;
    Tensor out(x.storage(), x.shape());
    remat::detail::record<float>("fsdp_block_done", {x}, {&out}, {}, [this, i](remat::detail::BackwardContext<float>& ctx) {
      units_[i].retained = ctx.retain_graph();
      block_done(i);
      ctx.accumulate(0, Tensor(ctx.grad_output().storage(), ctx.grad_output().shape()));
    });
    return out;
  }
  void block_done(std::size_t i) {
    const remat::detail::Session& s = remat::detail::session();
    // Not in later steps (the counts decide), a planner's dry run, or remat::grad() (leaf
    // gradients go to its caller, not to .grad).
    if (!expected_.empty() || s.dry_run_first_node != 0 || s.grad_capture != nullptr) return;
    if (++reversed_[i] < forward_runs_[i]) return;
    if (!step_started_) start_step();
    for (const ShardedUnit::Entry& e : units_[i].entries)
      if (!reduced_[e.param]) reduce(e.param);
    release_when_unread(units_[i]);
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
  // nodes that saved them read the gathered bytes). Each parameter is all-gathered straight into
  // the bytes it will own: no flat buffer beside them, so gathering costs the unit's size once.
  void gather(ShardedUnit& u) {
    release_unread();  // first, so that what is done with makes room
    u.release_waiting = false;  // needed again: it goes with the step, or when its gradients are final again
    if (u.gathered && !u.stale && !u.partly) return;
    const auto which = static_cast<std::int64_t>(&u - units_.data());
    if (deferred_ == which) deferred_ = -1;  // needed now: no longer ahead
    if (!u.ahead.empty()) {
      REMAT_ASSERT(u.ahead.size() == u.entries.size() && u.ahead_requests.size() == u.entries.size());
      detail::check_mpi(MPI_Waitall(static_cast<int>(u.ahead_requests.size()), u.ahead_requests.data(),
                                    MPI_STATUSES_IGNORE), "MPI_Waitall");
      for (std::size_t k = 0; k < u.entries.size(); ++k) {
        remat::detail::Storage& st = *params_[u.entries[k].param]->storage();
        if (st.resident()) std::copy_n(static_cast<const char*>(u.ahead[k]->raw_data()), st.bytes(), static_cast<char*>(st.raw_data()));
        else st.adopt(*u.ahead[k]);
      }
      u.ahead.clear();
      u.ahead_requests.clear();
      ++u.prefetched;
    } else {
      for (const ShardedUnit::Entry& e : u.entries) {
        remat::detail::Storage& st = *params_[e.param]->storage();
        if (!st.resident()) {
          remat::detail::Storage fresh(st.bytes());
          st.adopt(fresh);
        }
        gather_parameter(u, e, static_cast<float*>(st.raw_data()), nullptr);
      }
    }
    for (const ShardedUnit::Entry& e : u.entries)
      if (u.stale) params_[e.param]->storage()->bump_version();  // new values: a graph recorded before the step may not read them
    u.stale = false;
    u.gathered = true;
    u.partly = false;
    for (const ShardedUnit::Entry& e : u.entries) done_with_[e.param] = 0;
    ++u.gathers;
    sample_memory();
    if (!u.root) prefetch_after(static_cast<std::size_t>(which));
  }

  // Parameter `e` of `u` from every rank's shard into `to` (its whole length): blocking, or started
  // under `request`. The root sends its piece from where it lies in `to` (its whole parameters).
  void gather_parameter(const ShardedUnit& u, const ShardedUnit::Entry& e, float* to, MPI_Request* request) {
    const Pieces& pc = pieces_[e.param];
    const int me = ctx_.rank();
    const auto mine = pc.counts[static_cast<std::size_t>(me)];
    static const float nothing = 0;  // what a rank holding none of it sends from
    const void* send = MPI_IN_PLACE;
    if (!u.root)
      send = mine > 0 ? u.params.data() + (e.offset + pc.offsets[static_cast<std::size_t>(me)] - u.shard_offset(me)) : &nothing;
    if (request)
      detail::check_mpi(MPI_Iallgatherv(send, mine, MPI_FLOAT, to, pc.counts.data(), pc.offsets.data(), MPI_FLOAT,
                                        gather_comm_, request), "MPI_Iallgatherv");
    else
      detail::check_mpi(MPI_Allgatherv(send, mine, MPI_FLOAT, to, pc.counts.data(), pc.offsets.data(), MPI_FLOAT,
                                       gather_comm_), "MPI_Allgatherv");
  }

  // Block i was just gathered: ask for the one expected next (started now, or once it fits). A chain's steps are the
  // stack's blocks in order, so the step its plan needs next is a block at the same distance.
  void prefetch_after(std::size_t i) {
    if (!prefetch_) return;
    const remat::detail::Session& s = remat::detail::session();
    const remat::detail::ChainPosition& at = s.chain_position;
    const auto here = static_cast<std::int64_t>(i);
    std::int64_t next = here + 1;
    if (at.chain != nullptr) next = at.next < 0 ? -1 : here + (at.next - at.step);
    else if (s.backward_depth > 0) next = here - 1;
    else if (pinned_ > 0) next = -1;  // FullParameters gathers every unit anyway
    if (next < 0 || next >= static_cast<std::int64_t>(units_.size()) - 1) return;
    deferred_ = next;
    start_deferred_prefetch();
  }

  // Starts the prefetch asked for, unless its unit is here or on its way already, or (within two
  // units) it does not fit yet: then ops and backward ops try again, on every rank at the same one,
  // since every quantity weighed is the same on every rank.
  void start_deferred_prefetch() {
    if (deferred_ < 0) return;
    ShardedUnit& n = units_[static_cast<std::size_t>(deferred_)];
    if ((n.gathered && !n.stale && !n.partly) || !n.ahead.empty()) {
      deferred_ = -1;
      return;
    }
    const std::size_t incoming = static_cast<std::size_t>(n.numel) * sizeof(float);
    if ((within_two_units_ ? working_set_bytes() : parameter_bytes_here()) + incoming > two_blocks_) return;
    deferred_ = -1;
    // Every buffer first: an allocation that throws leaves nothing started.
    std::vector<std::unique_ptr<remat::detail::Storage>> landing;
    for (const ShardedUnit::Entry& e : n.entries)
      landing.push_back(std::make_unique<remat::detail::Storage>(params_[e.param]->storage()->bytes()));
    n.ahead = std::move(landing);
    n.ahead_requests.assign(n.entries.size(), MPI_REQUEST_NULL);
    for (std::size_t k = 0; k < n.entries.size(); ++k)
      gather_parameter(n, n.entries[k], static_cast<float*>(n.ahead[k]->raw_data()), &n.ahead_requests[k]);
    sample_memory();
  }

  // Lets prefetches in flight move on (MPI progresses a non-blocking collective inside its calls).
  void progress_prefetches() {
    for (ShardedUnit& u : units_)
      if (!u.ahead_requests.empty()) {
        int done = 0;
        detail::check_mpi(MPI_Testall(static_cast<int>(u.ahead_requests.size()), u.ahead_requests.data(), &done,
                                      MPI_STATUSES_IGNORE), "MPI_Testall");
      }
  }

  // Prefetches nobody used (the shards are about to change, or the order was not the expected
  // one): completed on every rank alike, then dropped.
  void drop_prefetches() {
    deferred_ = -1;
    for (ShardedUnit& u : units_)
      if (!u.ahead.empty()) {
        detail::check_mpi(MPI_Waitall(static_cast<int>(u.ahead_requests.size()), u.ahead_requests.data(),
                                      MPI_STATUSES_IGNORE), "MPI_Waitall");
        u.ahead.clear();
        u.ahead_requests.clear();
        ++unused_prefetches_;
      }
  }

  // This rank's slice of the unit's whole parameters into its shard (the root's whole parameters
  // are its shard).
  void take_back(ShardedUnit& u) {
    if (u.root) return;
    const std::int64_t lo = u.shard_offset(ctx_.rank());
    detail::for_each_piece(u.entries, lo, lo + u.params.numel(), [&](const ShardedUnit::Entry& e, std::int64_t from, std::int64_t to) {
      const float* w = params_[e.param]->data() + (from - e.offset);
      std::copy(w, w + (to - from), u.params.data() + (from - lo));
    });
  }

  void release(ShardedUnit& u) {
    if (u.root || !u.gathered || pinned_ > 0) return;
    for (const ShardedUnit::Entry& e : u.entries) {
      params_[e.param]->storage()->discard(away_[e.param]);
      done_with_[e.param] = 0;
    }
    u.gathered = false;
    u.partly = false;
    u.release_waiting = false;
    u.kept = 0;
  }

  // Every gradient of u is final: its parameters go once no node of the walk can still read
  // them — none of the saved records the graph's nodes hold holds any of them (the node that
  // handed out the last gradient among them: a product's backward hands its first operand its
  // gradient before it reads that operand for the other's). The same criterion frees a parameter
  // alone (free_finished_parameters); both come from the graph, the same on every rank. Until then
  // it waits, and is tried again before every op, backward op and gather, and when a walk ends. In
  // a walk that retains the graph, the nodes that ran keep what they saved for a later walk (which
  // gathers the block again before any of them): there it waits only for the node running, until
  // the next backward op or the walk's end (`node_done`).
  void release_when_unread(ShardedUnit& u, bool node_done = false) {
    if (u.root || !u.gathered || pinned_ > 0) return;
    if (!(u.retained && node_done))
      for (const ShardedUnit::Entry& e : u.entries)
        if (params_[e.param]->storage()->saved_refs() > 0) {
          if (!u.release_waiting) ++releases_waiting_;
          u.release_waiting = true;
          return;
        }
    release(u);
  }
  void release_unread(bool node_done = false) {
    if (releases_waiting_ == 0) return;
    releases_waiting_ = 0;
    for (ShardedUnit& u : units_)
      if (u.release_waiting) {
        u.release_waiting = false;
        release_when_unread(u, node_done);
      }
  }

  // Before each backward op (the previous one has run and let go of what it saved): a block's
  // parameter whose gradient is final and which no node holds any more is freed now rather than
  // with its block, making room for the next block while this one's backward goes on.
  // Whether it is done with is decided from the graph alone (gradient final, no saved record
  // holds it), the same on every rank; the bytes go only if nothing else on this rank holds the
  // storage either (else they stay, and the next gather writes the same values over them).
  void free_finished_parameters() {
    for (auto it = finished_.begin(); it != finished_.end();) {
      ShardedUnit& u = units_[unit_of_[*it]];
      const std::shared_ptr<remat::detail::Storage>& st = params_[*it]->storage();
      if (u.gathered && pinned_ == 0 && st->saved_refs() > 0) {
        ++it;
        continue;
      }
      if (u.gathered && pinned_ == 0) {
        done_with_[*it] = 1;
        u.partly = true;
        if (st.use_count() <= own_refs_[*it]) st->discard(away_[*it]);
      }
      it = finished_.erase(it);
    }
  }

  // What a prefetch must fit beside, from quantities the same on every rank: the blocks'
  // parameters here (done-with ones apart), prefetches in flight, the blocks' gradients not yet sent
  // and their reductions that may still be in flight (the last ones sent, completed or not); and in
  // backward, what the blocks' gradients still to come may add before a parameter is freed: as
  // many reductions as may be in flight, of the largest, and the next gradient beside them (a
  // linear layer's bias arrives while its weight's reduction runs) — or in the first step, which
  // reduces a block's gradients together at its end, all of them. The root's gradients are not
  // weighed: a tied embedding's waits from the head's backward to the embedding's, whatever the
  // blocks do, and would stop every prefetch of a model with a large vocabulary.
  std::size_t working_set_bytes() {
    std::size_t bytes = 0, to_come = 0, next_gradient = 0;
    reserve_.clear();
    const bool backward = remat::detail::session().backward_depth > 0;
    for (const ShardedUnit& u : units_) {
      if (u.root) continue;
      bytes += u.ahead_bytes();
      if (!u.gathered) continue;
      for (const FlatEntry& e : u.entries) {
        const Tensor* p = params_[e.param];
        if (done_with_[e.param]) continue;
        bytes += p->nbytes();
        if (p->grad().defined()) bytes += p->grad().nbytes();
        if (backward && !reduced_[e.param]) {
          reserve_.push_back(reduction_bytes_[e.param]);
          if (!p->grad().defined()) {
            to_come += p->nbytes();
            next_gradient = std::max(next_gradient, p->nbytes());
          }
        }
      }
    }
    for (std::size_t i : reductions_->last_sent())
      if (!units_[unit_of_[i]].root) bytes += reduction_bytes_[i];
    const std::size_t k = std::min(max_in_flight_, reserve_.size());
    std::partial_sort(reserve_.begin(), reserve_.begin() + static_cast<std::ptrdiff_t>(k), reserve_.end(),
                      std::greater<>());
    for (std::size_t j = 0; j < k; ++j) bytes += reserve_[j];
    return bytes + (expected_.empty() ? to_come : next_gradient);
  }

  // What a prefetch that does not wait for the gradients (prefetch_within_two_units false) must
  // fit beside within two blocks: the blocks' parameters here (done-with ones apart) and arriving.
  // So two blocks' parameters at most are here then too (a block kept from a replay's forward for
  // its backward, and the one running, leave no room for a third).
  std::size_t parameter_bytes_here() const {
    std::size_t bytes = 0;
    for (const ShardedUnit& u : units_) {
      if (u.root) continue;
      bytes += u.ahead_bytes();
      if (!u.gathered) continue;
      for (const FlatEntry& e : u.entries)
        if (!done_with_[e.param]) bytes += params_[e.param]->nbytes();
    }
    return bytes;
  }

  // Observer: ops and backward ops move the collectives in flight on (MPI progresses a
  // non-blocking collective only inside its calls), and a finished reduction frees its buffers.
  void op_begin(const OpOutput&) override {
    progress_in_flight();
    release_unread();
    start_deferred_prefetch();
    sample_memory();
  }
  void backward_op(const char*) override {
    progress_in_flight();
    release_unread(true);  // the node before has run
    free_finished_parameters();
    start_deferred_prefetch();
    sample_memory();
  }

  // The breakdown, kept when live bytes or the model state are at a new peak.
  void sample_memory() {
    const MemoryStats now = memory_stats();
    ShardedMemory m;
    m.live = now.live_bytes;
    m.activations = now.saved_activation_bytes;
    for (const ShardedUnit& u : units_) {
      if (!u.root) m.parameters += u.params.nbytes();
      m.gradients += u.grads.nbytes();
      m.gathered += u.ahead_bytes();
      for (const FlatEntry& e : u.entries) {
        const Tensor* p = params_[e.param];
        if (u.gathered && p->storage()->resident()) (u.root ? m.parameters : m.gathered) += p->nbytes();
        if (!p->grad().defined()) continue;
        m.gradients += p->grad().nbytes();
        if (u.root) m.root_gradients += p->grad().nbytes();
      }
    }
    for (const detail::ShardReductions::Reduction& r : reductions_->pending()) {
      const std::size_t bytes = r.local.nbytes() + (r.rows.defined() ? r.rows.nbytes() : 0);
      m.gradients += bytes;
      if (units_[unit_of_[r.param]].root) m.root_gradients += bytes;
    }
    if (optimizer_) m.optimizer = optimizer_->state_bytes();
    if (m.live > peak_.live) peak_ = m;
    if (m.model_state() > peak_state_.model_state()) peak_state_ = m;
  }
  void progress_in_flight() {
    if (prefetch_) progress_prefetches();
    if (!reductions_->pending().empty()) reductions_->progress(reductions_->pending().size());
  }

  // Observer: a parameter's gradient took a contribution.
  void leaf_grad(const void* leaf) override {
    auto it = index_.find(leaf);
    if (it == index_.end()) return;
    const std::size_t i = it->second;
    if (!step_started_) start_step();
    ++seen_[i];
    sample_memory();  // its .grad is here: a moment the model state may peak at
    ShardedUnit& u = units_[unit_of_[i]];
    REMAT_CHECK(!reduced_[i] || !expected_.empty(), "FullyShardedDataParallel: parameter '{}' of {} took a gradient "
                "after the backward of its block ended (its gradient was reduced then): a block's parameters must be "
                "used inside the block only", names_[i], u.name);
    if (expected_.empty()) return;  // the first step learns the counts
    REMAT_CHECK(!reduced_[i], "FullyShardedDataParallel: parameter '{}' of {} took a gradient after its gradient was "
                "reduced: it took {} contribution(s) in the first step and {} in this one. The graph must use each "
                "parameter as often in every step", names_[i], u.name, expected_[i], seen_[i]);
    if (seen_[i] != expected_[i]) return;
    reduce(i);
    if (!u.root) finished_.push_back(i);
    // Every gradient of the unit final: its parameters go once no node reads them (the one
    // running may: this gradient is handed out from inside its backward).
    if (--u.waiting == 0) release_when_unread(u);
  }

  std::string refuses_higher_order() const override {
    return "FullyShardedDataParallel reduce-scatters first-order gradients across ranks; the graph create_graph "
           "records and the tangents hvp carries would not be reduced (each rank would differentiate its own share "
           "alone)";
  }
  void backward_end(bool completed, bool outermost) override {
    release_unread(true);    // the walk's nodes have run (and let go of what they saved, unless retained)
    if (!outermost) return;  // a dry run inside a backward is not the step's end
    drop_prefetches();
    finished_.clear();
    for (ShardedUnit& u : units_) u.kept = 0;
    std::fill(forward_runs_.begin(), forward_runs_.end(), 0);
    std::fill(reversed_.begin(), reversed_.end(), 0);
    if (!step_started_) return;
    if (!completed) {
      // Keep the communicators consistent: what was sent completes, and nothing more is added (the
      // reductions that completed during it are in the shards; their .grad is gone).
      reductions_->abandon();
      end_step();
      return;
    }
    if (expected_.empty()) expected_ = seen_;
    for (const ShardedUnit& u : units_)
      for (const ShardedUnit::Entry& e : u.entries)
        if (!reduced_[e.param]) reduce(e.param);
    reductions_->progress(0);
    for (ShardedUnit& u : units_) {
      u.grads_fresh = false;  // a further backward before the optimizer's step adds to the shard
      release(u);
    }
    end_step();
  }

  void start_step() {
    step_started_ = true;
    std::fill(reduced_.begin(), reduced_.end(), 0);
    for (ShardedUnit& u : units_) {
      u.waiting = 0;
      if (!expected_.empty())
        for (const ShardedUnit::Entry& e : u.entries) u.waiting += expected_[e.param] > 0 ? 1 : 0;
    }
  }
  void end_step() {
    reductions_->forget_sent();  // every reduction has completed
    std::fill(seen_.begin(), seen_.end(), 0);
    step_started_ = false;
  }

  // Parameter i's local gradient leaves its .grad (zeros if it has none) and is sent from where it
  // lies: to each rank the piece of it in that rank's shard; this rank's own piece stays.
  void reduce(std::size_t i) {
    ShardedUnit& u = units_[unit_of_[i]];
    const ShardedUnit::Entry& e = u.entries[entry_of_[i]];
    Tensor* p = params_[i];
    reductions_->make_room();  // at most reductions_in_flight hold buffers at any moment
    Tensor local = p->grad().defined() ? p->grad() : zeros(Shape{e.numel});
    REMAT_ASSERT(local.numel() == e.numel);
    p->meta()->grad = Tensor();
    const Pieces& pc = pieces_[i];
    const int me = ctx_.rank();
    const auto mine = static_cast<std::size_t>(me);
    float* into = nullptr;  // where this rank's piece averages to in its shard, if it holds one
    if (pc.counts[mine] > 0) into = u.grads.data() + (e.offset + pc.offsets[mine] - u.shard_offset(me));
    reductions_->send(i, std::move(local), pc, into, u.grads_fresh);
    reduced_[i] = 1;
    ++u.reductions;
    reductions_->poll();
    sample_memory();
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
  std::vector<char> reduced_;         ///< per parameter: its reduction this step has started
  std::vector<std::size_t> entry_of_;  ///< per parameter: its place in its unit's entries
  std::vector<int> forward_runs_, reversed_;  ///< per unit, in the first step: forward runs, block_done calls
  bool step_started_ = false;
  int pinned_ = 0;  ///< FullParameters alive: nothing is released
  bool prefetch_;
  bool within_two_units_;
  std::size_t max_in_flight_;
  std::size_t two_blocks_ = 0;                 ///< twice the largest block's parameter bytes
  std::vector<std::size_t> reduction_bytes_;   ///< per parameter: the most its reduction holds on any rank
  std::vector<Pieces> pieces_;                 ///< per parameter: its pieces in each rank's shard
  std::vector<long> own_refs_;                 ///< per parameter: holders of its storage outside any graph
  std::vector<std::size_t> finished_;          ///< block parameters reduced this backward, not yet freed
  std::vector<char> done_with_;                ///< per parameter: freed one by one (on every rank alike)
  std::size_t releases_waiting_ = 0;           ///< units whose release waits for nodes that read them (a bound)
  std::uint64_t kept_serial_ = 0;              ///< the last ShardedUnit::kept given
  std::int64_t deferred_ = -1;                 ///< a unit whose prefetch waits for room (-1: none)
  std::vector<std::size_t> reserve_;           ///< working_set_bytes()'s scratch, kept to spare an allocation per op
  std::int64_t unused_prefetches_ = 0;
  ShardedMemory peak_, peak_state_;
  const detail::ShardedAdamWBase* optimizer_ = nullptr;  ///< the FullyShardedAdamW on this wrapper, while it lives
  std::optional<detail::ShardReductions> reductions_;  ///< gradients in flight to the shards (own communicator)
  MPI_Comm gather_comm_ = MPI_COMM_NULL;
};

}  // namespace remat::dist
