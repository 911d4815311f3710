#pragma once
// Matrix product on Eigen's GEMM (multi-threaded with OpenMP), 2-D and batched.

#include <array>

#include "remat/core/autocast.hpp"
#include "remat/core/gemm.hpp"
#include "remat/core/produce.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/reshape.hpp"
#include "remat/ops/detail/broadcast.hpp"
#include "remat/ops/detail/dtype.hpp"

namespace remat {
/// Op identities (OpId), one registered constant per op (op::matmul, op::softmax, ...), by which
/// policies and reports name ops.
namespace op {
/// The id of matmul(a, b): the matrix product over the last two dims, batched.
inline const OpId matmul = register_op("matmul", tangent_rule);
}  // namespace op

namespace detail {

/// Batch dims of a (..., M, K) @ (..., K, N) product: the broadcast of both batch shapes, and for
/// each operand the element offset of every output batch.
struct MatmulBatches {
  Shape batch;  // broadcast batch shape, rank 0 to 2
  std::vector<std::int64_t> a_offset, b_offset;
  bool broadcast = false;  // an operand's batch dims were broadcast: batches share its matrices
};

/// Products at most this many multiply-adds (M·N·K) are too small to split across threads: a
/// batch of them runs one product per thread at a time instead (the batched products of attention
/// heads, 64×64×32 in the benchmark's deep GPT, cost less than the GEMM's own fork and join).
inline constexpr std::int64_t kSmallGemm = std::int64_t{1} << 21;

/// f(i) for every batch i: spread over threads when the products are small and independent (no
/// operand broadcast, so no two batches write one gradient), one after another otherwise (each
/// product then uses every thread itself). Each product's bits do not depend on which is chosen.
template <class F>
void for_each_batch(const MatmulBatches& m, std::int64_t work, F f) {
  const auto n = static_cast<std::int64_t>(m.a_offset.size());
  if (!m.broadcast && work <= kSmallGemm) {
    parallel_for(n, 1, [&](std::int64_t b0, std::int64_t b1) {
      for (std::int64_t i = b0; i < b1; ++i) f(i);
    });
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

inline MatmulBatches matmul_batches(const Shape& a, const Shape& b) {
  const Shape ba = Shape(std::vector<std::int64_t>(a.begin(), a.end() - 2));
  const Shape bb = Shape(std::vector<std::int64_t>(b.begin(), b.end() - 2));
  MatmulBatches m;
  m.batch = broadcast_shape(ba, bb, "matmul");
  const std::int64_t a_mat = a[a.rank() - 2] * a[a.rank() - 1], b_mat = b[b.rank() - 2] * b[b.rank() - 1];
  const auto n = padded_sizes(m.batch);
  const auto sa = broadcast_strides(ba, m.batch), sb = broadcast_strides(bb, m.batch);
  m.broadcast = !(ba == m.batch && bb == m.batch);
  for (std::int64_t i2 = 0; i2 < n[2]; ++i2)
    for (std::int64_t i3 = 0; i3 < n[3]; ++i3) {
      m.a_offset.push_back((i2 * sa[2] + i3 * sa[3]) * a_mat);
      m.b_offset.push_back((i2 * sb[2] + i3 * sb[3]) * b_mat);
    }
  return m;
}

}  // namespace detail

template <class T>
BasicTensor<T> matmul(const BasicTensor<T>& a, const BasicTensor<T>& b, bool transpose_a, bool transpose_b);

namespace detail {

/// out = (or += when `accumulate`) op(A) op(B) over operands in element type E, batched, or folded
/// into one GEMM when B is 2-D and A not transposed: matmul's forward, and forward mode's tangent
/// dA op(B) + op(A) dB summed in one buffer (the second GEMM adds into the first's output). `known`:
/// matmul_batches(a, b), when the caller has it.
template <class E, class T>
void matmul_into(const BasicTensor<E>& a, const BasicTensor<E>& b, bool ta, bool tb, T* out, bool accumulate,
                 const MatmulBatches* known = nullptr) {
  const std::int64_t M = a.size(ta ? -1 : -2), K = a.size(ta ? -2 : -1), N = b.size(tb ? -2 : -1);
  const std::int64_t lda = ta ? M : K, ldb = tb ? K : N;
  if (b.dim() == 2 && !ta) {
    std::int64_t rows = 1;  // all of A's leading dims, folded
    for (int d = 0; d + 1 < a.dim(); ++d) rows *= a.size(d);
    gemm(false, tb, rows, N, K, a.cdata(), K, b.cdata(), ldb, out, N, accumulate);
    return;
  }
  MatmulBatches computed;
  const MatmulBatches& batches = known ? *known : (computed = matmul_batches(a.shape(), b.shape()));
  const E* pa = a.cdata();
  const E* pb = b.cdata();
  if constexpr (std::is_same_v<E, bfloat16>) {
    if (!batches.broadcast && bf16_batches_at_once(M, N, K)) {  // one batched primitive
      const auto n = static_cast<std::int64_t>(batches.a_offset.size());
      gemm_bf16_batched(ta, tb, n, M, N, K, pa, lda, M * K, pb, ldb, K * N, out, N, M * N, accumulate);
      return;
    }
  }
  for_each_batch(batches, M * N * K, [&](std::int64_t i) {
    const auto u = static_cast<std::size_t>(i);
    gemm(ta, tb, M, N, K, pa + batches.a_offset[u], lda, pb + batches.b_offset[u], ldb, out + i * M * N, N, accumulate);
  });
}

/// matmul over operands in element type E (T itself, or bfloat16 under autocast): ae and be are a
/// and b as the GEMM reads them, and what the node saves.
template <class T, class E>
BasicTensor<T> matmul_with(const BasicTensor<T>& a, const BasicTensor<T>& b, const BasicTensor<E>& ae,
                           const BasicTensor<E>& be, bool ta, bool tb) {
  const std::int64_t M = a.size(ta ? -1 : -2), K = a.size(ta ? -2 : -1), N = b.size(tb ? -2 : -1);
  const std::int64_t lda = ta ? M : K, ldb = tb ? K : N;  // row lengths of A and B as stored
  const bool fold = b.dim() == 2 && !ta;  // (..., M, K) @ op(B): one GEMM over all rows of A
  detail::MatmulBatches batches;
  Shape out_shape;
  if (fold) {
    std::vector<std::int64_t> s = a.shape().vec();
    s.back() = N;
    out_shape = Shape(s);
  } else {
    batches = detail::matmul_batches(a.shape(), b.shape());
    std::vector<std::int64_t> s = batches.batch.vec();
    s.push_back(M);
    s.push_back(N);
    out_shape = Shape(s);
  }
  const double flops = 2.0 * static_cast<double>(out_shape.numel()) * static_cast<double>(K);
  BasicTensor<T> c = detail::produce<T>(op::matmul, out_shape, flops, {ae, be}, [=] {  // the operands as read
    BasicTensor<T> out(out_shape);
    detail::matmul_into(ae, be, ta, tb, out.data(), false, &batches);
    if constexpr (!std::is_same_v<E, T>) detail::round_product_output(out);
    return out;
  });
  if (detail::grad_needed(a, b)) {
    const bool da = a.requires_grad(), db = b.requires_grad();
    std::vector<detail::SavedTensor> saved;
    if (da) saved.emplace_back(be);
    if (db) saved.emplace_back(ae);
    detail::record<T>(
        op::matmul, {a, b}, {&c}, std::move(saved),
        [da, db, ta, tb, fold, batches, sa = a.shape(), sb = b.shape(), M, K, N, lda, ldb](detail::BackwardContext<T>& ctx) {
          if constexpr (std::is_same_v<E, T>) {
            if (ctx.create_graph()) {
              // The same products as below, recorded: each matmul here makes the GEMM call the
              // array path makes (a folded dB through (rows, K) and (rows, N) views).
              const BasicTensor<T>& dc = ctx.grad_output();
              if (da) {
                const BasicTensor<T> bv = ctx.as_input(1, ctx.saved(0));
                ctx.accumulate(0, sum_to_size(ta ? matmul(bv, dc, tb, true) : matmul(dc, bv, false, !tb), sa));
              }
              if (db) {
                BasicTensor<T> av = ctx.as_input(0, ctx.saved(da ? 1 : 0)), dcv = dc;
                if (fold) {
                  av = reshape(av, {sa.numel() / K, K});
                  dcv = reshape(dc, {sa.numel() / K, N});
                }
                ctx.accumulate(1, sum_to_size(tb ? matmul(dcv, av, true, ta) : matmul(av, dcv, !ta, false), sb));
              }
              return;
            }
          }
          const BasicTensor<E> dc = detail::as_operand<E>(ctx.grad_output());
          const BasicTensor<E> bv = da ? ctx.template saved<E>(0) : BasicTensor<E>();
          const BasicTensor<E> av = db ? ctx.template saved<E>(da ? 1 : 0) : BasicTensor<E>();
          // One product's gradients, as stored: dA = dC op(B)ᵀ, or its transpose op(B) dCᵀ when A
          // is stored transposed; dB = op(A)ᵀ dC, or dCᵀ op(A) when B is.
          auto grad_a = [&](std::int64_t m, const E* dci, const E* bi, T* gai, bool accumulate) {
            if (ta) detail::gemm(tb, true, K, m, N, bi, ldb, dci, N, gai, lda, accumulate);
            else detail::gemm(false, !tb, m, K, N, dci, N, bi, ldb, gai, lda, accumulate);
          };
          auto grad_b = [&](std::int64_t m, const E* dci, const E* ai, T* gbi, bool accumulate) {
            if (tb) detail::gemm(true, ta, N, K, m, dci, N, ai, lda, gbi, ldb, accumulate);
            else detail::gemm(!ta, false, K, N, m, ai, lda, dci, N, gbi, ldb, accumulate);
          };
          if (fold) {
            const std::int64_t rows = sa.numel() / K;
            BasicTensor<T> ga = da ? BasicTensor<T>(sa) : BasicTensor<T>();
            BasicTensor<T> gb = db ? BasicTensor<T>(sb) : BasicTensor<T>();
            const E* pdc = dc.cdata();
            const E* pbv = da ? bv.cdata() : nullptr;
            const E* pav = db ? av.cdata() : nullptr;
            T* pga = da ? ga.data() : nullptr;
            T* pgb = db ? gb.data() : nullptr;
            if (da && db)  // two products of rows·K·N multiply-adds: a pair, at once when small
              detail::gemm_pair(rows * K * N, [&] { grad_a(rows, pdc, pbv, pga, false); },
                                [&] { grad_b(rows, pdc, pav, pgb, false); });
            else if (da)
              grad_a(rows, pdc, pbv, pga, false);
            else
              grad_b(rows, pdc, pav, pgb, false);
            if (da) ctx.accumulate(0, std::move(ga));
            if (db) ctx.accumulate(1, std::move(gb));
            return;
          }
          // Batches that share an operand's matrix (broadcast) sum their gradients into it; without
          // a broadcast each batch writes its own slice once, so nothing is zeroed first.
          const bool sums = batches.broadcast;
          BasicTensor<T> ga, gb;
          if (da) {
            ga = BasicTensor<T>(sa);
            if (sums) detail::flat(ga).setZero();
          }
          if (db) {
            gb = BasicTensor<T>(sb);
            if (sums) detail::flat(gb).setZero();
          }
          const E* pdc = dc.cdata();
          const E* pbv = da ? bv.cdata() : nullptr;
          const E* pav = db ? av.cdata() : nullptr;
          T* pga = da ? ga.data() : nullptr;
          T* pgb = db ? gb.data() : nullptr;
          if constexpr (std::is_same_v<E, bfloat16>) {
            if (!sums && detail::bf16_batches_at_once(M, N, K)) {  // each gradient one batched primitive
              const auto n = static_cast<std::int64_t>(batches.a_offset.size());
              if (da) {
                if (ta) detail::gemm_bf16_batched(tb, true, n, K, M, N, pbv, ldb, K * N, pdc, N, M * N, pga, lda, M * K);
                else detail::gemm_bf16_batched(false, !tb, n, M, K, N, pdc, N, M * N, pbv, ldb, K * N, pga, lda, M * K);
              }
              if (db) {
                if (tb) detail::gemm_bf16_batched(true, ta, n, N, K, M, pdc, N, M * N, pav, lda, M * K, pgb, ldb, K * N);
                else detail::gemm_bf16_batched(!ta, false, n, K, N, M, pav, lda, M * K, pdc, N, M * N, pgb, ldb, K * N);
              }
              if (da) ctx.accumulate(0, std::move(ga));
              if (db) ctx.accumulate(1, std::move(gb));
              return;
            }
          }
          detail::for_each_batch(batches, M * N * K, [&](std::int64_t i) {
            const auto u = static_cast<std::size_t>(i);
            const E* dci = pdc + i * M * N;
            if (da) grad_a(M, dci, pbv + batches.b_offset[u], pga + batches.a_offset[u], sums);
            if (db) grad_b(M, dci, pav + batches.a_offset[u], pgb + batches.b_offset[u], sums);
          });
          if (da) ctx.accumulate(0, std::move(ga));
          if (db) ctx.accumulate(1, std::move(gb));
        });
  }
  return c;
}

}  // namespace detail

/// C = op(A) op(B) over the last two dims, op transposing those two dims when its flag is set,
/// without a copy (the GEMM reads the operand transposed): op(A) (..., M, K), op(B) (..., K, N)
/// -> (..., M, N); batch dims broadcast. q kᵀ is matmul(q, k, false, true), what PyTorch's
/// q @ k.transpose(-2, -1) computes on a strided view. When B is 2-D and A not transposed, A's
/// leading dims fold into one (M·batch, K) GEMM.
/// dA = dC op(B)ᵀ (transposed back when A was), dB = op(A)ᵀ dC (likewise), each summed over the
/// batch dims its operand was broadcast along.
/// Saves: B if A needs a gradient, A if B does.
/// Under autocast (float32): the products on bfloat16 copies of A, B and dC with float32 sums, the
/// output rounded to bfloat16 values, the copies saved.
/// Dtype: float32, float64; bfloat16 computes in float32, rounds the result (ops/detail/dtype.hpp).
template <class T>
BasicTensor<T> matmul(const BasicTensor<T>& a, const BasicTensor<T>& b, bool transpose_a, bool transpose_b) {
  if constexpr (detail::routed<T>())
    return detail::route([=](const auto& x, const auto& y) { return remat::matmul(x, y, transpose_a, transpose_b); }, a,
                         b);
  else {
    REMAT_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: needs tensors of rank >= 2, got shapes {} and {}",
                a.shape(), b.shape());
    const bool ta = transpose_a, tb = transpose_b;
    const std::int64_t K = a.size(ta ? -2 : -1);
    REMAT_CHECK(b.size(tb ? -1 : -2) == K,
                "matmul: inner dims differ: {}{} @ {}{} (A contributes {} to the product's inner dim, B {})", a.shape(),
                ta ? "ᵀ" : "", b.shape(), tb ? "ᵀ" : "", K, b.size(tb ? -1 : -2));
    BasicTensor<T> c;
    if constexpr (detail::kAutocasts<T>) {
      if (is_autocast_enabled())
        c = detail::matmul_with<T, bfloat16>(a, b, detail::autocast_operand(a), detail::autocast_operand(b), ta, tb);
    }
    if (!c.defined()) c = detail::matmul_with<T, T>(a, b, a, b, ta, tb);
    // The tangent: bilinear, dA op(B) + op(A) dB with the same transposes.
    detail::push_tangent(c, [&](const BasicTensor<T>& da, const BasicTensor<T>& db) {
      if constexpr (detail::kAutocasts<T>) {
        if (is_autocast_enabled())  // the products as the forward's, on bfloat16 copies
          return detail::tangent_sum(da.defined() ? matmul(da, b, ta, tb) : BasicTensor<T>(),
                                     db.defined() ? matmul(a, db, ta, tb) : BasicTensor<T>());
      }
      BasicTensor<T> t(c.shape());
      if (da.defined()) detail::matmul_into(da, b, ta, tb, t.data(), false);
      if (db.defined()) detail::matmul_into(a, db, ta, tb, t.data(), da.defined());
      return t;
    }, a, b);
    return c;
  }
}

/// C = A B over the last two dims: A (..., M, K), B (..., K, N) -> (..., M, N), as torch.matmul
/// for rank >= 2 (see the four-argument form).
template <class T>
BasicTensor<T> matmul(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return matmul(a, b, false, false);
}

}  // namespace remat
