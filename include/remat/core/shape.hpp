#pragma once
// Shape: the sizes of a row-major tensor of rank 0 to 4.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "remat/core/error.hpp"

namespace remat {

/// The sizes of a row-major tensor of rank 0 to 4, held inline (no allocation).
class Shape {
 public:
  /// The highest rank a shape may have.
  static constexpr int kMaxRank = 4;
  /// The most elements a shape may describe (2^56): far beyond any memory, and low enough that
  /// numel() times any element size cannot overflow int64.
  static constexpr std::int64_t kMaxNumel = std::int64_t{1} << 56;

  Shape() = default;  // rank 0: a scalar
  /// From sizes, e.g. {B, T, C}: each non-negative, the rank at most kMaxRank, the product at most kMaxNumel.
  Shape(std::initializer_list<std::int64_t> sizes) { assign(sizes.begin(), sizes.end()); }
  /// From a vector of sizes, checked as the initializer-list form.
  explicit Shape(const std::vector<std::int64_t>& sizes) { assign(sizes.begin(), sizes.end()); }

  /// The number of dims (0 for a scalar).
  int rank() const { return rank_; }
  /// The size of dim i (0 ≤ i < rank(), unchecked).
  std::int64_t operator[](int i) const { return sizes_[static_cast<std::size_t>(i)]; }
  /// The size of dim i, writable (unchecked).
  std::int64_t& operator[](int i) { return sizes_[static_cast<std::size_t>(i)]; }
  /// The first size, for range-for.
  const std::int64_t* begin() const { return sizes_.data(); }
  /// Past the last size.
  const std::int64_t* end() const { return sizes_.data() + rank_; }

  /// The number of elements: the product of the sizes (1 for a scalar).
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= sizes_[static_cast<std::size_t>(i)];
    return n;
  }
  /// Elements between consecutive indices of dim `i` (row-major, contiguous).
  std::int64_t stride(int i) const {
    std::int64_t s = 1;
    for (int j = rank_ - 1; j > i; --j) s *= sizes_[static_cast<std::size_t>(j)];
    return s;
  }
  /// Product of the sizes before `dim` and after it: the (outer, size, inner) view of a dim.
  std::int64_t outer(int dim) const {
    std::int64_t n = 1;
    for (int i = 0; i < dim; ++i) n *= sizes_[static_cast<std::size_t>(i)];
    return n;
  }
  /// Product of the sizes after `dim`: the same as stride(dim).
  std::int64_t inner(int dim) const { return stride(dim); }

  /// Resolves a possibly negative dim against this rank; throws naming `op` if out of range.
  int dim(std::int64_t d, const char* op) const {
    const std::int64_t r = rank_;
    REMAT_CHECK(d >= -r && d < r, "{}: dim {} is out of range for a tensor of shape {} (rank {})",
                op, d, str(), r);
    return static_cast<int>(d < 0 ? d + r : d);
  }

  /// The sizes as a vector.
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }
  /// A copy with dim i's size replaced by `size`.
  Shape with(int i, std::int64_t size) const {
    Shape s = *this;
    s.sizes_[static_cast<std::size_t>(i)] = size;
    return s;
  }
  /// A copy with dim i removed.
  Shape without(int i) const {
    std::vector<std::int64_t> v = vec();
    v.erase(v.begin() + i);
    return Shape(v);
  }
  /// The last n dims.
  Shape last(int n) const { return Shape(std::vector<std::int64_t>(end() - n, end())); }

  /// Same rank and sizes.
  bool operator==(const Shape& o) const {
    if (rank_ != o.rank_) return false;
    for (int i = 0; i < rank_; ++i)
      if (sizes_[static_cast<std::size_t>(i)] != o.sizes_[static_cast<std::size_t>(i)]) return false;
    return true;
  }
  /// Not operator==.
  bool operator!=(const Shape& o) const { return !(*this == o); }

  /// "(2, 3)" and so on; also how fmt prints a Shape.
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) s += fmt::format(i ? ", {}" : "{}", sizes_[static_cast<std::size_t>(i)]);
    return s + (rank_ == 1 ? ",)" : ")");
  }

 private:
  template <class It>
  void assign(It first, It last) {
    const auto n = last - first;
    REMAT_CHECK(n <= kMaxRank, "Shape: rank {} is above the supported maximum {}", n, kMaxRank);
    rank_ = static_cast<int>(n);
    int i = 0;
    std::int64_t numel = 1;
    for (It it = first; it != last; ++it, ++i) {
      REMAT_CHECK(*it >= 0, "Shape: size {} of dim {} is negative", *it, i);
      REMAT_CHECK(*it == 0 || numel <= kMaxNumel / *it, "Shape: sizes {} describe more than {} elements",
                  fmt::join(first, last, ", "), kMaxNumel);
      numel *= *it;
      sizes_[static_cast<std::size_t>(i)] = *it;
    }
  }

  std::array<std::int64_t, kMaxRank> sizes_{};
  int rank_ = 0;
};

}  // namespace remat

/// \cond
template <>
struct fmt::formatter<remat::Shape> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const remat::Shape& s, Ctx& ctx) const {
    const std::string text = s.str();
    return fmt::formatter<std::string_view>::format(text, ctx);
  }
};
/// \endcond
