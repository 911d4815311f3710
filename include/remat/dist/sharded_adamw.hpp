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

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "remat/dist/context.hpp"
#include "remat/dist/data_parallel.hpp"
#include "remat/optim/adamw.hpp"

namespace remat::dist {

/// ZeRO stage 1: AdamW whose moment buffers are split across the ranks of a DataParallel built
/// with shard_gradients; the weights after each step are bitwise those of AdamW on the averaged
/// gradients.
class ShardedAdamW : public optim::Optimizer {
 public:
  /// One group of all params (ddp's parameters), with opt.weight_decay.
  ShardedAdamW(DataParallel& ddp, std::vector<Tensor*> params, optim::AdamWOptions opt = {})
      : ShardedAdamW(ddp, std::vector<optim::ParamGroup>{optim::ParamGroup{std::move(params), opt.weight_decay}}, opt) {}
  /// Parameter groups, each with its own weight decay; opt.weight_decay is not used.
  ShardedAdamW(DataParallel& ddp, std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt)
      : Optimizer(std::move(groups), opt.lr), ddp_(ddp), opt_(opt) {
    REMAT_CHECK(ddp.options().shard_gradients, "ShardedAdamW: the DataParallel must be built with shard_gradients = "
                                               "true (it then leaves each rank its shard of the averaged gradients)");
    // Validates betas and eps exactly as AdamW does.
    optim::AdamW check(std::vector<Tensor*>{}, opt);
    (void)check;
    group_of_.assign(ddp.parameters().size(), -1);
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (Tensor* p : groups_[g].params) {
        const std::size_t i = position_of(p);
        // A tied weight may be listed twice (two names, one tensor): once per group is fine.
        REMAT_CHECK(group_of_[i] < 0 || group_of_[i] == static_cast<int>(g), "ShardedAdamW: parameter '{}' is in "
                    "two groups", ddp.names()[i]);
        group_of_[i] = static_cast<int>(g);
      }
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
      for_each_piece(b, lo, hi, [&](const Bucket::Entry& e, std::int64_t from, std::int64_t to) {
        float* w = ddp_.params_[e.param]->data() + (from - e.offset);
        if (const int g = group_of_[e.param]; g >= 0)
          c.update(w, m_[bi].data() + (from - lo), v_[bi].data() + (from - lo), out + (from - lo), to - from,
                   c.decay(groups_[static_cast<std::size_t>(g)].weight_decay));
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

  /// The number of steps taken (t in the bias corrections).
  std::int64_t steps() const { return t_; }
  const char* kind() const override { return "ShardedAdamW"; }
  /// Bytes of optimizer state this rank holds (both moments of its shards).
  std::size_t state_bytes() const {
    std::size_t n = 0;
    for (std::size_t b = 0; b < m_.size(); ++b) n += (m_[b].size() + v_[b].size()) * sizeof(float);
    return n;
  }

 private:
  // The DataParallel's index of `p`, matched by autograd identity (a tied weight has two Tensor
  // objects and one identity).
  std::size_t position_of(const Tensor* p) const {
    const std::vector<Tensor*>& params = ddp_.parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i]->meta() == p->meta()) return i;
    throw Error(fmt::format("ShardedAdamW: a parameter of shape {} is not one of the DataParallel's parameters",
                            p->shape()));
  }

  // Calls f(entry, from, to) for each parameter's part of the bucket range [lo, hi).
  template <class F>
  static void for_each_piece(const Bucket& b, std::int64_t lo, std::int64_t hi, F&& f) {
    for (const Bucket::Entry& e : b.entries) {
      const std::int64_t from = std::max(lo, e.offset), to = std::min(hi, e.offset + e.numel);
      if (from < to) f(e, from, to);
    }
  }

  void allocate() {
    if (!m_.empty()) return;
    const int rank = ddp_.context().rank();
    for (const Bucket& b : ddp_.buckets()) {
      m_.emplace_back(static_cast<std::size_t>(b.shard_numel(rank)), 0.0f);
      v_.emplace_back(static_cast<std::size_t>(b.shard_numel(rank)), 0.0f);
      // Moments loaded before the buckets existed: take this rank's slice of them.
      const std::int64_t lo = b.shard_offset(rank), hi = lo + b.shard_numel(rank);
      for_each_piece(b, lo, hi, [&](const Bucket::Entry& e, std::int64_t from, std::int64_t to) {
        auto it = loaded_.find(e.param);
        if (it == loaded_.end()) return;
        const float* m = it->second.first.data() + (from - e.offset);
        const float* v = it->second.second.data() + (from - e.offset);
        std::copy(m, m + (to - from), m_.back().data() + (from - lo));
        std::copy(v, v + (to - from), v_.back().data() + (from - lo));
      });
    }
    loaded_.clear();
  }

  // Saving gathers the moments (a collective: every rank calls state() together), so the state
  // is AdamW's: the same keys, loadable by AdamW or by a ShardedAdamW over any number of ranks.
  void save_extra(optim::OptimizerState& s) const override {
    s.scalars["step"] = static_cast<double>(t_);
    if (m_.empty()) return;
    std::vector<std::pair<std::size_t, std::size_t>> key_of(ddp_.parameters().size(), {0, 0});
    std::vector<bool> in_groups(ddp_.parameters().size(), false);
    for_each_param([&](std::size_t g, std::size_t i, const Tensor* p) {
      const std::size_t k = position_of(p);
      if (in_groups[k]) return;  // a tied weight's second name: saved once
      key_of[k] = {g, i};
      in_groups[k] = true;
    });
    for (std::size_t bi = 0; bi < ddp_.buckets().size(); ++bi) {
      const Bucket& b = ddp_.buckets()[bi];
      const Tensor m = all_gather(ddp_.context(), shard_tensor(m_[bi]), Shape{b.numel});
      const Tensor v = all_gather(ddp_.context(), shard_tensor(v_[bi]), Shape{b.numel});
      for (const Bucket::Entry& e : b.entries) {
        if (!in_groups[e.param]) continue;
        const auto [g, i] = key_of[e.param];
        Tensor pm(ddp_.parameters()[e.param]->shape()), pv(ddp_.parameters()[e.param]->shape());
        std::copy(m.data() + e.offset, m.data() + e.offset + e.numel, pm.data());
        std::copy(v.data() + e.offset, v.data() + e.offset + e.numel, pv.data());
        s.tensors[key(g, i, "exp_avg")] = pm;
        s.tensors[key(g, i, "exp_avg_sq")] = pv;
      }
    }
  }
  void check_extra(const optim::OptimizerState& s) const override {
    optim::AdamW reference(groups_, opt_);
    reference.load_state(s);  // the same checks AdamW makes, on a scratch optimizer
  }
  bool known_buffer(const std::string& buffer) const override { return buffer == "exp_avg" || buffer == "exp_avg_sq"; }
  void load_extra(const optim::OptimizerState& s) override {
    t_ = static_cast<std::int64_t>(s.scalars.at("step"));
    loaded_.clear();
    for (const auto& [k, t] : s.tensors) {
      const auto [p, buffer] = parameter_of(k);
      auto& slot = loaded_[position_of(p)];
      (buffer == "exp_avg" ? slot.first : slot.second) = t.to_vector();
    }
    for (auto& [index, mv] : loaded_) {
      const auto n = static_cast<std::size_t>(ddp_.parameters()[index]->numel());
      mv.first.resize(n, 0.0f);
      mv.second.resize(n, 0.0f);
    }
    m_.clear();
    v_.clear();
  }

  static Tensor shard_tensor(const std::vector<float>& values) {
    Tensor t(Shape{static_cast<std::int64_t>(values.size())});
    std::copy(values.begin(), values.end(), t.data());
    return t;
  }

  DataParallel& ddp_;
  optim::AdamWOptions opt_;
  std::vector<int> group_of_;  ///< per DataParallel parameter: its group, -1 when not optimised here
  std::vector<std::vector<float>> m_, v_;  ///< per bucket: this rank's shard of the moments
  std::map<std::size_t, std::pair<std::vector<float>, std::vector<float>>> loaded_;
  std::int64_t t_ = 0;
};

}  // namespace remat::dist
