#pragma once
// Printing tensors through fmt: `fmt::print("{}\n", t)`, long dims elided as in PyTorch.

#include <string>
#include <type_traits>

#include <fmt/format.h>

#include "remat/core/tensor.hpp"

namespace remat::detail {

/// An element as fmt prints it: fmt has no formatter for bfloat16, whose value is its float's.
template <class T>
auto printable(T v) {
  if constexpr (std::is_same_v<T, bfloat16>) return static_cast<float>(v);
  else return v;
}

template <class T>
void format_dims(std::string& out, const BasicTensor<T>& t, int d, std::int64_t offset, int indent) {
  constexpr std::int64_t kEdge = 3;  // elements shown at each end of a long dim
  const Shape& s = t.shape();
  const std::int64_t n = s[d];
  const std::int64_t stride = s.stride(d);
  out += '[';
  for (std::int64_t i = 0; i < n; ++i) {
    if (n > 2 * kEdge + 1 && i == kEdge) {
      out += d + 1 == s.rank() ? "..., " : "...,\n" + std::string(static_cast<std::size_t>(indent + 1), ' ');
      i = n - kEdge - 1;
      continue;
    }
    if (d + 1 == s.rank()) out += fmt::format("{:.4g}", printable(t.data()[offset + i]));
    else format_dims(out, t, d + 1, offset + i * stride, indent + 1);
    if (i + 1 < n) out += d + 1 == s.rank() ? ", " : ",\n" + std::string(static_cast<std::size_t>(indent + 1), ' ');
  }
  out += ']';
}

template <class T>
std::string to_string(const BasicTensor<T>& t) {
  if (!t.defined()) return "tensor(undefined)";
  std::string body;
  if (t.dim() == 0) body = fmt::format("{:.4g}", printable(t.data()[0]));
  else format_dims(body, t, 0, 0, 7);
  return fmt::format("tensor({}, shape={}, dtype={}{})", body, t.shape(), t.dtype(),
                     t.requires_grad() ? ", requires_grad=true" : "");
}

}  // namespace remat::detail

/// \cond
template <class T>
struct fmt::formatter<remat::BasicTensor<T>> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const remat::BasicTensor<T>& t, Ctx& ctx) const {
    const std::string text = remat::detail::to_string(t);
    return fmt::formatter<std::string_view>::format(text, ctx);
  }
};
/// \endcond
