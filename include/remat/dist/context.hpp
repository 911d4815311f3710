#pragma once
// remat::dist — data parallelism over MPI (optional: needs an MPI library; link remat::dist).
// The Context is the process's MPI lifetime; the collectives below sum in a fixed order (rank 0,
// 1, ..., N-1, element by element), so N ranks give the bits one process gets by adding the same N
// tensors in rank order. MPI's own MPI_SUM may reassociate (its algorithm depends on the message
// size and the number of ranks), so remat never asks MPI to add: it moves bytes (all-to-all,
// all-gather, broadcast) and adds them itself.

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "remat/core/autograd.hpp"
#include "remat/core/error.hpp"
#include "remat/core/hash.hpp"
#include "remat/core/tensor.hpp"

/// Data parallelism over MPI with deterministic, fixed-order collectives (optional: link remat::dist).
namespace remat::dist {
namespace detail {

/// Throws remat::Error naming `what` when an MPI call did not succeed.
inline void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(fmt::format("remat::dist: {} failed: {}", what, std::string(text, static_cast<std::size_t>(length))));
}

inline int& world_rank_for_messages() {
  static int rank = -1;
  return rank;
}

/// Prints the rank and `what` and ends every rank of the job (MPI_Abort: mpirun kills the rest).
[[noreturn]] inline void abort_job(const std::string& what) {
  std::fprintf(stderr, "remat::dist: rank %d failed, ending every rank: %s\n", world_rank_for_messages(), what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

// An exception that leaves main on one rank must end every rank: the others may be waiting in a
// collective for it and would wait forever.
[[noreturn]] inline void terminate_job() {
  std::string what = "std::terminate was called without an exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
  }
  abort_job(what);
}

}  // namespace detail

/// How n elements split into one contiguous shard per rank: the first n % N ranks take one more.
struct ShardLayout {
  /// The layout of n elements over `ranks` ranks.
  ShardLayout(std::int64_t n, int ranks) : counts(static_cast<std::size_t>(ranks)), offsets(static_cast<std::size_t>(ranks)) {
    std::int64_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      counts[static_cast<std::size_t>(r)] = static_cast<int>(n / ranks + (r < n % ranks ? 1 : 0));
      offsets[static_cast<std::size_t>(r)] = static_cast<int>(at);
      at += counts[static_cast<std::size_t>(r)];
    }
  }
  /// Elements and first element of each rank's shard.
  std::vector<int> counts, offsets;  ///< int: MPI's counts are ints
};

/// One parameter's place in a flat range (a DataParallel bucket, a fully sharded unit).
struct FlatEntry {
  std::size_t param;    ///< the wrapper's index of the parameter
  std::int64_t offset;  ///< where it starts in the range
  std::int64_t numel;   ///< its number of elements
};

