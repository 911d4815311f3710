// remat::autocast (core/autocast.hpp): float32 products on bfloat16 operands with float32 sums.
// The reference is the same product computed in double from the bfloat16-rounded operands, so what
// is checked is exactly the rule: operands (and, in backward, the output gradient) rounded to
// bfloat16, everything else float32.

#include <array>
#include <cmath>
#include <tuple>

#include "support.hpp"

using namespace remat;

namespace {

/// The values of t rounded to bfloat16, as doubles.
std::vector<double> rounded(const Tensor& t) {
  std::vector<double> out;
  for (float v : t.to_vector()) out.push_back(static_cast<double>(detail::to_float(detail::to_bfloat16(v))));
  return out;
}

/// C = op(A) op(B) for one matrix each, in double, over rounded operands; |products| summed beside.
std::pair<std::vector<double>, std::vector<double>> reference(const std::vector<double>& a, const std::vector<double>& b,
                                                              std::int64_t M, std::int64_t N, std::int64_t K, bool ta,
                                                              bool tb) {
  std::vector<double> c(static_cast<std::size_t>(M * N)), mag(c.size());
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j)
      for (std::int64_t p = 0; p < K; ++p) {
        const double x = a[static_cast<std::size_t>(ta ? p * M + i : i * K + p)];
        const double y = b[static_cast<std::size_t>(tb ? j * K + p : p * N + j)];
        c[static_cast<std::size_t>(i * N + j)] += x * y;
        mag[static_cast<std::size_t>(i * N + j)] += std::abs(x * y);
      }
  return {c, mag};
}

/// dA = dC op(B)ᵀ (stored transposed when A is) and dB = op(A)ᵀ dC for one matrix each, in double,
/// over rounded operands, with |products| summed beside each: {dA, |dA|, dB, |dB|}.
std::array<std::vector<double>, 4> reference_gradients(const std::vector<double>& a, const std::vector<double>& b,
                                                       const std::vector<double>& dc, std::int64_t M, std::int64_t N,
                                                       std::int64_t K, bool ta, bool tb) {
  std::array<std::vector<double>, 4> out{std::vector<double>(a.size()), std::vector<double>(a.size()),
                                         std::vector<double>(b.size()), std::vector<double>(b.size())};
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j)
      for (std::int64_t p = 0; p < K; ++p) {
        const double d = dc[static_cast<std::size_t>(i * N + j)];
        const std::size_t ai = static_cast<std::size_t>(ta ? p * M + i : i * K + p);
        const std::size_t bi = static_cast<std::size_t>(tb ? j * K + p : p * N + j);
        out[0][ai] += d * b[bi];
        out[1][ai] += std::abs(d * b[bi]);
        out[2][bi] += a[ai] * d;
        out[3][bi] += std::abs(a[ai] * d);
      }
  return out;
}

/// Every element of got within float32 summation error of want (K products, |sum| <= mag).
void require_close(const Tensor& got, const std::vector<double>& want, const std::vector<double>& mag, std::int64_t K) {
  const std::vector<float> g = got.to_vector();
  REQUIRE(g.size() == want.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": " << g[i] << " vs " << want[i]);
    REQUIRE(std::abs(static_cast<double>(g[i]) - want[i]) <= 1e-7 * static_cast<double>(K + 2) * mag[i] + 1e-30);
  }
}

/// A product's output under autocast: each element a bfloat16 value, the float32 sum (within float32
/// summation error of want) rounded once to bfloat16 (half an ulp of bfloat16's 8 bits, 2^-8).
void require_rounded_close(const Tensor& got, const std::vector<double>& want, const std::vector<double>& mag,
                           std::int64_t K) {
  const std::vector<float> g = got.to_vector();
  REQUIRE(g.size() == want.size());
  REQUIRE(got.storage()->bfloat16_exact());
  for (std::size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": " << g[i] << " vs " << want[i]);
    REQUIRE(detail::to_float(detail::to_bfloat16(g[i])) == g[i]);
    REQUIRE(std::abs(static_cast<double>(g[i]) - want[i]) <=
            1e-7 * static_cast<double>(K + 2) * mag[i] + std::ldexp(std::abs(want[i]), -8) + 1e-30);
  }
}

}  // namespace

