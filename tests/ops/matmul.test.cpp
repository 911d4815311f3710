#include "support.hpp"

using namespace remat;

TEST_CASE("matmul: 2-D product matches the hand computation", "[ops][matmul]") {
  const Tensor a = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  const Tensor b = tensor({1.f, 0.f, 0.f, 1.f, 1.f, 1.f}, {3, 2});
  CHECK(test::values(matmul(a, b)) == std::vector<float>{4, 5, 10, 11});
}

TEST_CASE("matmul: batched and broadcast batches equal per-batch products", "[ops][matmul]") {
  Generator g(3);
  const DoubleTensor a = randn<double>({2, 3, 4, 5}, g);
  const DoubleTensor b = randn<double>({3, 5, 2}, g);
  const DoubleTensor c = matmul(a, b);
  REQUIRE(c.shape() == Shape{2, 3, 4, 2});
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t j = 0; j < 3; ++j) {
      const DoubleTensor ai = reshape(narrow(narrow(a, 0, i, 1), 1, j, 1), {4, 5});
      const DoubleTensor bj = reshape(narrow(b, 0, j, 1), {5, 2});
      const DoubleTensor cij = reshape(narrow(narrow(c, 0, i, 1), 1, j, 1), {4, 2});
      CHECK(test::all_close(matmul(ai, bj), cij, 1e-12));
    }
  // (..., M, K) @ (K, N) folds the leading dims into one GEMM.
  const DoubleTensor w = randn<double>({5, 3}, g);
  const DoubleTensor folded = matmul(a, w);
  CHECK(folded.shape() == Shape{2, 3, 4, 3});
  CHECK(test::all_close(reshape(folded, {24, 3}), matmul(reshape(a, {24, 5}), w), 1e-12));
}

TEST_CASE("matmul: backward matches finite differences in every layout", "[ops][matmul]") {
  auto mm = [](test::Inputs x) { return matmul(x[0], x[1]); };
  test::require_gradcheck(mm, {randn<double>({3, 4}), randn<double>({4, 2})});
  test::require_gradcheck(mm, {randn<double>({2, 3, 4}), randn<double>({4, 2})});
  test::require_gradcheck(mm, {randn<double>({2, 3, 4}), randn<double>({2, 4, 2})});
  test::require_gradcheck(mm, {randn<double>({2, 1, 3, 4}), randn<double>({3, 4, 2})});
  test::require_gradcheck(mm, {randn<double>({3, 4}), randn<double>({2, 4, 2})});
}

TEST_CASE("matmul: transposition flags read an operand transposed, equal to transposing it first, with "
          "gradients in every layout", "[ops][matmul]") {
  Generator g(8);
  // (A layout, B layout) pairs, stored as the flags say: batched, broadcast, folded (2-D B).
  struct Case { Shape a, b; bool ta, tb; };
  const std::vector<Case> cases{
      {{2, 3, 4, 5}, {2, 3, 6, 5}, false, true},  // q kᵀ
      {{2, 3, 5, 4}, {2, 3, 5, 6}, true, false},  // Pᵀ dY
      {{2, 5, 4}, {2, 6, 5}, true, true},
      {{2, 1, 5, 4}, {3, 5, 6}, true, false},      // both broadcast
      {{2, 3, 4, 5}, {6, 5}, false, true},         // folds: one GEMM against Bᵀ as stored
      {{5, 4}, {2, 5, 6}, true, false},            // 2-D A broadcast over B's batch
      {{2, 5, 4}, {5, 6}, true, false},            // 2-D B, A transposed: batched, B shared
  };
  for (const Case& c : cases) {
    INFO(fmt::format("A {}{} B {}{}", c.a, c.ta ? "ᵀ" : "", c.b, c.tb ? "ᵀ" : ""));
    const DoubleTensor a = randn<double>(c.a, g), b = randn<double>(c.b, g);
    const DoubleTensor reference =
        matmul(c.ta ? transpose(a, -2, -1) : a, c.tb ? transpose(b, -2, -1) : b);
    CHECK(test::all_close(matmul(a, b, c.ta, c.tb), reference, 1e-12));
    test::require_gradcheck([&](test::Inputs x) { return matmul(x[0], x[1], c.ta, c.tb); }, {a, b});
  }
  // In float, q kᵀ read transposed in place agrees with the product of a transposed copy, gradients
  // included (the GEMM may order its sums differently for the two layouts, so to rounding).
  Tensor q = randn({2, 4, 9, 8}, g).requires_grad_(), k = randn({2, 4, 9, 8}, g).requires_grad_();
  Tensor q2 = q.detach().requires_grad_(), k2 = k.detach().requires_grad_();
  const Tensor w = randn({2, 4, 9, 9}, g);
  const Tensor flags = matmul(q, k, false, true), copied = matmul(q2, transpose(k2, -2, -1));
  CHECK(test::all_close(flags, copied, 1e-5));
  sum(flags * w).backward();
  sum(copied * w).backward();
  CHECK(test::all_close(q.grad(), q2.grad(), 1e-5));
  CHECK(test::all_close(k.grad(), k2.grad(), 1e-5));
}

