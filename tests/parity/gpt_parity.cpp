// Writes what the PyTorch parity checks compare against: a GPT's initial weights, one batch, and
// remat's loss and every parameter gradient for that batch, dropout off: in float32 (gpt_parity.py),
// or with `autocast` twice — in float32 and with the forward under remat::autocast, backward outside
// it as torch.autocast is used — each run's entries prefixed by its name (autocast_parity.py).
//   gpt_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB [autocast]
#include <string>

#include <remat/remat.hpp>

int main(int argc, char** argv) try {
  using namespace remat;
  REMAT_CHECK(argc == 8 || (argc == 9 && std::string(argv[8]) == "autocast"),
              "usage: gpt_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB [autocast]");
  const bool both = argc == 9;
  const std::string dir = argv[1];
  nn::GPTConfig cfg;
  cfg.n_layer = std::stoll(argv[2]);
  cfg.n_embd = std::stoll(argv[3]);
  cfg.n_head = std::stoll(argv[4]);
  cfg.block_size = std::stoll(argv[5]);
  const std::int64_t B = std::stoll(argv[6]);
  cfg.vocab_size = std::stoll(argv[7]);
  Generator gen(2024);
  nn::GPT model(cfg, gen);
  io::save(model, dir + "/weights.safetensors");

  const LongTensor idx = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
  LongTensor targets = randint(0, cfg.vocab_size, {B, cfg.block_size}, gen);
  targets.at({0, 0}) = -100;  // one ignored position, so ignore_index is compared too
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