TEST_CASE("autocast: matmul runs on bfloat16 operands with float32 sums, forward and backward", "[ops][autocast]") {
  Generator g(31);
  for (auto [M, N, K, ta, tb] : {std::tuple{5, 7, 9, false, false}, {6, 4, 33, true, false}, {3, 8, 16, false, true},
                                 {9, 5, 12, true, true}}) {
    CAPTURE(M, N, K, ta, tb);
    Tensor a = randn(ta ? Shape{K, M} : Shape{M, K}, g).requires_grad_();
    Tensor b = randn(tb ? Shape{N, K} : Shape{K, N}, g).requires_grad_();
    const Tensor dc = randn({M, N}, g);
    Tensor c;
    {
      autocast on;
      CHECK(is_autocast_enabled());
      c = matmul(a, b, ta, tb);
    }
    CHECK_FALSE(is_autocast_enabled());
    CHECK(std::string(c.dtype()) == "float32");
    c.backward(dc);  // outside the scope, as in PyTorch: the node kept what autocast chose
    const auto [want, mag] = reference(rounded(a), rounded(b), M, N, K, ta, tb);
    require_rounded_close(c, want, mag, K);  // the output is a bfloat16 value, as PyTorch's
    // dA = dC op(B)ᵀ (stored transposed when A is), dB = op(A)ᵀ dC, over rounded dC.
    const auto [da, da_mag, db, db_mag] = reference_gradients(rounded(a), rounded(b), rounded(dc), M, N, K, ta, tb);
    require_close(a.grad(), da, da_mag, N);
    require_close(b.grad(), db, db_mag, M);
  }
}

TEST_CASE("autocast: linear's bias pass, split over threads, is the GEMM's float32 sums plus the bias, rounded once",
          "[ops][autocast]") {
  // 2048 rows of 16: the bias pass takes 512-row pieces, so any team of two or more splits it.
  Generator g(33);
  const std::int64_t rows = 2048, in = 24, out = 16;
  const Tensor x = randn({rows, in}, g), w = randn({out, in}, g), bias = randn({out}, g);
  Tensor y, plain;
  {
    autocast on;
    y = linear(x, w, bias);
  }
  plain = linear(x, w, bias);
  const BFloat16Tensor xb = to<bfloat16>(x), wb = to<bfloat16>(w);
  std::vector<float> sums(static_cast<std::size_t>(rows * out)), plain_sums(sums.size());
  detail::gemm_bf16(false, true, rows, out, in, xb.cdata(), in, wb.cdata(), in, sums.data(), out);
  detail::gemm(false, true, rows, out, in, x.cdata(), in, w.cdata(), in, plain_sums.data(), out);
  const std::vector<float> bv = bias.to_vector(), yv = y.to_vector(), pv = plain.to_vector();
  std::size_t off = 0, plain_off = 0;
  for (std::size_t i = 0; i < sums.size(); ++i) {
    off += yv[i] != detail::to_float(detail::to_bfloat16(sums[i] + bv[i % 16]));
    plain_off += pv[i] != plain_sums[i] + bv[i % 16];
  }
  CHECK(off == 0);
  CHECK(plain_off == 0);
  CHECK(y.storage()->bfloat16_exact());
}

TEST_CASE("autocast: batched and broadcast matmul, and linear with its bias in float32", "[ops][autocast]") {
  Generator g(32);
  Tensor a = randn({2, 3, 4, 8}, g), b = randn({8, 5}, g), w = randn({6, 8}, g), bias = randn({6}, g);
  Tensor c, y;
  {
    autocast on;
    c = matmul(a, b);                                   // folded: one GEMM over all rows
    y = linear(a, w, bias);
  }
  const std::vector<double> ra = rounded(a), rb = rounded(b), rw = rounded(w);
  const auto [want_c, mag_c] = reference(ra, rb, 24, 5, 8, false, false);
  require_rounded_close(c, want_c, mag_c, 8);
  auto [want_y, mag_y] = reference(ra, rw, 24, 6, 8, false, true);
  const std::vector<float> bv = bias.to_vector();
  for (std::size_t i = 0; i < want_y.size(); ++i) {
    want_y[i] += bv[i % 6];  // the bias is not rounded: it is added in float32
    mag_y[i] += std::abs(static_cast<double>(bv[i % 6]));
  }
  require_rounded_close(y, want_y, mag_y, 8);  // the bias added in float32, then the sum rounded once
  Tensor q = randn({2, 3, 4, 8}, g), k = randn({3, 6, 8}, g), s;
  {
    autocast on;
    s = matmul(q, k, false, true);  // batch dims broadcast (2, 3) against (3,)
  }
  const Tensor plain = matmul(q, k, false, true);
  CHECK(s.shape() == plain.shape());
  const std::vector<float> sv = s.to_vector(), pv = plain.to_vector();
  double worst = 0;
  for (std::size_t i = 0; i < sv.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(sv[i] - pv[i])));
  CHECK(worst > 0);      // it did round
  CHECK(worst < 0.1);    // to bfloat16's precision, not worse
}

