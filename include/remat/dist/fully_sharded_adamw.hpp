#pragma once
// dist::FullyShardedAdamW — the optimizer of ZeRO stage 3: AdamW on each rank's shards of a
// FullyShardedDataParallel's units. The shards hold both the parameters and the averaged gradients,
// so a step moves nothing between ranks except the root unit's new values: it stays whole, each
// rank updates its slice where it lies and gathers the others'. A block's new values reach the
// other ranks when the block is next gathered. AdamWStep's element-wise update does not care where
// a shard begins, so the weights are bitwise those of AdamW on the averaged gradients, on any
// number of ranks.
//
// As with ShardedAdamW, a parameter that took no gradient on any rank is updated with a zero
// gradient (AdamW would skip it).

#include <cstdint>
#include <vector>

#include "remat/dist/fully_sharded.hpp"
#include "remat/dist/sharded_adamw_base.hpp"

namespace remat::dist {

/// AdamW over the shards of a FullyShardedDataParallel (ZeRO stage 3): each rank holds 1/N of the
/// parameters, gradients and moments; the weights after each step are bitwise AdamW's.
class FullyShardedAdamW : public detail::ShardedAdamWBase {
 public:
  /// One group of all params, with opt.weight_decay.
  FullyShardedAdamW(FullyShardedDataParallel& fsdp, std::vector<Tensor*> params, optim::AdamWOptions opt = {})
      : FullyShardedAdamW(fsdp, std::vector<optim::ParamGroup>{optim::ParamGroup{std::move(params), opt.weight_decay}},
                          opt) {}
  /// Parameter groups, each with its own weight decay; opt.weight_decay is not used.
  FullyShardedAdamW(FullyShardedDataParallel& fsdp, std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt)
      : ShardedAdamWBase(fsdp.context(), fsdp.parameters(), fsdp.names(), std::move(groups), opt, "FullyShardedAdamW"),
        fsdp_(fsdp) {
    fsdp_.optimizer_ = this;  // its moments, in the wrapper's memory breakdowns
  }
  /// Destroy it before its wrapper (the reverse order of construction).
  ~FullyShardedAdamW() override {
    if (fsdp_.optimizer_ == this) fsdp_.optimizer_ = nullptr;
  }
  FullyShardedAdamW(const FullyShardedAdamW&) = delete;
  FullyShardedAdamW& operator=(const FullyShardedAdamW&) = delete;

  /// Updates this rank's shards (a collective: the root unit's new values are gathered).
  void step() override {
    no_grad guard;
    fsdp_.drop_prefetches();  // gathered from the shards about to change
    allocate();
    const optim::AdamWStep c(opt_, lr_, ++t_);
    const int rank = fsdp_.context().rank();
    for (std::size_t ui = 0; ui < fsdp_.units_.size(); ++ui) {
      ShardedUnit& u = fsdp_.units_[ui];
      const std::int64_t lo = u.shard_offset(rank), hi = lo + u.shard_numel(rank);
      detail::for_each_piece(u.entries, lo, hi, [&](const FlatEntry& e, std::int64_t from, std::int64_t to) {
        const optim::ParamGroup* g = group_of(e.param);
        if (!g) return;
        const std::int64_t at = from - lo;
        // The root's shard is its own slice of the whole parameters: updated where it lies.
        float* values = u.root ? fsdp_.params_[e.param]->data() + (from - e.offset) : u.params.data() + at;
        c.update(values, m_[ui].data() + at, v_[ui].data() + at, u.grads.data() + at, to - from,
                 c.decay(g->weight_decay));
      });
      u.grads_fresh = true;  // consumed: the next backward's reduction writes the shard
      u.stale = true;
    }
    fsdp_.gather(fsdp_.units_.back());  // the root stays whole
  }

  const char* kind() const override { return "FullyShardedAdamW"; }

 private:
  std::vector<Range> ranges() const override {
    std::vector<Range> out;
    for (const ShardedUnit& u : fsdp_.units()) out.push_back({&u.entries, u.numel, &u.shards});
    return out;
  }

  FullyShardedDataParallel& fsdp_;
};

}  // namespace remat::dist
