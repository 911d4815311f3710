#pragma once
// dist::ShardedAdamW — ZeRO stage 1: AdamW whose moment buffers are split across ranks. With a
// DataParallel built with shard_gradients, backward leaves each rank the average of its shard of
// every bucket (reduce-scatter); step() updates the parameters' elements in that shard with
// AdamWStep, the same element-wise code AdamW runs, and all-gathers the updated elements. So the
// weights after each step are bitwise those of AdamW on the averaged gradients, and each rank holds
// 1/N of the optimizer state.
//
// One difference from AdamW: a parameter that took no gradient on any rank is skipped by AdamW;
// here its shard holds zeros and it is updated with a zero gradient (weight decay and moments move).

#include <cstdint>
#include <vector>

#include "remat/dist/data_parallel.hpp"
#include "remat/dist/sharded_adamw_base.hpp"

namespace remat::dist {

/// ZeRO stage 1: AdamW whose moment buffers are split across the ranks of a DataParallel built
/// with shard_gradients; the weights after each step are bitwise those of AdamW on the averaged
/// gradients.
class ShardedAdamW : public detail::ShardedAdamWBase {
 public:
  /// One group of all params (ddp's parameters), with opt.weight_decay.
  ShardedAdamW(DataParallel& ddp, std::vector<Tensor*> params, optim::AdamWOptions opt = {})
      : ShardedAdamW(ddp, std::vector<optim::ParamGroup>{optim::ParamGroup{std::move(params), opt.weight_decay}}, opt) {}
  /// Parameter groups, each with its own weight decay; opt.weight_decay is not used.
  ShardedAdamW(DataParallel& ddp, std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt)
      : ShardedAdamWBase(ddp.context(), ddp.parameters(), ddp.names(), std::move(groups), opt, "ShardedAdamW"),
        ddp_(ddp) {
    REMAT_CHECK(ddp.options().shard_gradients, "ShardedAdamW: the DataParallel must be built with shard_gradients = "
                                               "true (it then leaves each rank its shard of the averaged gradients)");
  }

  void step() override {
    REMAT_CHECK(!ddp_.buckets().empty(), "ShardedAdamW::step: no synchronised backward has run yet (the gradients "
                                         "are reduced by the DataParallel's first backward)");
    no_grad guard;
    allocate();
    const optim::AdamWStep c(opt_, lr_, ++t_);
    const int rank = ddp_.context().rank();
    std::vector<Bucket>& buckets = ddp_.buckets_;
    std::vector<MPI_Request> requests(buckets.size(), MPI_REQUEST_NULL);
    for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
      Bucket& b = buckets[bi];
      const std::int64_t lo = b.shard_offset(rank), hi = lo + b.shard_numel(rank);
      float* out = b.shard.data();  // the gradient shard is consumed: it now carries the new weights
      detail::for_each_piece(b.entries, lo, hi, [&](const FlatEntry& e, std::int64_t from, std::int64_t to) {
        float* w = ddp_.params_[e.param]->data() + (from - e.offset);
        if (const optim::ParamGroup* g = group_of(e.param))
          c.update(w, m_[bi].data() + (from - lo), v_[bi].data() + (from - lo), out + (from - lo), to - from,
                   c.decay(g->weight_decay));
        std::copy(w, w + (to - from), out + (from - lo));
      });
      detail::check_mpi(MPI_Iallgatherv(out, static_cast<int>(b.shard.size()), MPI_FLOAT, b.flat.data(),
                                        b.shards.counts.data(), b.shards.offsets.data(), MPI_FLOAT,
                                        ddp_.context().comm(), &requests[bi]),
                        "MPI_Iallgatherv");
    }
    for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
      detail::check_mpi(MPI_Wait(&requests[bi], MPI_STATUS_IGNORE), "MPI_Wait");
      for (const Bucket::Entry& e : buckets[bi].entries)
        std::copy(buckets[bi].flat.data() + e.offset, buckets[bi].flat.data() + e.offset + e.numel,
                  ddp_.params_[e.param]->data());
    }
  }

  const char* kind() const override { return "ShardedAdamW"; }

 private:
  std::vector<Range> ranges() const override {
    std::vector<Range> out;
    for (const Bucket& b : ddp_.buckets()) out.push_back({&b.entries, b.numel, &b.shards});
    return out;
  }

  DataParallel& ddp_;
};

}  // namespace remat::dist
