#pragma once
// dist::DataParallel — PyTorch's DistributedDataParallel for remat: every rank runs the whole model
// on its share of the batch; the gradients are averaged over ranks while backward still runs.
//
// How it overlaps: parameters are grouped into buckets in the order their gradients became final
// in the first step (a small first bucket, then ~25 MB, as PyTorch does). From the second step on,
// a parameter is final when it has taken as many gradient contributions as in the first step (one,
// or several for a weight used several times or replayed by a checkpoint); a bucket whose
// parameters are all final is sent at once with a non-blocking all-to-all, and backward goes on.
// Buckets are sent in bucket order on every rank (MPI matches collectives by order). At the end of
// backward the rest is sent and everything is waited for.
//
// Why the result is exact: each rank receives every rank's copy of its shard of a bucket and adds
// them in rank order (dist::detail::sum_rows_in_rank_order), then divides by N; an all-gather
// brings the shards back. So N ranks give the bits of one process that accumulates the N
// micro-batches in rank order and divides its gradients by N — when each parameter's gradient of a
// micro-batch reaches .grad in one piece (a weight used twice in one graph, e.g. a tied embedding,
// is accumulated piece by piece in one process and whole per rank here: the sums associate
// differently in the last bit).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/error.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/node.hpp"
#include "remat/core/scoped.hpp"
#include "remat/dist/context.hpp"
#include "remat/nn/module.hpp"
#include "remat/optim/clip.hpp"

namespace remat::dist {

/// How DataParallel buckets and averages gradients; the defaults are PyTorch's.
struct DataParallelOptions {
  std::size_t first_bucket_bytes = std::size_t{1} << 20;  ///< PyTorch's first bucket: 1 MiB
  std::size_t bucket_bytes = std::size_t{25} << 20;       ///< PyTorch's bucket_cap_mb = 25
  /// ZeRO stage 1: reduce-scatter only; each rank keeps its shard of every averaged bucket for a
  /// sharded optimizer (dist::ShardedAdamW), which all-gathers the updated parameters.
  bool shard_gradients = false;
  /// Start reductions during backward (false: all after it, to measure what overlap hides).
  bool overlap = true;
  /// Copy rank 0's parameters to every rank when the wrapper is built.
  bool broadcast_parameters = true;
};

/// What the wrapper did during the last synchronised backward, in the order it happened, with the
/// time since that backward's first gradient: the evidence that reductions start before backward
/// ends.
struct SyncEvent {
  /// bucket_sent: its reduction started; bucket_summed: its result arrived; bucket_done: its
  /// mean was written back; backward_end: the backward's last op returned.
  enum class Kind { bucket_sent, bucket_summed, bucket_done, backward_end };
  /// What happened.
  Kind kind;
  int bucket;  ///< -1 for backward_end
  /// When, in seconds since the backward's first gradient.
  double seconds;
};

/// One bucket: a run of parameters (in gradient-ready order) laid end to end in one flat buffer.
struct Bucket {
  /// One parameter's place in the bucket (`param` indexes DataParallel::parameters()).
  using Entry = FlatEntry;
  /// The bucket's parameters, in gradient-ready order.
  std::vector<Entry> entries;
  /// The bucket's total elements.
  std::int64_t numel = 0;
  /// How its elements split over the ranks.
  ShardLayout shards{0, 1};
  bool holds_unused = false;  ///< has a parameter that took no gradient in the first step

  // Per step.
  int waiting = 0;  ///< parameters not yet final
  /// Whether this step's reduction has started.
  bool sent = false;
  ///@{
  /// The local gradients, every rank's copy of my shard, the mean.
  std::vector<float> flat, rows, shard;
  ///@}
  ///@{
  /// Where each rank's copy lands in `rows` (MPI's counts and displacements).
  std::vector<int> row_counts, row_offsets;
  ///@}
  /// The reduction in flight (MPI_REQUEST_NULL when none).
  MPI_Request request = MPI_REQUEST_NULL;

