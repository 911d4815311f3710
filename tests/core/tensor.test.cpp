#include <algorithm>

#include "support.hpp"

using namespace remat;

TEST_CASE("tensor: factories fill the values they promise", "[core][tensor]") {
  CHECK(test::values(zeros({2, 2})) == std::vector<float>{0, 0, 0, 0});
  CHECK(test::values(ones<double>({3})) == std::vector<double>{1, 1, 1});
  CHECK(test::values(full({2}, 2.5f)) == std::vector<float>{2.5f, 2.5f});
  CHECK(test::values(arange(4.0f)) == std::vector<float>{0, 1, 2, 3});
  CHECK(test::values(arange(1.0, 2.0, 0.25)) == std::vector<double>{1, 1.25, 1.5, 1.75});
  const Tensor t = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  CHECK(t.shape() == Shape{2, 3});
  CHECK(t.at({1, 0}) == 4.f);
  CHECK(scalar(3.0f).item() == 3.0f);
  CHECK(scalar(3.0f).dim() == 0);
  CHECK(test::values(to<double>(t)) == std::vector<double>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("tensor: bad element access and bad data throw remat::Error", "[core][tensor]") {
  const Tensor t = zeros({2, 3});
  REQUIRE_ERROR(t.at({2, 0}), "index 2", "dim 0", "(2, 3)");
  REQUIRE_ERROR(t.at({0}), "1 indices", "(2, 3)");
  REQUIRE_ERROR(t.item(), "item", "(2, 3)");
  REQUIRE_ERROR(tensor({1.f, 2.f, 3.f}, {2, 2}), "3 values", "(2, 2)");
  REQUIRE_ERROR(Tensor().data(), "undefined");
  REQUIRE_ERROR(t.size(5), "dim 5");
}

TEST_CASE("tensor: copies share data, detach cuts the graph but keeps the data", "[core][tensor]") {
  Tensor a = ones({2}).requires_grad_();
  Tensor b = a;
  b.at({0}) = 7.f;
  CHECK(a.at({0}) == 7.f);
  const Tensor d = a.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.same_storage(a));
  CHECK(a.is_leaf());
}

TEST_CASE("tensor: requires_grad_ only on leaves, only on floating point", "[core][tensor]") {
  Tensor x = ones({2}).requires_grad_();
  Tensor y = x * 2.0f;
  CHECK_FALSE(y.is_leaf());
  REQUIRE_ERROR(y.requires_grad_(), "leaf");
}

TEST_CASE("tensor: prints through fmt with shape, dtype and elision of long dims", "[core][tensor]") {
  const Tensor t = tensor({1.f, 2.f, 3.f, 4.f}, {2, 2});
  CHECK(fmt::format("{}", t) == "tensor([[1, 2],\n        [3, 4]], shape=(2, 2), dtype=float32)");
  const std::string long_row = fmt::format("{}", arange(10.0));
  CHECK(long_row == "tensor([0, 1, 2, ..., 7, 8, 9], shape=(10,), dtype=float64)");
  CHECK(fmt::format("{}", ones({1}).requires_grad_()).find("requires_grad=true") != std::string::npos);
  CHECK(fmt::format("{}", Tensor()) == "tensor(undefined)");
}

TEST_CASE("threads: parallel_for covers every element whatever team OpenMP gives the region",
          "[core][threads]") {
  // CTest runs this case again under OMP_THREAD_LIMIT=1, OMP_DYNAMIC=true and OMP_NUM_THREADS=3:
  // a region may get fewer threads than it asks for, and the split must follow the team it got.
  const int before = get_num_threads();
  for (const int threads : {1, 2, 3, 4}) {
    set_num_threads(threads);
    for (const std::int64_t n : {std::int64_t{65536}, std::int64_t{3 * 32768 + 7}}) {
      INFO(threads << " threads, " << n << " elements");
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      parallel_for(n, kElementGrain, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
      });
      CHECK(std::count(hits.begin(), hits.end(), 1) == n);
      // Inside a user's own parallel region (nested: remat runs the pieces on the calling thread).
      std::vector<int> nested(static_cast<std::size_t>(n), 0);
      REMAT_PRAGMA_OMP(omp parallel num_threads(2))
      {
        REMAT_PRAGMA_OMP(omp single)
        parallel_for(n, kElementGrain, [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t i = b; i < e; ++i) ++nested[static_cast<std::size_t>(i)];
        });
      }
      CHECK(std::count(nested.begin(), nested.end(), 1) == n);
    }
  }
  set_num_threads(before);
}

TEST_CASE("threads: the GEMM thread count can be set and read", "[core][threads]") {
  const int before = get_num_threads();
  set_num_threads(1);
  CHECK(get_num_threads() == 1);
  set_num_threads(before);
  REQUIRE_ERROR(set_num_threads(0), "at least 1");
}
