#pragma once
// What every benchmark parses: --name value pairs over a table of defaults, and the GPT shape
// flags the GPT benchmarks share.

#include <map>
#include <string>

#include <remat/remat.hpp>

namespace bench {

using Flags = std::map<std::string, std::string>;

/// `defaults` with each --name value of the command line applied; an unknown name throws.
inline Flags parse_flags(int argc, char** argv, Flags defaults, const char* program) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = std::string(argv[i]).substr(2);
    REMAT_CHECK(defaults.count(k), "{}: unknown flag --{}", program, k);
    defaults[k] = argv[i + 1];
  }
  return defaults;
}

/// The GPT of --layers --width --heads --context --vocab, with the given dropout.
inline remat::nn::GPTConfig gpt_config(Flags& a, double dropout) {
  remat::nn::GPTConfig cfg;
  cfg.n_layer = std::stoll(a["layers"]);
  cfg.n_embd = std::stoll(a["width"]);
  cfg.n_head = std::stoll(a["heads"]);
  cfg.block_size = std::stoll(a["context"]);
  cfg.vocab_size = std::stoll(a["vocab"]);
  cfg.dropout = dropout;
  return cfg;
}

}  // namespace bench
