#pragma once
// What each parity writer starts from: the GPT its command line describes (OUT_DIR LAYERS WIDTH
// HEADS CONTEXT BATCH VOCAB), built from seed 2024 and saved as OUT_DIR/weights.safetensors, and
// one batch drawn after it, with one ignored target so ignore_index is compared too.

#include <memory>
#include <string>

#include <remat/remat.hpp>

namespace parity {

struct Setup {
  remat::nn::GPTConfig cfg;
  std::unique_ptr<remat::nn::GPT> model;
  remat::LongTensor idx, targets;
};

inline Setup setup(char** argv) {
  using namespace remat;
  Setup s;
  s.cfg.n_layer = std::stoll(argv[2]);
  s.cfg.n_embd = std::stoll(argv[3]);
  s.cfg.n_head = std::stoll(argv[4]);
  s.cfg.block_size = std::stoll(argv[5]);
  const std::int64_t B = std::stoll(argv[6]);
  s.cfg.vocab_size = std::stoll(argv[7]);
  Generator gen(2024);
  s.model = std::make_unique<nn::GPT>(s.cfg, gen);
  io::save(*s.model, std::string(argv[1]) + "/weights.safetensors");
  s.idx = randint(0, s.cfg.vocab_size, {B, s.cfg.block_size}, gen);
  s.targets = randint(0, s.cfg.vocab_size, {B, s.cfg.block_size}, gen);
  s.targets.at({0, 0}) = -100;
  return s;
}

}  // namespace parity