  /// This rank's averaged shard (valid after a synchronised backward).
  std::int64_t shard_offset(int rank) const { return shards.offsets[static_cast<std::size_t>(rank)]; }
  /// The number of elements of `rank`'s shard.
  std::int64_t shard_numel(int rank) const { return shards.counts[static_cast<std::size_t>(rank)]; }
};

/// PyTorch's DistributedDataParallel: every rank runs the whole model on its share of the batch,
/// and the parameters' gradients are averaged over the ranks in buckets while backward still runs.
class DataParallel : private remat::Observer {
 public:
  /// Over all of model's parameters (named_parameters()).
  DataParallel(Context& ctx, nn::Module& model, DataParallelOptions options = {})
      : DataParallel(ctx, model.named_parameters(), options) {}
  /// Over the given named parameters (the same names and order on every rank).
  DataParallel(Context& ctx, std::vector<std::pair<std::string, Tensor*>> named, DataParallelOptions options = {})
      : ctx_(ctx), options_(options) {
    REMAT_CHECK(options.first_bucket_bytes > 0 && options.bucket_bytes > 0,
                "DataParallel: bucket sizes must be positive, got {} and {} bytes", options.first_bucket_bytes,
                options.bucket_bytes);
    for (auto& [name, p] : named) {
      REMAT_CHECK(p != nullptr && p->defined() && p->requires_grad(),
                  "DataParallel: parameter '{}' must be a defined tensor that requires grad", name);
      // A tied weight appears under two names; it is one gradient.
      if (index_.count(p->meta().get())) continue;
      index_.emplace(p->meta().get(), params_.size());
      params_.push_back(p);
      names_.push_back(name);
    }
    seen_.assign(params_.size(), 0);
    last_seen_at_.assign(params_.size(), -1);
    agree_across_ranks("parameters", describe_parameters());
    if (options.broadcast_parameters) broadcast_parameters(ctx_, params_);
    // Collectives on one communicator must start in the same order on every rank. The all-to-alls
    // start in bucket order as buckets become ready, the all-gathers in bucket order as sums
    // finish: two orders that interleave differently on each rank, hence two communicators.
    detail::check_mpi(MPI_Comm_dup(ctx_.comm(), &gather_comm_), "MPI_Comm_dup");
  }
  /// Wrappers on one thread must be destroyed in the reverse order of their construction.
  ~DataParallel() override {
    wait_for_sent();
    MPI_Comm_free(&gather_comm_);
  }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// RAII: backward passes inside accumulate gradients locally, without communicating (gradient
  /// accumulation over micro-batches); the first backward after it averages what was accumulated.
  class NoSync {
   public:
    /// Turns off synchronisation of `ddp` for the guard's lifetime.
    explicit NoSync(DataParallel& ddp) : guard_(ddp.sync_, false) {}

   private:
    ScopedValue<bool> guard_;
  };
  /// A NoSync guard on this wrapper: `{ auto g = ddp.no_sync(); loss.backward(); }`.
  NoSync no_sync() { return NoSync(*this); }

  /// The parameters whose gradients it averages.
  const std::vector<Tensor*>& parameters() const { return params_; }
  /// Their names, in the same order.
  const std::vector<std::string>& names() const { return names_; }
  /// Empty until the first synchronised backward has ended.
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// What the last synchronised backward did, in order.
  const std::vector<SyncEvent>& last_events() const { return events_; }
  /// Seconds the last synchronised backward spent, after its last op, waiting for reductions.
  double last_exposed_seconds() const { return exposed_seconds_; }
  /// The MPI context it communicates through.
  const Context& context() const { return ctx_; }
  /// The options it was built with.
  const DataParallelOptions& options() const { return options_; }
  /// Reductions during backward (true) or all after it, from the next backward on.
  void set_overlap(bool on) { options_.overlap = on; }

