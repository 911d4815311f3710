#pragma once
// The element-type conversion every cast goes through: to<U> (core/factory.hpp) and the operands
// autocast narrows (core/autocast.hpp).

#include <cstdint>
#include <type_traits>

#include "remat/core/bfloat16.hpp"
#include "remat/core/tensor.hpp"

namespace remat {
namespace detail {

/// t's elements converted to U, without history. To bfloat16 rounds to nearest even
/// (core/bfloat16.hpp), from other types than float through float as PyTorch does (a double
/// rounds twice); from bfloat16 is exact.
template <class U, class T>
BasicTensor<U> cast_copy(const BasicTensor<T>& t) {
  constexpr bool narrow = std::is_same_v<U, bfloat16> && !std::is_same_v<T, bfloat16>;
  constexpr bool widen = std::is_same_v<T, bfloat16> && !std::is_same_v<U, bfloat16>;
  BasicTensor<U> out(t.shape());
  const T* src = t.data();
  U* dst = out.data();
  const std::int64_t n = t.numel();
  if constexpr (narrow && std::is_same_v<T, float>) convert_elements(src, dst, n, narrow_to_bfloat16);
  else if constexpr (widen && std::is_same_v<U, float>) convert_elements(src, dst, n, widen_from_bfloat16);
  else if constexpr (narrow) for (std::int64_t i = 0; i < n; ++i) dst[i] = to_bfloat16(static_cast<float>(src[i]));
  else if constexpr (widen) for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<U>(to_float(src[i]));
  else for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<U>(src[i]);
  return out;
}

}  // namespace detail

}  // namespace remat