TEST_CASE("matmul: mismatched inner dims and rank-1 inputs throw", "[ops][matmul]") {
  REQUIRE_ERROR(matmul(zeros({2, 3}), zeros({4, 2})), "matmul", "(2, 3)", "(4, 2)", "inner");
  REQUIRE_ERROR(matmul(zeros({3}), zeros({3, 2})), "matmul", "rank");
  REQUIRE_ERROR(matmul(zeros({2, 2, 3}), zeros({3, 3, 2})), "matmul", "broadcast");
  REQUIRE_ERROR(matmul(zeros({2, 3}), zeros({2, 4}), false, true), "matmul", "(2, 4)ᵀ", "inner");
}

TEST_CASE("gemm: the float backend gives the same bits for the same operands wherever they live, and agrees "
          "with double", "[ops][matmul]") {
  INFO("float GEMM backend: " << detail::gemm_backend());
  const std::int64_t m = 67, n = 131, k = 259;  // odd sizes: every kernel's edge paths
  Generator g(3);
  const std::vector<float> a = randn({m * k + 1}, g).to_vector(), b = randn({k * n + 1}, g).to_vector();
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      INFO("transposes " << ta << " " << tb);
      const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
      std::vector<float> c1(static_cast<std::size_t>(m * n)), c2(static_cast<std::size_t>(m * n + 1));
      detail::gemm(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, c1.data(), n);
      // The same values one float further on: other alignment, other addresses.
      std::vector<float> a2(a.size() + 1), b2(b.size() + 1);
      std::copy(a.begin(), a.end() - 1, a2.begin() + 1);
      std::copy(b.begin(), b.end() - 1, b2.begin() + 1);
      detail::gemm(ta, tb, m, n, k, a2.data() + 1, lda, b2.data() + 1, ldb, c2.data() + 1, n);
      CHECK(std::equal(c1.begin(), c1.end(), c2.begin() + 1));
      // Against the product in double.
      std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end()), cd(static_cast<std::size_t>(m * n));
      detail::gemm(ta, tb, m, n, k, ad.data(), lda, bd.data(), ldb, cd.data(), n);
      double worst = 0;
      for (std::size_t i = 0; i < cd.size(); ++i) worst = std::max(worst, std::abs(cd[i] - c1[i]) / (1 + std::abs(cd[i])));
      CHECK(worst < 1e-4);
      // Accumulating adds the same product again.
      std::vector<float> acc = c1;
      detail::gemm(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, acc.data(), n, /*accumulate=*/true);
      for (std::size_t i = 0; i < acc.size(); i += 97) CHECK(acc[i] == Approx(2 * c1[i]).margin(1e-4));
    }
}