  /// Clips the averaged gradients by their global L2 norm (torch.nn.utils.clip_grad_norm_) and
  /// returns the norm before clipping; the same on every rank. Sharded: the norm is summed over
  /// shards in rank order.
  double clip_grad_norm(double max_norm) {
    if (!options_.shard_gradients) return optim::clip_grad_norm(params_, max_norm);
    REMAT_CHECK(max_norm > 0, "DataParallel::clip_grad_norm: max_norm must be positive, got {}", max_norm);
    double mine = 0;
    for (const Bucket& b : buckets_)
      mine += Eigen::Map<const Eigen::ArrayXf>(b.shard.data(), static_cast<std::int64_t>(b.shard.size()))
                  .cast<double>()
                  .square()
                  .sum();
    const double norm = detail::sharded_norm(ctx_, mine), scale = max_norm / (norm + 1e-6);
    if (scale < 1)
      for (Bucket& b : buckets_)
        for (float& g : b.shard) g *= static_cast<float>(scale);
    return norm;
  }

  /// Sharded mode: writes the full averaged gradients into every parameter's .grad (one
  /// all-gather per bucket; for inspection and tests — the sharded optimizer does not need it).
  void gather_gradients() {
    REMAT_CHECK(options_.shard_gradients, "DataParallel::gather_gradients: only for shard_gradients (the "
                                          "gradients are already whole)");
    for (Bucket& b : buckets_) {
      all_gather_shard(b, b.shard.data());
      write_back(b);
    }
  }

 private:
  friend class ShardedAdamW;

  using Clock = std::chrono::steady_clock;

  // Observer: every observer on the thread hears every leaf, so wrappers of other models (and any
  // profiler) hear theirs too.
  void leaf_grad(const void* leaf) override {
    if (!sync_) return;
    auto it = index_.find(leaf);
    if (it == index_.end()) return;  // another wrapper's parameter, or a leaf input that requires grad
    const std::size_t i = it->second;
    if (!step_started_) start_step();
    ++seen_[i];
    if (buckets_.empty()) {
      last_seen_at_[i] = event_counter_++;
      return;
    }
    Bucket& b = buckets_[bucket_of_[i]];
    REMAT_CHECK(!b.sent, "DataParallel: parameter '{}' took a gradient after its bucket {} was sent for reduction: it "
                "took {} contribution(s) in the first step and {} in this one. The graph must use each parameter as "
                "often in every step (build a new DataParallel when the model changes)", names_[i], bucket_of_[i],
                expected_[i], seen_[i]);
    if (seen_[i] == expected_[i] && --b.waiting == 0 && options_.overlap) send_ready();
    progress(false);
  }

  std::string refuses_higher_order() const override {
    return "DataParallel averages first-order gradients across ranks; the graph create_graph records and the "
           "tangents hvp carries would not be averaged (each rank would differentiate its own share alone)";
  }
  void backward_end(bool completed, bool outermost) override {
    if (outermost) finish_step(completed);  // a dry run inside a backward is not the step's end
  }

  void finish_step(bool completed) {
    if (!sync_ || !step_started_) {
      std::fill(seen_.begin(), seen_.end(), 0);
      return;
    }
    if (!completed) {
      // Keep the communicator consistent: what was sent must complete before the next step.
      wait_for_sent();
      reset_step();
      return;
    }
    event(SyncEvent::Kind::backward_end, -1);
    const auto end_of_ops = Clock::now();
    if (buckets_.empty()) build_buckets();
    for (std::size_t b = next_send_; b < buckets_.size(); ++b) send(b);
    next_send_ = buckets_.size();
    progress(true);
    exposed_seconds_ = std::chrono::duration<double>(Clock::now() - end_of_ops).count();
    reset_step();
  }

  void start_step() {
    step_started_ = true;
    step_start_ = Clock::now();
    events_.clear();
    for (Bucket& b : buckets_) {
      b.waiting = 0;
      for (const Bucket::Entry& e : b.entries) b.waiting += expected_[e.param] > 0 ? 1 : 0;
      b.sent = false;
    }
    next_send_ = next_summed_ = 0;
  }
  void reset_step() {
    std::fill(seen_.begin(), seen_.end(), 0);
    step_started_ = false;
  }

