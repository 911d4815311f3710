// Observers hear every event, whatever deciders are installed: around a checkpointed GPT, the ops
// of the forward (also those inside each segment), of each replay, and every node's backward.

#include "checkpoint/support_checkpoint.hpp"

#include <algorithm>
#include <map>

using namespace remat;

namespace {

/// What an observer heard.
struct Heard {
  std::vector<std::string> forward, backward;      // op names before backward; backward node names
  std::vector<std::vector<std::string>> replays;   // the ops of each replay
  int open_replays = 0, backward_begins = 0, backward_ends = 0, saves = 0, leaf_grads = 0;
};

/// Every event, in order, as text.
struct Recorder : Observer, Heard {

  void op(const OpOutput& out, const OpValues&) override {
    if (open_replays > 0) replays.back().push_back(out.op.name());
    else if (backward_begins == 0) forward.push_back(out.op.name());
  }
  void saved(const std::vector<detail::SavedTensor>&) override { ++saves; }
  void backward_op(const char* name) override { backward.push_back(name); }
  void leaf_grad(const void*) override { ++leaf_grads; }
  void backward_begin(bool outermost) override { backward_begins += outermost; }
  void backward_end(bool completed, bool outermost) override { backward_ends += completed && outermost; }
  void replay_begin(const ReplayEvent& e) override {
    REQUIRE((std::string(e.kind) == "checkpoint" || std::string(e.kind) == "chain"));
    ++open_replays;
    replays.emplace_back();
  }
  void replay_end(const ReplayEvent&) override { --open_replays; }
};

Heard observe_step(const char* how) {
  test::GptStep step(how);
  Recorder rec;
  step.loss().backward();
  return static_cast<const Heard&>(rec);
}

std::map<std::string, int> counts(const std::vector<std::string>& names) {
  std::map<std::string, int> out;
  for (const std::string& n : names) ++out[n];
  return out;
}

}  // namespace

TEST_CASE("observer: around a checkpointed GPT it hears every op of the forward, the replays and the backward",
          "[checkpoint][observer]") {
  const Heard plain = observe_step(nullptr);
  REQUIRE(plain.replays.empty());
  REQUIRE(plain.forward.size() > 20);
  for (const char* how : {"blocks", "selective"}) {
    INFO(how);
    const Heard ckpt = observe_step(how);
    // The forward: every op, inside the segments too, in the plain run's order.
    REQUIRE(ckpt.forward == plain.forward);
    // One replay per block, each hearing the block's ops (the same ops in every block), which are
    // a contiguous run of the forward's.
    REQUIRE(ckpt.replays.size() == 3);
    REQUIRE(ckpt.open_replays == 0);
    const std::vector<std::string>& block = ckpt.replays.front();
    REQUIRE(!block.empty());
    for (const auto& r : ckpt.replays) REQUIRE(r == block);
    REQUIRE(std::search(plain.forward.begin(), plain.forward.end(), block.begin(), block.end()) != plain.forward.end());
    // The backward: every node the plain run walks, and one checkpoint node per block.
    std::map<std::string, int> extra = counts(ckpt.backward);
    for (const auto& [name, n] : counts(plain.backward)) {
      INFO(name);
      REQUIRE(extra[name] >= n);
      extra[name] -= n;
    }
    int checkpoint_nodes = 0;
    for (const auto& [name, n] : extra) checkpoint_nodes += n;
    REQUIRE(checkpoint_nodes == 3);
    REQUIRE(ckpt.backward_begins == 1);
    REQUIRE(ckpt.backward_ends == 1);
    REQUIRE(ckpt.leaf_grads >= plain.leaf_grads);
    REQUIRE(ckpt.saves > 0);
  }
}

TEST_CASE("observer: around a GPT's blocks run as a chain it hears every op of the forward, each step's replay and "
          "the backward", "[chain][observer]") {
  const Heard plain = observe_step(nullptr);
  for (const char* how : {"sqrt", "binomial:2", "uniform:2"}) {
    INFO(how);
    const Heard chain = observe_step(how);
    // The forward runs each step once, in order: the plain run's ops.
    REQUIRE(chain.forward == plain.forward);
    // Each replay is one step (a block) run again, recorded or rebuilt: the block's ops every time.
    REQUIRE(!chain.replays.empty());
    REQUIRE(chain.open_replays == 0);
    const std::vector<std::string>& block = chain.replays.front();
    REQUIRE(!block.empty());
    for (const auto& r : chain.replays) REQUIRE(r == block);
    REQUIRE(std::search(plain.forward.begin(), plain.forward.end(), block.begin(), block.end()) != plain.forward.end());
    // The backward walks every node the plain run walks (the steps' nodes, recorded or rebuilt),
    // and the chain's own.
    std::map<std::string, int> walked = counts(chain.backward);
    for (const auto& [name, n] : counts(plain.backward)) {
      INFO(name);
      REQUIRE(walked[name] >= n);
    }
    REQUIRE(chain.backward.size() > plain.backward.size());
    REQUIRE(chain.backward_begins == 1);
    REQUIRE(chain.backward_ends == 1);
    REQUIRE(chain.leaf_grads >= plain.leaf_grads);
  }
}

TEST_CASE("observer: an op built from other ops is one op, nothing is heard after it is gone",
          "[checkpoint][observer]") {
  Tensor x = randn({4, 8});
  x.requires_grad_();
  std::vector<std::string> ops;
  {
    struct Ops : Observer {
      std::vector<std::string>& out;
      explicit Ops(std::vector<std::string>& o) : out(o) {}
      void op(const OpOutput& o, const OpValues&) override { out.push_back(o.op.name()); }
    } listener(ops);
    Tensor y = gelu(x);  // one op, whatever it computes with
    sum(y).backward();
  }
  REQUIRE(ops == std::vector<std::string>{"gelu", "sum"});
  sum(gelu(x)).backward();
  REQUIRE(ops.size() == 2);
}
