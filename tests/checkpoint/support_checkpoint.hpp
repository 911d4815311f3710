#pragma once
// Helpers for comparing a model's gradients with and without checkpointing, bit for bit, and the
// GPT step the listener tests run.

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "support.hpp"

namespace remat::test {

/// A fresh directory under /tmp (for snapshot files), removed (if empty) at the end of the test.
struct TempDir {
  TempDir() {
    char name[] = "/tmp/remat-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { ::rmdir(path.c_str()); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// The paths of the files in it.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(path.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(path + "/" + e->d_name);
      ::closedir(d);
    }
    return out;
  }
  std::string path;
};

/// How far a Hessian-vector product is from central differences of gradients along the same
/// direction, (g(+ε) - g(-ε)) / 2ε: the largest entry's gap, and the largest difference quotient.
struct Agreement {
  double worst = 0, scale = 0;
};

inline Agreement against_differences(const std::vector<Tensor>& hvp, const std::vector<Tensor>& plus,
                                     const std::vector<Tensor>& minus, float eps) {
  Agreement a;
  for (std::size_t i = 0; i < hvp.size(); ++i)
    for (std::int64_t j = 0; j < hvp[i].numel(); ++j) {
      const double numeric = (double(plus[i].data()[j]) - minus[i].data()[j]) / (2 * eps);
      a.worst = std::max(a.worst, std::abs(numeric - hvp[i].data()[j]));
      a.scale = std::max(a.scale, std::abs(numeric));
    }
  return a;
}

/// Each tensor of `a` bitwise its counterpart in `b` (one CHECK per tensor, `what` and the index
/// in its message).
inline void require_bitwise(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const char* what) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(what << " " << i);
    CHECK(a[i].to_vector() == b[i].to_vector());
  }
}

/// Every parameter's gradient, in named_parameters order, copied out.
inline std::vector<std::vector<float>> gradients(nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (auto& [name, p] : m.named_parameters()) out.push_back(p->grad().defined() ? p->grad().to_vector() : std::vector<float>{});
  return out;
}

/// CHECKs that `how` changes neither the loss nor any parameter gradient of `model`, bit for bit
/// (testing::compare_checkpointing from generator seed `seed`); a failure names the first
/// difference and the checkpointing.
template <class Stack>
void check_checkpointing(Stack& model, const Checkpointing& how, const std::function<Tensor()>& loss_fn,
                         std::uint64_t seed = 0) {
  const testing::GradientComparison r = testing::compare_checkpointing(model, how, loss_fn, seed);
  INFO(how.name << ": " << r.message);
  CHECK(r.equal);
}

/// The GPT step the observer and saved-tensor-hook tests listen to: small_gpt(3 layers, dropout
/// 0.1) from Generator(3), its blocks checkpointed under policy::parse(how) (null: not), the thread's
/// generator seeded 4, and a (2, 12) batch of tokens and targets drawn from the same Generator(3).
struct GptStep {
  Generator init{3};
  nn::GPT gpt;
  LongTensor idx, targets;
  explicit GptStep(const char* how) : gpt(small_gpt(3, 0.1), init) {
    if (how) apply_checkpointing(gpt, policy::parse(how));
    manual_seed(4);
    idx = randint(0, 23, {2, 12}, init);
    targets = randint(0, 23, {2, 12}, init);
  }
  /// The step's loss (forward only).
  Tensor loss() { return gpt.loss(idx, targets); }
};

}  // namespace remat::test