  // Buckets in the order gradients became final in the first step; parameters that took none go
  // last, in buckets of their own (sent only at the end of backward).
  void build_buckets() {
    expected_ = seen_;
    std::vector<std::size_t> order(params_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const bool used_a = expected_[a] > 0, used_b = expected_[b] > 0;
      if (used_a != used_b) return used_a;
      return used_a ? last_seen_at_[a] < last_seen_at_[b] : a > b;
    });
    bucket_of_.assign(params_.size(), 0);
    std::size_t cap = options_.first_bucket_bytes;
    for (std::size_t i : order) {
      const std::int64_t n = params_[i]->numel();
      const bool used = expected_[i] > 0;
      const bool fresh = buckets_.empty() || (buckets_.back().numel > 0 &&
                                              (static_cast<std::size_t>(buckets_.back().numel + n) * sizeof(float) > cap ||
                                               buckets_.back().holds_unused != !used));
      if (fresh) {
        if (!buckets_.empty()) cap = options_.bucket_bytes;
        buckets_.emplace_back();
        buckets_.back().holds_unused = !used;
      }
      Bucket& b = buckets_.back();
      b.entries.push_back({i, b.numel, n});
      b.numel += n;
      bucket_of_[i] = buckets_.size() - 1;
    }
    for (Bucket& b : buckets_) {
      detail::mpi_count(b.numel, "DataParallel bucket");
      b.shards = ShardLayout(b.numel, ctx_.world_size());
      b.flat.resize(static_cast<std::size_t>(b.numel));
      b.shard.resize(static_cast<std::size_t>(b.shard_numel(ctx_.rank())));
      const int n = ctx_.world_size(), mine = static_cast<int>(b.shard.size());
      b.rows.resize(b.shard.size() * static_cast<std::size_t>(n));
      b.row_counts.assign(static_cast<std::size_t>(n), mine);
      b.row_offsets.resize(static_cast<std::size_t>(n));
      for (int q = 0; q < n; ++q) b.row_offsets[static_cast<std::size_t>(q)] = q * mine;
    }
    // Every rank must have built the same buckets, or the collectives would pair unrelated data.
    agree_across_ranks("bucket layouts", describe_buckets());
    // This first step sends everything now (what start_step would have set up).
    next_send_ = next_summed_ = 0;
    for (Bucket& b : buckets_) b.sent = false;
  }

  void send_ready() {
    while (next_send_ < buckets_.size() && !buckets_[next_send_].sent && buckets_[next_send_].waiting == 0 &&
           !buckets_[next_send_].holds_unused)
      send(next_send_++);
  }

  // Local gradients into the flat buffer, then every rank gets every rank's copy of its shard.
  void send(std::size_t index) {
    Bucket& b = buckets_[index];
    for (const Bucket::Entry& e : b.entries) {
      const Tensor g = params_[e.param]->grad();
      float* to = b.flat.data() + e.offset;
      if (g.defined())
        std::copy(g.data(), g.data() + e.numel, to);
      else
        std::fill(to, to + e.numel, 0.0f);
    }
    // The count arrays, like the buffers, must stay untouched until the call completes: the
    // bucket owns them.
    detail::check_mpi(MPI_Ialltoallv(b.flat.data(), b.shards.counts.data(), b.shards.offsets.data(), MPI_FLOAT,
                                     b.rows.data(), b.row_counts.data(), b.row_offsets.data(), MPI_FLOAT, ctx_.comm(),
                                     &b.request),
                      "MPI_Ialltoallv");
    b.sent = true;
    event(SyncEvent::Kind::bucket_sent, static_cast<int>(index));
  }

