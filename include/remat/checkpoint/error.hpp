#pragma once
// CheckpointError: a checkpointed segment or chain replayed differently from its forward, or was
// misused. A remat::Error, so code that catches those catches it too.

#include "remat/core/error.hpp"

namespace remat {

/// A checkpointed segment or chain replayed differently from its forward, or was misused.
class CheckpointError : public Error {
 public:
  /// From the complete message, as remat::Error.
  using Error::Error;
};

}  // namespace remat