/// The process's MPI lifetime (MPI_Init_thread / MPI_Finalize) and its communicator, a duplicate of
/// MPI_COMM_WORLD on which every call returns its error (thrown as remat::Error) instead of
/// aborting. One per process. While it lives, an exception that reaches std::terminate prints
/// the rank and the message and ends every rank (MPI_Abort), so a failure never leaves the other
/// ranks hanging.
class Context {
 public:
  Context() : Context(nullptr, nullptr) {}
  /// Initialises MPI with main's arguments (or null for none); one Context per process.
  Context(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    REMAT_CHECK(!initialized, "dist::Context: MPI is already initialised; make one Context per process");
    int provided = 0;
    // Only the thread that made the Context calls MPI (OpenMP threads never do).
    detail::check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    detail::check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    detail::world_rank_for_messages() = rank_;
    previous_terminate_ = std::set_terminate(detail::terminate_job);
  }
  ~Context() {
    std::set_terminate(previous_terminate_);
    // Unwinding through here means a rank is leaving on an exception: the others must not wait.
    if (std::uncaught_exceptions() > 0)
      detail::abort_job("an exception is leaving the scope of its dist::Context (catch it there and call "
                        "Context::abort with its message to see it here)");
    MPI_Comm_free(&comm_);
    MPI_Finalize();
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  /// This process's rank, 0 to world_size() - 1.
  int rank() const { return rank_; }
  /// The number of ranks N.
  int world_size() const { return size_; }
  /// The communicator the collectives use.
  MPI_Comm comm() const { return comm_; }
  /// Waits until every rank reaches it.
  void barrier() const { detail::check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }
  /// Ends every rank of the job, printing this rank and `what` (for a handler that caught an
  /// error the other ranks cannot know about).
  [[noreturn]] void abort(const std::string& what) const { detail::abort_job(what); }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::terminate_handler previous_terminate_ = nullptr;
};

namespace detail {

inline int mpi_count(std::int64_t n, const char* op) {
  REMAT_CHECK(n <= 2147483647, "dist::{}: {} elements do not fit one MPI count; split the tensor", op, n);
  return static_cast<int>(n);
}

/// The part [from, to) of `e` inside the flat range [lo, hi); from == to where they do not meet.
inline std::pair<std::int64_t, std::int64_t> overlap(const FlatEntry& e, std::int64_t lo, std::int64_t hi) {
  const std::int64_t from = std::max(lo, e.offset);
  return {from, std::max(from, std::min(hi, e.offset + e.numel))};
}

/// Calls f(entry, from, to) for each entry's part of the flat range [lo, hi).
template <class F>
void for_each_piece(const std::vector<FlatEntry>& entries, std::int64_t lo, std::int64_t hi, F&& f) {
  for (const FlatEntry& e : entries) {
    const auto [from, to] = overlap(e, lo, hi);
    if (from < to) f(e, from, to);
  }
}

/// The L2 norm of a vector sharded over the ranks, from this rank's sum of squares; the sums are
/// added in rank order, so every rank gets the same norm.
inline double sharded_norm(const Context& ctx, double my_sum_of_squares) {
  std::vector<double> all(static_cast<std::size_t>(ctx.world_size()));
  check_mpi(MPI_Allgather(&my_sum_of_squares, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, ctx.comm()), "MPI_Allgather");
  double sq = 0;
  for (double v : all) sq += v;
  return std::sqrt(sq);
}

/// Adds the ranks' copies of this rank's shard, in rank order: rows[q] is rank q's copy, each
/// `count` long, one after another. Both the wrapper and the plain collectives sum here.
inline void sum_rows_in_rank_order(const float* rows, int ranks, int count, float* out) {
  using Vec = Eigen::Map<Eigen::ArrayXf>;
  using ConstVec = Eigen::Map<const Eigen::ArrayXf>;
  Vec sum(out, count);
  sum = ConstVec(rows, count);
  for (int q = 1; q < ranks; ++q) sum += ConstVec(rows + static_cast<std::ptrdiff_t>(q) * count, count);
}

/// Throws, on every rank, a remat::Error naming the first line where a rank's `mine` differs
/// from rank 0's (`who` and `what` name the check): collectives must pair the same data everywhere.
inline void agree_across_ranks(const Context& ctx, const char* who, const char* what, const std::string& mine) {
  const int n = ctx.world_size();
  const std::uint64_t hash = remat::detail::fnv1a(mine.data(), mine.size());
  std::vector<std::uint64_t> hashes(static_cast<std::size_t>(n));
  check_mpi(MPI_Allgather(&hash, 1, MPI_UINT64_T, hashes.data(), 1, MPI_UINT64_T, ctx.comm()),
                    "MPI_Allgather");
  if (std::all_of(hashes.begin(), hashes.end(), [&](std::uint64_t h) { return h == hashes[0]; })) return;
  const int length = mpi_count(static_cast<std::int64_t>(mine.size()), who);
  std::vector<int> lengths(static_cast<std::size_t>(n)), offsets(static_cast<std::size_t>(n));
  check_mpi(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, ctx.comm()), "MPI_Allgather");
  std::int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    offsets[static_cast<std::size_t>(q)] = static_cast<int>(total);
    total += lengths[static_cast<std::size_t>(q)];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                                   MPI_CHAR, ctx.comm()),
                    "MPI_Allgatherv");
  auto lines_of = [&](int q) {
    std::vector<std::string> lines;
    std::string text = all.substr(static_cast<std::size_t>(offsets[static_cast<std::size_t>(q)]),
                                  static_cast<std::size_t>(lengths[static_cast<std::size_t>(q)]));
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t end = text.find('\n', at);
      lines.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    return lines;
  };
  const std::vector<std::string> reference = lines_of(0);
  for (int q = 1; q < n; ++q) {
    const std::vector<std::string> other = lines_of(q);
    for (std::size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
      const std::string a = i < reference.size() ? reference[i] : "nothing (it has " + std::to_string(reference.size()) + " lines)";
      const std::string b = i < other.size() ? other[i] : "nothing (it has " + std::to_string(other.size()) + " lines)";
      if (a != b)
        throw Error(fmt::format("{}: the ranks' {} differ: rank 0 has {}, rank {} has {} (every rank must "
                                "build the same model)",
                                who, what, a, q, b));
    }
  }
}

}  // namespace detail

