#pragma once
// dist::FullyShardedAdamW — the optimizer of ZeRO stage 3: AdamW on each rank's shards of a
// FullyShardedDataParallel's units. The shards hold both the parameters and the averaged gradients,
// so a step moves nothing between ranks except the root unit's new values (it stays whole); a
// block's new values reach the other ranks when the block is next gathered. AdamWStep's element-wise
// update does not care where a shard begins, so the weights are bitwise those of AdamW on the
// averaged gradients, on any number of ranks.
//
// As with ShardedAdamW, a parameter that took no gradient on any rank is updated with a zero
// gradient (AdamW would skip it).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "remat/core/factory.hpp"
#include "remat/dist/fully_sharded.hpp"
#include "remat/optim/adamw.hpp"

namespace remat::dist {

/// AdamW over the shards of a FullyShardedDataParallel (ZeRO stage 3): each rank holds 1/N of the
/// parameters, gradients and moments; the weights after each step are bitwise AdamW's.
class FullyShardedAdamW : public optim::Optimizer {
 public:
  /// One group of all params, with opt.weight_decay.
  FullyShardedAdamW(FullyShardedDataParallel& fsdp, std::vector<Tensor*> params, optim::AdamWOptions opt = {})
      : FullyShardedAdamW(fsdp, std::vector<optim::ParamGroup>{optim::ParamGroup{std::move(params), opt.weight_decay}},
                          opt) {}
  /// Parameter groups, each with its own weight decay; opt.weight_decay is not used.
  FullyShardedAdamW(FullyShardedDataParallel& fsdp, std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt)
      : Optimizer(std::move(groups), opt.lr), fsdp_(fsdp), opt_(opt) {
    optim::AdamW check(std::vector<Tensor*>{}, opt);  // validates betas and eps as AdamW does
    (void)check;
    group_of_.assign(fsdp.parameters().size(), -1);
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (Tensor* p : groups_[g].params) {
        const std::size_t i = position_of(p);
        REMAT_CHECK(group_of_[i] < 0 || group_of_[i] == static_cast<int>(g), "FullyShardedAdamW: parameter '{}' is in "
                    "two groups", fsdp.names()[i]);
        group_of_[i] = static_cast<int>(g);
      }
  }

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
      FullyShardedDataParallel::for_each_piece(u, lo, hi, [&](const ShardedUnit::Entry& e, std::int64_t from,
                                                              std::int64_t to) {
        const int g = group_of_[e.param];
        if (g < 0) return;
        const std::int64_t at = from - lo;
        c.update(u.params.data() + at, m_[ui].data() + at, v_[ui].data() + at, u.grads.data() + at, to - from,
                 c.decay(groups_[static_cast<std::size_t>(g)].weight_decay));
      });
      u.grads_fresh = true;  // consumed: the next backward's reduction writes the shard
      u.stale = true;
    }
    fsdp_.gather(fsdp_.units_.back());  // the root stays whole
  }

  /// The number of steps taken (t in the bias corrections).
  std::int64_t steps() const { return t_; }
  const char* kind() const override { return "FullyShardedAdamW"; }
  /// Bytes of optimizer state this rank holds (both moments of its shards).
  std::size_t state_bytes() const {
    std::size_t n = 0;
    for (std::size_t u = 0; u < m_.size(); ++u) n += m_[u].nbytes() + v_[u].nbytes();
    return n;
  }

 private:
  std::size_t position_of(const Tensor* p) const {
    const std::vector<Tensor*>& params = fsdp_.parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i]->meta() == p->meta()) return i;
    throw Error(fmt::format("FullyShardedAdamW: a parameter of shape {} is not one of the "
                            "FullyShardedDataParallel's parameters", p->shape()));
  }

  void allocate() {
    if (!m_.empty()) return;
    const int rank = fsdp_.context().rank();
    for (const ShardedUnit& u : fsdp_.units()) {
      const std::int64_t lo = u.shard_offset(rank), mine = u.shard_numel(rank);
      m_.push_back(zeros(Shape{mine}));
      v_.push_back(zeros(Shape{mine}));
      // Moments loaded before the first step: this rank's slice of them.
      FullyShardedDataParallel::for_each_piece(u, lo, lo + mine, [&](const ShardedUnit::Entry& e, std::int64_t from,
                                                                     std::int64_t to) {
        auto it = loaded_.find(e.param);
        if (it == loaded_.end()) return;
        std::copy_n(it->second.first.data() + (from - e.offset), to - from, m_.back().data() + (from - lo));
        std::copy_n(it->second.second.data() + (from - e.offset), to - from, v_.back().data() + (from - lo));
      });
    }
    loaded_.clear();
  }

  // Saving gathers the moments (a collective), so the state is AdamW's: the same keys, loadable by
  // AdamW, ShardedAdamW or this optimizer over any number of ranks.
  void save_extra(optim::OptimizerState& s) const override {
    s.scalars["step"] = static_cast<double>(t_);
    if (m_.empty()) return;
    std::vector<std::pair<std::size_t, std::size_t>> key_of(fsdp_.parameters().size(), {0, 0});
    std::vector<bool> in_groups(fsdp_.parameters().size(), false);
    for_each_param([&](std::size_t g, std::size_t i, const Tensor* p) {
      const std::size_t k = position_of(p);
      if (in_groups[k]) return;  // a tied weight's second name: saved once
      key_of[k] = {g, i};
      in_groups[k] = true;
    });
    for (std::size_t ui = 0; ui < fsdp_.units().size(); ++ui) {
      const ShardedUnit& u = fsdp_.units()[ui];
      const Tensor m = all_gather(fsdp_.context(), m_[ui], Shape{u.numel});
      const Tensor v = all_gather(fsdp_.context(), v_[ui], Shape{u.numel});
      for (const ShardedUnit::Entry& e : u.entries) {
        if (!in_groups[e.param]) continue;
        const auto [g, i] = key_of[e.param];
        Tensor pm(fsdp_.parameters()[e.param]->shape()), pv(fsdp_.parameters()[e.param]->shape());
        std::copy_n(m.data() + e.offset, e.numel, pm.data());
        std::copy_n(v.data() + e.offset, e.numel, pv.data());
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
      const auto n = static_cast<std::size_t>(fsdp_.parameters()[index]->numel());
      mv.first.resize(n, 0.0f);
      mv.second.resize(n, 0.0f);
    }
    m_.clear();
    v_.clear();
  }

  FullyShardedDataParallel& fsdp_;
  optim::AdamWOptions opt_;
  std::vector<int> group_of_;              ///< per parameter: its group, -1 when not optimised here
  std::vector<Tensor> m_, v_;  ///< per unit: this rank's shard of the moments (in the memory books)
  std::map<std::size_t, std::pair<std::vector<float>, std::vector<float>>> loaded_;
  std::int64_t t_ = 0;
};

}  // namespace remat::dist