  // Sums what has arrived, in bucket order (so the all-gathers, collectives too, start in the same
  // order on every rank); with `wait`, until every bucket is done.
  void progress(bool wait) {
    while (next_summed_ < next_send_) {
      Bucket& b = buckets_[next_summed_];
      int done = 0;
      if (wait) {
        detail::check_mpi(MPI_Wait(&b.request, MPI_STATUS_IGNORE), "MPI_Wait");
        done = 1;
      } else {
        detail::check_mpi(MPI_Test(&b.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      }
      if (!done) return;
      const int n = ctx_.world_size(), mine = static_cast<int>(b.shard.size());
      detail::sum_rows_in_rank_order(b.rows.data(), n, mine, b.shard.data());
      Eigen::Map<Eigen::ArrayXf>(b.shard.data(), mine) /= static_cast<float>(n);
      event(SyncEvent::Kind::bucket_summed, static_cast<int>(next_summed_));
      if (!options_.shard_gradients) {
        detail::check_mpi(MPI_Iallgatherv(b.shard.data(), mine, MPI_FLOAT, b.flat.data(), b.shards.counts.data(),
                                          b.shards.offsets.data(), MPI_FLOAT, gather_comm_, &b.request),
                          "MPI_Iallgatherv");
      }
      ++next_summed_;
    }
    if (!wait || options_.shard_gradients) return;
    for (std::size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      detail::check_mpi(MPI_Wait(&b.request, MPI_STATUS_IGNORE), "MPI_Wait");
      write_back(b);
      event(SyncEvent::Kind::bucket_done, static_cast<int>(i));
    }
  }

  void wait_for_sent() {
    for (Bucket& b : buckets_)
      if (b.request != MPI_REQUEST_NULL) MPI_Wait(&b.request, MPI_STATUS_IGNORE);
  }

  void all_gather_shard(Bucket& b, const float* shard) {
    detail::check_mpi(MPI_Allgatherv(shard, static_cast<int>(b.shard.size()), MPI_FLOAT, b.flat.data(),
                                     b.shards.counts.data(), b.shards.offsets.data(), MPI_FLOAT, ctx_.comm()),
                      "MPI_Allgatherv");
  }

  // The bucket's flat buffer into the parameters' .grad.
  void write_back(const Bucket& b) {
    for (const Bucket::Entry& e : b.entries) {
      Tensor* p = params_[e.param];
      if (!p->grad().defined()) p->meta()->grad = Tensor(p->shape());
      Tensor g = p->grad();
      std::copy(b.flat.data() + e.offset, b.flat.data() + e.offset + e.numel, g.data());
    }
  }

  void event(SyncEvent::Kind kind, int bucket) {
    events_.push_back({kind, bucket, std::chrono::duration<double>(Clock::now() - step_start_).count()});
  }

  std::string describe_parameters() const {
    std::string s;
    for (std::size_t i = 0; i < params_.size(); ++i)
      s += fmt::format("parameter {} '{}' of shape {}\n", i, names_[i], params_[i]->shape());
    return s;
  }
  std::string describe_buckets() const {
    std::string s;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      s += fmt::format("bucket {}:", b);
      for (const Bucket::Entry& e : buckets_[b].entries) s += fmt::format(" '{}'", names_[e.param]);
      s += "\n";
    }
    return s;
  }

  // Every rank compares its description with every other's; on a difference every rank throws
  // the same message: the first line where a rank differs from rank 0.
  void agree_across_ranks(const char* what, const std::string& mine) {
    detail::agree_across_ranks(ctx_, "DataParallel", what, mine);
  }

  Context& ctx_;
  MPI_Comm gather_comm_ = MPI_COMM_NULL;
  DataParallelOptions options_;
  std::vector<Tensor*> params_;
  std::vector<std::string> names_;
  std::unordered_map<const void*, std::size_t> index_;

  bool sync_ = true;
  bool step_started_ = false;
  Clock::time_point step_start_;
  std::vector<int> seen_, expected_;  ///< contributions this step / in the first step
  std::vector<std::int64_t> last_seen_at_;
  std::int64_t event_counter_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::size_t next_send_ = 0, next_summed_ = 0;
  std::vector<SyncEvent> events_;
  double exposed_seconds_ = 0;
};

}  // namespace remat::dist
