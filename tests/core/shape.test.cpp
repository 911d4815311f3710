#include "support.hpp"

using namespace remat;

TEST_CASE("shape: sizes, strides and numel of a row-major shape", "[core][shape]") {
  const Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.stride(0) == 12);
  CHECK(s.stride(2) == 1);
  CHECK(s.outer(1) == 2);
  CHECK(s.inner(1) == 4);
  CHECK(Shape{}.numel() == 1);
  CHECK(s.str() == "(2, 3, 4)");
  CHECK(Shape{5}.str() == "(5,)");
  CHECK(fmt::format("{}", s) == "(2, 3, 4)");
}

TEST_CASE("shape: negative dims count from the end and out-of-range dims throw", "[core][shape]") {
  const Shape s{2, 3};
  CHECK(s.dim(-1, "op") == 1);
  CHECK(s.dim(0, "op") == 0);
  REQUIRE_ERROR(s.dim(2, "myop"), "myop", "dim 2", "(2, 3)");
  REQUIRE_ERROR(s.dim(-3, "myop"), "myop", "dim -3");
}

TEST_CASE("shape: rank above 4 and negative sizes are rejected", "[core][shape]") {
  REQUIRE_ERROR((Shape{1, 2, 3, 4, 5}), "rank 5");
  REQUIRE_ERROR((Shape{2, -1}), "negative");
}