TEST_CASE("autocast: batched matmul of equal batch dims, every transpose, forward and backward per batch",
          "[ops][autocast]") {
  // Small products of equal batch dims (attention heads): one batched product on the matmul
  // primitive's engine, one product per batch on the others; each batch is checked on its own.
  INFO("bfloat16 GEMM backend: " << detail::gemm_bf16_backend());
  Generator g(33);
  const std::int64_t B = 2, H = 3, M = 8, N = 6, K = 16;
  for (auto [ta, tb] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    CAPTURE(ta, tb);
    Tensor a = randn(ta ? Shape{B, H, K, M} : Shape{B, H, M, K}, g).requires_grad_();
    Tensor b = randn(tb ? Shape{B, H, N, K} : Shape{B, H, K, N}, g).requires_grad_();
    const Tensor dc = randn({B, H, M, N}, g);
    Tensor c;
    {
      autocast on;
      c = matmul(a, b, ta, tb);
    }
    c.backward(dc);
    REQUIRE(c.storage()->bfloat16_exact());
    const std::vector<double> ra = rounded(a), rb = rounded(b), rdc = rounded(dc);
    const std::vector<float> cv = c.to_vector(), gav = a.grad().to_vector(), gbv = b.grad().to_vector();
    // got[offset + j] within float32 summation error of want[j] (and, for the output, its rounding).
    auto require_batch_close = [](const std::vector<float>& got, std::int64_t offset, const std::vector<double>& want,
                                  const std::vector<double>& mag, std::int64_t k, bool output) {
      for (std::size_t j = 0; j < want.size(); ++j) {
        const double x = got[static_cast<std::size_t>(offset) + j];
        INFO("element " << j << ": " << x << " vs " << want[j]);
        REQUIRE(std::abs(x - want[j]) <= 1e-7 * static_cast<double>(k + 2) * mag[j] +
                                             (output ? std::ldexp(std::abs(want[j]), -8) : 0.0) + 1e-30);
      }
    };
    for (std::int64_t i = 0; i < B * H; ++i) {
      CAPTURE(i);
      auto slice = [&](const auto& v, std::int64_t size) {
        return std::vector<double>(v.begin() + i * size, v.begin() + (i + 1) * size);
      };
      const std::vector<double> ai = slice(ra, M * K), bi = slice(rb, K * N), dci = slice(rdc, M * N);
      const auto [want, mag] = reference(ai, bi, M, N, K, ta, tb);
      require_batch_close(cv, i * M * N, want, mag, K, true);
      const auto [da, da_mag, db, db_mag] = reference_gradients(ai, bi, dci, M, N, K, ta, tb);
      require_batch_close(gav, i * M * K, da, da_mag, N, false);
      require_batch_close(gbv, i * K * N, db, db_mag, M, false);
    }
  }
}

TEST_CASE("autocast: what products save for backward is the bfloat16 copies, half the bytes", "[ops][autocast]") {
  Generator g(33);
  Tensor x = randn({64, 32}, g).requires_grad_(), w = randn({16, 32}, g).requires_grad_();
  auto saved_by = [&](bool on) {
    const std::size_t before = memory_stats().saved_bytes;
    autocast scope(on);
    Tensor y = linear(x, w);
    const std::size_t saved = memory_stats().saved_bytes - before;
    sum(y).backward();
    return saved;
  };
  const std::size_t fp32 = saved_by(false), bf16 = saved_by(true);
  CHECK(fp32 == (64 * 32 + 16 * 32) * sizeof(float));
  CHECK(bf16 == (64 * 32 + 16 * 32) * 2);
}