/// Sends `t` from `root` to every rank, in place (same shape expected everywhere).
inline void broadcast(const Context& ctx, Tensor& t, int root = 0) {
  REMAT_CHECK(t.defined(), "dist::broadcast: the tensor is undefined");
  detail::check_mpi(MPI_Bcast(t.data(), detail::mpi_count(t.numel(), "broadcast"), MPI_FLOAT, root, ctx.comm()),
                    "MPI_Bcast");
}

/// Every rank gets rank `root`'s parameter values (PyTorch's DDP does this when it is built).
inline void broadcast_parameters(const Context& ctx, const std::vector<Tensor*>& params, int root = 0) {
  no_grad guard;
  for (Tensor* p : params) broadcast(ctx, *p, root);
}

/// This rank's shard of the sum over ranks of `t` (shards as ShardLayout(t.numel(), N) splits
/// the flattened tensor), added in rank order.
inline Tensor reduce_scatter(const Context& ctx, const Tensor& t) {
  REMAT_CHECK(t.defined(), "dist::reduce_scatter: the tensor is undefined");
  const int n = ctx.world_size();
  const ShardLayout shards(t.numel(), n);
  const int mine = shards.counts[static_cast<std::size_t>(ctx.rank())];
  std::vector<int> recv_counts(static_cast<std::size_t>(n), mine), recv_offsets(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) recv_offsets[static_cast<std::size_t>(q)] = q * mine;
  std::vector<float> rows(static_cast<std::size_t>(n) * static_cast<std::size_t>(mine));
  detail::check_mpi(MPI_Alltoallv(t.data(), shards.counts.data(), shards.offsets.data(), MPI_FLOAT, rows.data(),
                                  recv_counts.data(), recv_offsets.data(), MPI_FLOAT, ctx.comm()),
                    "MPI_Alltoallv");
  Tensor out(Shape{mine});
  detail::sum_rows_in_rank_order(rows.data(), n, mine, out.data());
  return out;
}

/// The ranks' shards laid end to end in rank order, as one tensor of `shape` (its element count
/// must be the sum of the shards').
inline Tensor all_gather(const Context& ctx, const Tensor& shard, const Shape& shape) {
  REMAT_CHECK(shard.defined() && shard.dim() == 1, "dist::all_gather: needs a 1-d shard, got {}",
              shard.defined() ? shard.shape() : Shape{});
  const int n = ctx.world_size();
  std::vector<int> counts(static_cast<std::size_t>(n)), offsets(static_cast<std::size_t>(n));
  const int mine = detail::mpi_count(shard.numel(), "all_gather");
  detail::check_mpi(MPI_Allgather(&mine, 1, MPI_INT, counts.data(), 1, MPI_INT, ctx.comm()), "MPI_Allgather");
  std::int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    offsets[static_cast<std::size_t>(q)] = static_cast<int>(total);
    total += counts[static_cast<std::size_t>(q)];
  }
  Tensor out(shape);
  REMAT_CHECK(out.numel() == total, "dist::all_gather: the shards hold {} elements in all, shape {} needs {}", total,
              shape, out.numel());
  detail::check_mpi(MPI_Allgatherv(shard.data(), mine, MPI_FLOAT, out.data(), counts.data(), offsets.data(),
                                   MPI_FLOAT, ctx.comm()),
                    "MPI_Allgatherv");
  return out;
}

/// The sum over ranks of `t`, in place, added in rank order: bitwise the same on every rank and
/// the same bits as ((t_0 + t_1) + t_2) + ... computed in one process.
inline void all_reduce(const Context& ctx, Tensor& t) {
  REMAT_CHECK(t.defined(), "dist::all_reduce: the tensor is undefined");
  no_grad guard;
  const Tensor sum = all_gather(ctx, reduce_scatter(ctx, t), t.shape());
  std::copy(sum.data(), sum.data() + sum.numel(), t.data());
}

}  // namespace remat::dist
