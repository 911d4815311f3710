// Writes what the PyTorch parity checks compare against: a GPT's initial weights, one batch, and
// remat's loss and every parameter gradient for that batch, dropout off: in float32 (gpt_parity.py),
// or with `autocast` twice — in float32 and with the forward under remat::autocast, backward outside
// it as torch.autocast is used — each run's entries prefixed by its name (autocast_parity.py).
//   gpt_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB [autocast]
#include <string>

#include "parity_setup.hpp"

int main(int argc, char** argv) try {
  using namespace remat;
  REMAT_CHECK(argc == 8 || (argc == 9 && std::string(argv[8]) == "autocast"),
              "usage: gpt_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB [autocast]");
  const bool both = argc == 9;
  const std::string dir = argv[1];
  const parity::Setup s = parity::setup(argv);
  nn::GPT& model = *s.model;
  const LongTensor& idx = s.idx;
  const LongTensor& targets = s.targets;
  io::TensorFile out{{"batch.idx", io::to_entry(idx)}, {"batch.targets", io::to_entry(targets)}};
  for (const bool mixed : both ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
    const std::string prefix = !both ? "" : mixed ? "autocast." : "fp32.";
    model.zero_grad();
    Tensor loss;
    {
      autocast on(mixed);
      loss = model.loss(idx, targets);
    }
    loss.backward();
    out.emplace(prefix + "loss", io::to_entry(loss.detach()));
    for (auto& [name, p] : model.named_parameters()) out.emplace(prefix + "grad." + name, io::to_entry(p->grad()));
    fmt::print("remat {}: loss {:.6f}\n", mixed ? "autocast" : "fp32", loss.item());
  }
  io::write_safetensors(dir + "/remat.safetensors", out);
  fmt::print("remat: {} parameter gradients of each run written to {}\n", model.named_parameters().size(), dir);
  return 0;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