TEST_CASE("autocast: a node that saves a product's output keeps it in 16 bits, at no loss", "[ops][autocast]") {
  Generator g(35);
  const Tensor x = randn({64, 32}, g), w = randn({48, 32}, g), b = randn({48}, g);
  Tensor y;
  {
    autocast on;
    y = linear(x, w, b);
  }
  REQUIRE(y.storage()->bfloat16_exact());
  // GELU saves its input: the product's output in 16 bits, or, for the same values in a storage not
  // marked so, in 32; the gradients are the same bits.
  auto gelu_of = [](const Tensor& input, std::size_t* saved) {
    Tensor in = input.detach().requires_grad_();
    const std::size_t before = memory_stats().saved_bytes;
    Tensor z = gelu(in);
    *saved = memory_stats().saved_bytes - before;
    sum(z * z).backward();
    return in.grad();
  };
  std::size_t narrow = 0, wide = 0;
  const Tensor g16 = gelu_of(y, &narrow);                    // y.detach() shares the marked storage
  const Tensor g32 = gelu_of(detail::copy_of(y), &wide);     // a fresh storage: not marked
  CHECK(narrow == 64 * 48 * 2);
  CHECK(wide == 64 * 48 * sizeof(float));
  CHECK(test::all_close(g16, g32));
  // print_saved_tensors shows the 16-bit copy.
  {
    test::FreshTape fresh;
    Tensor in = y.detach().requires_grad_();
    Tensor z = gelu(in);
    CHECK(saved_tensors(fresh.tape).str().find("bfloat16") != std::string::npos);
  }
  // A write in place after the save is the usual error; before it, the values are no longer known to
  // be bfloat16 ones, and the node keeps float32.
  {
    test::FreshTape fresh;
    Tensor in = detail::copy_of(y);
    in.storage()->mark_bfloat16_exact();
    in.requires_grad_();
    Tensor z = gelu(in);
    in.data()[0] += 1.0f;
    in.storage()->bump_version();
    REQUIRE_ERROR(sum(z).backward(), "modified in place");
  }
  {
    test::FreshTape fresh;
    Tensor in = detail::copy_of(y);
    in.storage()->mark_bfloat16_exact();
    in.storage()->bump_version();  // written since it was marked
    in.requires_grad_();
    const std::size_t before = memory_stats().saved_bytes;
    Tensor z = gelu(in);
    CHECK(memory_stats().saved_bytes - before == 64 * 48 * sizeof(float));
  }
}

TEST_CASE("autocast: double tensors and a disabled region compute exactly as without it", "[ops][autocast]") {
  Generator g(34);
  const DoubleTensor a = to<double>(randn({5, 6}, g)), b = to<double>(randn({6, 3}, g));
  const Tensor x = randn({5, 6}, g), y = randn({6, 3}, g);
  const DoubleTensor plain = matmul(a, b);
  const Tensor plain_f = matmul(x, y);
  autocast on;
  CHECK(matmul(a, b).to_vector() == plain.to_vector());
  {
    autocast off(false);
    CHECK_FALSE(is_autocast_enabled());
    CHECK(matmul(x, y).to_vector() == plain_f.to_vector());
  }
  CHECK(matmul(x, y).to_vector() != plain_f.to_vector());
}

