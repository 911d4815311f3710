#pragma once
// What ZeRO-1's and ZeRO-3's AdamW share (dist::ShardedAdamW, dist::FullyShardedAdamW): parameter
// groups matched to a wrapper's parameters by autograd identity, this rank's shard of both moments
// for each flat range the wrapper lays its parameters in (a bucket, a unit), and a state saved and
// loaded under AdamW's keys — the moments gathered whole, so the state loads into AdamW or into
// either sharded optimizer over any number of ranks. What differs is step(): where the weights live.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "remat/core/factory.hpp"
#include "remat/dist/context.hpp"
#include "remat/optim/adamw.hpp"

namespace remat::dist::detail {

/// The base of the sharded AdamWs: groups, moments per flat range, the state as AdamW's.
class ShardedAdamWBase : public optim::Optimizer {
 public:
  /// The number of steps taken (t in the bias corrections).
  std::int64_t steps() const { return t_; }
  /// Bytes of optimizer state this rank holds (both moments of its shards).
  std::size_t state_bytes() const {
    std::size_t n = 0;
    for (std::size_t r = 0; r < m_.size(); ++r) n += m_[r].nbytes() + v_[r].nbytes();
    return n;
  }

 protected:
  /// A flat range of parameters whose shard this rank updates.
  struct Range {
    const std::vector<FlatEntry>* entries;  ///< its parameters' places
    std::int64_t numel;                     ///< its length
    const ShardLayout* shards;              ///< how it splits over the ranks
  };

  /// `params` and `names` are the wrapper's (each parameter once), `who` the optimizer's name.
  ShardedAdamWBase(const Context& ctx, const std::vector<Tensor*>& params, const std::vector<std::string>& names,
                   std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt, const char* who)
      : Optimizer(std::move(groups), opt.lr), opt_(opt), ctx_(ctx), params_(params), who_(who) {
    optim::AdamW check(std::vector<Tensor*>{}, opt);  // validates betas and eps exactly as AdamW does
    (void)check;
    group_of_.assign(params.size(), -1);
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (Tensor* p : groups_[g].params) {
        const std::size_t i = position_of(p);
        // A tied weight may be listed twice (two names, one tensor): once per group is fine.
        REMAT_CHECK(group_of_[i] < 0 || group_of_[i] == static_cast<int>(g), "{}: parameter '{}' is in two groups",
                    who_, names[i]);
        group_of_[i] = static_cast<int>(g);
      }
  }

  /// The wrapper's flat ranges, in order (empty until they exist).
  virtual std::vector<Range> ranges() const = 0;

  /// Parameter i's group, or null when no group has it (it is not optimised here).
  const optim::ParamGroup* group_of(std::size_t i) const {
    return group_of_[i] < 0 ? nullptr : &groups_[static_cast<std::size_t>(group_of_[i])];
  }

  /// The moments of this rank's shards, zero or sliced from a loaded state, on first use.
  void allocate() {
    if (!m_.empty()) return;
    const int rank = ctx_.rank();
    for (const Range& r : ranges()) {
      const std::int64_t lo = r.shards->offsets[static_cast<std::size_t>(rank)];
      const std::int64_t mine = r.shards->counts[static_cast<std::size_t>(rank)];
      m_.push_back(zeros(Shape{mine}));
      v_.push_back(zeros(Shape{mine}));
      for_each_piece(*r.entries, lo, lo + mine, [&](const FlatEntry& e, std::int64_t from, std::int64_t to) {
        auto it = loaded_.find(e.param);
        if (it == loaded_.end()) return;
        std::copy_n(it->second.first.data() + (from - e.offset), to - from, m_.back().data() + (from - lo));
        std::copy_n(it->second.second.data() + (from - e.offset), to - from, v_.back().data() + (from - lo));
      });
    }
    loaded_.clear();
  }

  /// Per flat range: this rank's shard of the moments (in the memory books).
  std::vector<Tensor> m_, v_;
  /// The options it was built with.
  optim::AdamWOptions opt_;
  /// Steps taken.
  std::int64_t t_ = 0;

 private:
  // The wrapper's index of `p`, matched by autograd identity (a tied weight has two Tensor
  // objects and one identity).
  std::size_t position_of(const Tensor* p) const {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i]->meta() == p->meta()) return i;
    throw Error(fmt::format("{}: a parameter of shape {} is not one of its wrapper's parameters", who_, p->shape()));
  }

  // Saving gathers the moments (a collective: every rank calls state() together).
  void save_extra(optim::OptimizerState& s) const override {
    s.scalars["step"] = static_cast<double>(t_);
    if (m_.empty()) return;
    std::vector<std::pair<std::size_t, std::size_t>> key_of(params_.size(), {0, 0});
    std::vector<bool> in_groups(params_.size(), false);
    for_each_param([&](std::size_t g, std::size_t i, const Tensor* p) {
      const std::size_t k = position_of(p);
      if (in_groups[k]) return;  // a tied weight's second name: saved once
      key_of[k] = {g, i};
      in_groups[k] = true;
    });
    const std::vector<Range> all = ranges();
    for (std::size_t ri = 0; ri < all.size(); ++ri) {
      const Tensor m = all_gather(ctx_, m_[ri], Shape{all[ri].numel});
      const Tensor v = all_gather(ctx_, v_[ri], Shape{all[ri].numel});
      for (const FlatEntry& e : *all[ri].entries) {
        if (!in_groups[e.param]) continue;
        const auto [g, i] = key_of[e.param];
        Tensor pm(params_[e.param]->shape()), pv(params_[e.param]->shape());
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
      const auto n = static_cast<std::size_t>(params_[index]->numel());
      mv.first.resize(n, 0.0f);
      mv.second.resize(n, 0.0f);
    }
    m_.clear();
    v_.clear();
  }

  const Context& ctx_;
  const std::vector<Tensor*>& params_;
  const char* who_;
  std::vector<int> group_of_;  // per parameter: its group, -1 when not optimised here
  std::map<std::size_t, std::pair<std::vector<float>, std::vector<float>>> loaded_;  // until allocate()
};

}  // namespace remat::dist::detail
