#pragma once
#include "remat/nn/init.hpp"
#include "remat/nn/module.hpp"
#include "remat/ops/embedding.hpp"

namespace remat::nn {

/// A (num_embeddings, dim) table looked up by integer ids; starts N(0, 1) as in PyTorch.
class Embedding : public Module {
 public:
  /// A table of num_embeddings rows of size dim, drawn N(0, std²) from gen.
  Embedding(std::int64_t num_embeddings, std::int64_t dim, Generator& gen = default_generator(), float std = 1.0f) {
    weight = init::normal({num_embeddings, dim}, std, gen);
    register_parameter("weight", weight);
  }
  /// The rows of `weight` at `ids`: ids of any shape (...) give (..., dim).
  Tensor forward(const LongTensor& ids) { return embedding(ids, weight); }
  /// Calls forward(ids).
  Tensor operator()(const LongTensor& ids) { return forward(ids); }

  Tensor weight;  ///< (num_embeddings, dim)
};

}  // namespace remat::nn