namespace {

/// y and the gradients of causal attention in double, from q, k, v (B, H, T, D) as doubles, dy
/// the output gradient: P = softmax(mask(q kᵀ / √D)), y = P v, and the backward formulas. Beside
/// y, Σ_j P_ij |v_jc|: the bound on what rounding P to bfloat16 (relative 2⁻⁸) can move y by.
struct AttentionReference {
  std::vector<double> y, y_mag, dq, dk, dv;
};

AttentionReference attention_reference(const std::vector<double>& q, const std::vector<double>& k,
                                       const std::vector<double>& v, const std::vector<double>& dy, std::int64_t BH,
                                       std::int64_t T, std::int64_t D) {
  AttentionReference r;
  const auto n = static_cast<std::size_t>(BH * T * D);
  r.y.assign(n, 0), r.y_mag.assign(n, 0), r.dq.assign(n, 0), r.dk.assign(n, 0), r.dv.assign(n, 0);
  const double a = 1.0 / std::sqrt(static_cast<double>(D));
  auto at = [&](std::int64_t bh, std::int64_t i, std::int64_t c) { return static_cast<std::size_t>((bh * T + i) * D + c); };
  for (std::int64_t bh = 0; bh < BH; ++bh)
    for (std::int64_t i = 0; i < T; ++i) {
      std::vector<double> p(static_cast<std::size_t>(i + 1)), dp(p.size());
      double m = -1e300, z = 0, rowdot = 0;
      for (std::int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (std::int64_t c = 0; c < D; ++c) s += q[at(bh, i, c)] * k[at(bh, j, c)];
        p[static_cast<std::size_t>(j)] = s * a;
        m = std::max(m, s * a);
      }
      for (double& e : p) z += (e = std::exp(e - m));
      for (std::int64_t j = 0; j <= i; ++j) {
        const double pj = p[static_cast<std::size_t>(j)] /= z;
        double d = 0;
        for (std::int64_t c = 0; c < D; ++c) {
          r.y[at(bh, i, c)] += pj * v[at(bh, j, c)];
          r.y_mag[at(bh, i, c)] += pj * std::abs(v[at(bh, j, c)]);
          r.dv[at(bh, j, c)] += pj * dy[at(bh, i, c)];
          d += dy[at(bh, i, c)] * v[at(bh, j, c)];
        }
        dp[static_cast<std::size_t>(j)] = d;
        rowdot += d * pj;
      }
      for (std::int64_t j = 0; j <= i; ++j) {
        const double ds = p[static_cast<std::size_t>(j)] * (dp[static_cast<std::size_t>(j)] - rowdot) * a;
        for (std::int64_t c = 0; c < D; ++c) {
          r.dq[at(bh, i, c)] += ds * k[at(bh, j, c)];
          r.dk[at(bh, j, c)] += ds * q[at(bh, i, c)];
        }
      }
    }
  return r;
}

/// The largest |got − want| relative to the largest |want|.
double relative_error(const Tensor& got, const std::vector<double>& want) {
  const std::vector<float> g = got.to_vector();
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(g[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return worst / scale;
}

}  // namespace

TEST_CASE("autocast: the fused attention's products run in bfloat16, its softmax in float32", "[ops][autocast]") {
  Generator g(35);
  const std::int64_t B = 2, H = 3, T = 17, D = 16;
  Tensor q = randn({B, H, T, D}, g).requires_grad_(), k = randn({B, H, T, D}, g).requires_grad_(),
         v = randn({B, H, T, D}, g).requires_grad_();
  const Tensor dy = randn({B, H, T, D}, g);
  const std::size_t before = memory_stats().saved_bytes;
  Tensor y;
  {
    autocast on;
    y = causal_attention(q, k, v);
  }
  const std::size_t saved = memory_stats().saved_bytes - before;
  CHECK(saved == static_cast<std::size_t>(3 * B * H * T * D * 2 + B * H * T * 4));  // q, k, v narrowed; the lse float32
  y.backward(dy);
  // Against double arithmetic on the rounded q, k, v (and dy): y moves only by rounding P before
  // P v, at most 2⁻⁸ of Σ_j P_ij |v_j| (plus float32 sums), and by rounding y itself to bfloat16,
  // at most 2⁻⁹ of |y| ≤ Σ_j P_ij |v_j|; float32 products and output would be far closer.
  const AttentionReference r = attention_reference(rounded(q), rounded(k), rounded(v), rounded(dy), B * H, T, D);
  const std::vector<float> yv = y.to_vector();
  double worst_share = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) {
    const double err = std::abs(static_cast<double>(yv[i]) - r.y[i]);
    INFO("y element " << i << ": " << yv[i] << " vs " << r.y[i]);
    REQUIRE(err <= (std::ldexp(1.0, -8) + std::ldexp(1.0, -9)) * r.y_mag[i] + 1e-5 * r.y_mag[i]);
    REQUIRE(detail::to_float(detail::to_bfloat16(yv[i])) == yv[i]);  // a bfloat16 value, as matmul's output
    worst_share = std::max(worst_share, err / r.y_mag[i]);
  }
  CHECK(worst_share > 1e-4);  // P was rounded (float32 P would leave ~1e-7)
  // The gradients: dS and Pd rounded too, each a relative 2⁻⁸ of terms of the size of the largest.
  CHECK(relative_error(q.grad(), r.dq) < 0.02);
  CHECK(relative_error(k.grad(), r.dk) < 0.02);
  CHECK(relative_error(v.grad(), r.dv) < 0.02);
  CHECK(relative_error(v.grad(), r.dv) > 1e-4);

  // The packed form is bitwise the separate one under autocast, as without it, dropout on.
  const Tensor qkv = randn({B, T, 3 * H * D}, g);
  const auto parts = split(qkv, H * D, -1);
  auto heads = [&](const Tensor& t) { return permute(reshape(t, {B, T, H, D}), {0, 2, 1, 3}); };
  Generator g1(5), g2(5);
  autocast on;
  const Tensor packed = causal_self_attention(qkv, H, 0.1, true, g1);
  const Tensor separate = reshape(permute(causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), 0.1, true, g2),
                                          {0, 2, 1, 3}),
                                  {B, T, H * D});
  CHECK(packed.to_vector() == separate.to_vector());
}
