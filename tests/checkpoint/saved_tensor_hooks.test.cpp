// Saved-tensor hooks: every tensor a recorded node saves goes through pack, backward reads unpack;
// gradients bitwise those without hooks (plain and checkpointed), misuse reported.

#include "checkpoint/support_checkpoint.hpp"

#include <any>

using namespace remat;

namespace {

/// A store that keeps a copy of each saved tensor (so remat's books hold nothing) and counts.
struct CopyingStore {
  int packs = 0, unpacks = 0;
  std::size_t packed_bytes = 0;

  SavedTensorHooks::Pack pack() {
    return [this](const AnyTensor& t) -> std::any {
      ++packs;
      packed_bytes += t.nbytes();
      if (t.is<float>()) return AnyTensor(detail::copy_of(t.as<float>()));
      if (t.is<std::int64_t>()) return AnyTensor(detail::copy_of(t.as<std::int64_t>()));
      return t;
    };
  }
  SavedTensorHooks::Unpack unpack() {
    return [this](const std::any& p) {
      ++unpacks;
      return std::any_cast<const AnyTensor&>(p);
    };
  }
};

/// A GPT step's gradients (and loss), under `how` (null: no checkpointing), with the store's hooks
/// in force around forward when `store` is given.
std::vector<std::vector<float>> gpt_grads(const char* how, CopyingStore* store) {
  test::GptStep step(how);
  Tensor loss;
  {
    std::optional<SavedTensorHooks> hooks;
    if (store) hooks.emplace(store->pack(), store->unpack());
    loss = step.loss();
    if (store) REQUIRE(saved_tensors().total_bytes == 0);  // every saved tensor is the store's
  }
  loss.backward();  // after the scope: the nodes kept their unpack
  auto grads = test::gradients(step.gpt);
  grads.push_back({loss.item()});
  return grads;
}

}  // namespace

TEST_CASE("saved-tensor hooks: every saved tensor is packed and unpacked, gradients bitwise those without",
          "[checkpoint][saved_tensor_hooks]") {
  for (const char* how : {static_cast<const char*>(nullptr), "blocks", "selective", "sqrt"}) {
    INFO((how ? how : "no checkpointing"));
    const auto reference = gpt_grads(how, nullptr);
    CopyingStore store;
    const auto hooked = gpt_grads(how, &store);
    REQUIRE(hooked == reference);
    REQUIRE(store.packs > 0);
    REQUIRE(store.unpacks > 0);
    // Without a chain, backward reads each packed tensor at least once. A chain (sqrt) holds the
    // steps it recorded in forward compactly (what their backward reads, packed again as the
    // chain's) and rebuilds their graphs from that: the first nodes' packed tensors go unread.
    if (!how || std::string(how) != "sqrt") REQUIRE(store.unpacks >= store.packs);
  }
}

TEST_CASE("saved-tensor hooks: the innermost pair packs, the ops a hook calls are not the model's",
          "[checkpoint][saved_tensor_hooks]") {
  Tensor w = randn({4, 4});
  w.requires_grad_();
  int outer_packs = 0, inner_packs = 0;
  auto keep = [](const AnyTensor& t) -> std::any { return t; };
  auto give = [](const std::any& p) { return std::any_cast<const AnyTensor&>(p); };
  Tensor y;
  {
    SavedTensorHooks outer([&](const AnyTensor& t) -> std::any { ++outer_packs; return keep(t); }, give);
    {
      SavedTensorHooks inner(
          [&](const AnyTensor& t) -> std::any {
            ++inner_packs;
            // An op inside pack: no node, no grad, no recursion into the hooks.
            Tensor copy = t.as<float>() * 1.0f;
            REQUIRE_FALSE(copy.requires_grad());
            return AnyTensor(copy);
          },
          give);
      y = tanh(w * w);
    }
    y = sum(y * y);
  }
  REQUIRE(inner_packs == 3);  // w twice (one storage, saved as both operands) and tanh's output
  REQUIRE(outer_packs == 2);  // y, as both operands of y * y (one pack per saved tensor, as PyTorch)
  Tensor plain_w = detail::copy_of(w.detach());
  plain_w.requires_grad_();
  y.backward();
  sum(tanh(plain_w * plain_w) * tanh(plain_w * plain_w)).backward();
  REQUIRE(test::all_close(w.grad(), plain_w.grad()));
}

