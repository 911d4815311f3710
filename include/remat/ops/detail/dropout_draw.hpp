#pragma once
// The one rule every dropout draw follows (dropout, dropout_add, the attention's probabilities):
// which uniforms keep an element, what a kept element is scaled by, and the generator state the
// mask is drawn at. The generator is moved past the draw when it is made, through Generator::take,
// so a checkpoint notes the generator and its replay draws the same mask.

#include <cstdint>

#include "remat/core/random.hpp"

namespace remat::detail {

template <class T>
struct DropoutDraw {
  /// An element is kept when its uniform is ≥ threshold: p, or 2 (none kept) for p = 1.
  float threshold = 0.0f;
  /// What a kept element is multiplied by: 1 / (1 - p), or 0 for p = 1.
  T scale = T(1);
  /// The generator state element 0's uniform is drawn at (detail::for_each_uniform24's rule).
  Generator::State at_entry{};

  /// No dropout: every element kept as it is, no number drawn.
  DropoutDraw() = default;
  /// The draw of `elements` uniforms from `gen` for probability p in [0, 1].
  DropoutDraw(double p, std::uint64_t elements, Generator& gen)
      : threshold(p < 1.0 ? static_cast<float>(p) : 2.0f),
        scale(p < 1.0 ? static_cast<T>(1.0 / (1.0 - p)) : T(0)),
        at_entry(gen.take(uniform24_blocks(elements))) {}
};

}  // namespace remat::detail