TEST_CASE("saved-tensor hooks: what a pair declines goes to the pair outside it, what all decline stays with the node",
          "[checkpoint][saved_tensor_hooks]") {
  test::FreshTape fresh;
  Generator g(11);
  Tensor w = randn({8, 8}, g).requires_grad_();
  const Tensor x = randn({2, 8}, g);
  auto give = [](const std::any& p) { return std::any_cast<const AnyTensor&>(p); };
  std::vector<std::string> inner_took, outer_took, outer_declined;
  Tensor y;
  {
    // The outer store takes float tensors of 64 bytes or more; the inner one only tanh's saves.
    SavedTensorHooks outer(
        [&](const AnyTensor& t, const SaveContext& c) -> std::any {
          if (t.nbytes() < 64) {
            outer_declined.emplace_back(c.op);
            return {};
          }
          outer_took.emplace_back(c.op);
          return t;
        },
        give);
    SavedTensorHooks inner(
        [&](const AnyTensor& t, const SaveContext& c) -> std::any {
          if (c.op != std::string_view("tanh")) return {};
          inner_took.emplace_back(c.op);
          return t;
        },
        give);
    y = sum(tanh(matmul(x, w)) * 0.5f);  // matmul saves x (w's gradient); tanh its (2, 8) output
  }
  CHECK(inner_took == std::vector<std::string>{"tanh"});
  CHECK(outer_took == std::vector<std::string>{"matmul"});  // x, 64 B
  CHECK(outer_declined.empty());
  CHECK(saved_tensors(fresh.tape).total_bytes == 0);  // nothing left with the nodes
  Tensor plain_w = detail::copy_of(w.detach()).requires_grad_();
  y.backward();
  sum(tanh(matmul(x, plain_w)) * 0.5f).backward();
  REQUIRE(test::all_close(w.grad(), plain_w.grad()));
  {
    SavedTensorHooks outer([&](const AnyTensor&, const SaveContext& c) -> std::any {
      outer_declined.emplace_back(c.op);
      return {};
    }, give);
    Tensor z = tanh(w);  // declined by every store: the node keeps it, in the books
    CHECK(saved_tensors(fresh.tape).total_bytes == 8 * 8 * sizeof(float));
  }
  CHECK(outer_declined == std::vector<std::string>{"tanh"});
}

TEST_CASE("saved-tensor hooks: a wrong unpack, an in-place write and a second backward are errors",
          "[checkpoint][saved_tensor_hooks]") {
  Tensor w = randn({3, 5});
  w.requires_grad_();
  SECTION("unpack of another shape") {
    Tensor y;
    {
      SavedTensorHooks hooks([](const AnyTensor&) -> std::any { return 0; },
                             [](const std::any&) { return AnyTensor(zeros({2, 2})); });
      y = sum(tanh(w));
    }
    REQUIRE_ERROR(y.backward(), "tanh", "unpack gave back shape (2, 2)", "saved as shape (3, 5)");
  }
  SECTION("the same storage back, written in place since") {
    Tensor h = w * 2.0f;
    Tensor y;
    {
      SavedTensorHooks hooks([](const AnyTensor& t) -> std::any { return t; },
                             [](const std::any& p) { return std::any_cast<const AnyTensor&>(p); });
      y = sum(h * h);
    }
    h.data()[0] = 7.0f;
    REQUIRE_ERROR(y.backward(), "mul", "modified in place");
  }
  SECTION("backward twice through a freed graph") {
    CopyingStore store;
    Tensor y;
    {
      SavedTensorHooks hooks(store.pack(), store.unpack());
      y = sum(tanh(w));
    }
    y.backward();
    REQUIRE_ERROR(y.backward(), "freed");
  }
}
