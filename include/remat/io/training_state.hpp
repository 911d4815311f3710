#pragma once
// Everything a training run needs to continue where it stopped — the model's parameters, the
// optimizer's buffers and scalars, the step counter (also the learning-rate schedule's position),
// the data position, the generator states, and any tensors and scalars of the caller's — in one
// safetensors file that PyTorch can read (tensors "model.<name>", "optim.<g>.<p>.<buffer>",
// "user.<name>"; scalars in the metadata, doubles as exact hexadecimal floats).
//
// Writing is atomic (a crash leaves the previous file or the new one). The file carries a
// checksum of all its bytes, so a truncated or altered file — any byte of the header or the
// data — is rejected. Loading checks every name, shape and dtype against the model and the
// optimizer before it changes anything: on a remat::Error, nothing changed.

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "remat/core/hash.hpp"
#include "remat/core/random.hpp"
#include "remat/io/safetensors.hpp"
#include "remat/nn/module.hpp"
#include "remat/optim/optimizer.hpp"

namespace remat::io {

/// The caller's part of a training state: saved beside the model and optimizer, returned by load.
struct TrainingState {
  std::int64_t step = 0;           ///< optimizer steps taken (the learning-rate schedule's position)
  std::int64_t data_position = 0;  ///< where the data stream is
  /// Generators besides the thread's default one (which is always saved and restored).
  std::map<std::string, Generator::State> generators;
  std::map<std::string, double> scalars;  ///< e.g. the best validation loss so far
  std::map<std::string, Tensor> tensors;  ///< e.g. the loss history
  /// The caller's bfloat16 tensors (saved as BF16, bit for bit; names apart from `tensors`').
  std::map<std::string, BFloat16Tensor> bfloat16_tensors;
};

namespace detail {

inline constexpr const char* kChecksumKey = "remat.checksum";
inline constexpr std::size_t kChecksumDigits = 16;

/// The checksum's digits for a file's bytes (with its own digits zeroed).
inline std::string checksum(const std::string& bytes) {
  return fmt::format("{:016x}", remat::detail::fnv1a(bytes.data(), bytes.size()));
}

/// Where the checksum's digits are in a file's bytes (within its header), or npos.
inline std::size_t checksum_digits_at(const std::string& bytes, std::uint64_t header_bytes) {
  const std::string marker = std::string("\"") + kChecksumKey + "\":\"";
  const std::size_t at = bytes.find(marker, 8);
  if (at == std::string::npos || at + marker.size() + kChecksumDigits > 8 + header_bytes) return std::string::npos;
  return at + marker.size();
}

inline std::string exact(double v) { return fmt::format("{:a}", v); }

inline double parse_double(const std::string& text, const std::string& key, const std::string& path) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  REMAT_CHECK(!text.empty() && end == text.c_str() + text.size(), "training state: {}: '{}' is not a number ({})", path,
              text, key);
  return v;
}

inline std::uint64_t parse_unsigned(const std::string& text, const std::string& key, const std::string& path) {
  REMAT_CHECK(!text.empty() && text.find_first_not_of("0123456789") == std::string::npos && text.size() <= 20,
              "training state: {}: '{}' is not an unsigned integer ({})", path, text, key);
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
  REMAT_CHECK(errno == 0, "training state: {}: {} is out of range ({})", path, text, key);
  return v;
}

}  // namespace detail

/// Writes model, optimizer, the default generator and `state` to `path`, atomically.
inline void save_training_state(const std::string& path, nn::Module& model, const optim::Optimizer& optimizer,
                                const TrainingState& state = {}) {
  REMAT_CHECK(state.step >= 0 && state.data_position >= 0,
              "save_training_state: step and data position must be non-negative, got {} and {}", state.step,
              state.data_position);
  TensorFile file;
  std::map<std::string, std::string> meta{{"format", "pt"}, {"remat.kind", "training_state"}, {"remat.version", "1"},
                                          {"remat.optimizer", optimizer.kind()},
                                          {"remat.step", std::to_string(state.step)},
                                          {"remat.data_position", std::to_string(state.data_position)},
                                          {detail::kChecksumKey, std::string(detail::kChecksumDigits, '0')}};
  for (auto& [name, p] : model.named_parameters()) file.emplace("model." + name, to_entry(*p));
  const optim::OptimizerState os = optimizer.state();
  for (const auto& [key, t] : os.tensors) file.emplace("optim." + key, to_entry(t));
  for (const auto& [key, v] : os.scalars) meta["optim." + key] = detail::exact(v);
  for (const auto& [name, t] : state.tensors) file.emplace("user." + name, to_entry(t));
  for (const auto& [name, t] : state.bfloat16_tensors) {
    REMAT_CHECK(!state.tensors.count(name), "save_training_state: '{}' names a float32 and a bfloat16 tensor of the "
                "caller's; give them names of their own", name);
    file.emplace("user." + name, to_entry(t));
  }
  for (const auto& [name, v] : state.scalars) meta["user." + name] = detail::exact(v);
  auto generators = state.generators;
  REMAT_CHECK(!generators.count("default"), "save_training_state: 'default' names the thread's default generator, "
              "saved always; give yours another name");
  generators["default"] = default_generator().state();
  for (const auto& [name, g] : generators) {
    meta["rng." + name + ".seed"] = std::to_string(g.seed);
    meta["rng." + name + ".offset"] = std::to_string(g.offset);
  }
  std::string bytes = io::detail::safetensors_bytes(file, meta);
  const std::uint64_t header = io::detail::header_length(bytes);
  const std::size_t at = detail::checksum_digits_at(bytes, header);
  REMAT_ASSERT(at != std::string::npos);
  const std::string digits = detail::checksum(bytes);  // over the file with the digits zero
  bytes.replace(at, detail::kChecksumDigits, digits);
  io::detail::write_file_atomically(path, bytes);
}

/// load_training_state from the file's bytes (`path` names it in errors).
inline TrainingState load_training_state_bytes(std::string bytes, const std::string& path, nn::Module& model,
                                               optim::Optimizer& optimizer) {
  const TensorFile file = parse_safetensors(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), path);
  const std::uint64_t header = io::detail::header_length(bytes);
  const std::size_t at = detail::checksum_digits_at(bytes, header);
  REMAT_CHECK(at != std::string::npos, "training state: {} has no checksum: it is not a training state remat wrote", path);
  const std::string stored = bytes.substr(at, detail::kChecksumDigits);
  bytes.replace(at, detail::kChecksumDigits, std::string(detail::kChecksumDigits, '0'));
  REMAT_CHECK(stored == detail::checksum(bytes),
              "training state: {} is damaged: its checksum {} does not match its bytes", path, stored);

  const auto* image = reinterpret_cast<const unsigned char*>(bytes.data());
  const nlohmann::json head = io::detail::parse_header(image + 8, image + 8 + header, path);
  REMAT_CHECK(head.contains("__metadata__") && head["__metadata__"].is_object(), "training state: {} has no metadata", path);
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : head["__metadata__"].items()) {
    REMAT_CHECK(v.is_string(), "training state: {}: metadata '{}' is not a string", path, k);
    meta[k] = v.get<std::string>();
  }
  auto need = [&](const std::string& key) -> const std::string& {
    auto it = meta.find(key);
    REMAT_CHECK(it != meta.end(), "training state: {} has no '{}'", path, key);
    return it->second;
  };
  REMAT_CHECK(need("remat.kind") == "training_state" && need("remat.version") == "1",
              "training state: {} is a '{}' file of version {}, not a training state of version 1", path,
              need("remat.kind"), need("remat.version"));
  REMAT_CHECK(need("remat.optimizer") == optimizer.kind(), "training state: {} holds the state of {}, not of {}", path,
              need("remat.optimizer"), optimizer.kind());

  // The model: exactly its parameters, float32, of its shapes.
  const auto params = model.named_parameters();
  std::size_t model_entries = 0;
  for (const auto& [name, e] : file) model_entries += name.rfind("model.", 0) == 0;
  REMAT_CHECK(model_entries == params.size(), "training state: {} holds {} model tensors, the model has {} parameters",
              path, model_entries, params.size());
  for (const auto& [name, p] : params) {
    const auto it = file.find("model." + name);
    REMAT_CHECK(it != file.end(), "training state: {} has no tensor 'model.{}', which the model needs", path, name);
    REMAT_CHECK(it->second.dtype == "F32" && it->second.shape == p->shape(),
                "training state: {}: 'model.{}' is {} of shape {}, the parameter is F32 of shape {}", path, name,
                it->second.dtype, it->second.shape, p->shape());
  }
  // The optimizer, the caller's part and the generators, gathered (and so checked) before anything changes.
  optim::OptimizerState os;
  TrainingState out;
  for (const auto& [name, e] : file) {
    if (name.rfind("optim.", 0) == 0) os.tensors[name.substr(6)] = from_entry<float>(e, name);
    else if (name.rfind("user.", 0) == 0 && e.dtype == "BF16") out.bfloat16_tensors[name.substr(5)] = from_entry<bfloat16>(e, name);
    else if (name.rfind("user.", 0) == 0) out.tensors[name.substr(5)] = from_entry<float>(e, name);
    else REMAT_CHECK(name.rfind("model.", 0) == 0, "training state: {} has tensor '{}', which is none of model., optim., user.",
                     path, name);
  }
  std::map<std::string, Generator::State> generators;
  for (const auto& [key, value] : meta) {
    if (key.rfind("optim.", 0) == 0) {
      os.scalars[key.substr(6)] = detail::parse_double(value, key, path);
    } else if (key.rfind("user.", 0) == 0) {
      out.scalars[key.substr(5)] = detail::parse_double(value, key, path);
    } else if (key.rfind("rng.", 0) == 0) {
      const std::size_t dot = key.rfind('.');
      const std::string name = key.substr(4, dot - 4), field = key.substr(dot + 1);
      REMAT_CHECK(dot > 4 && (field == "seed" || field == "offset"), "training state: {}: unknown metadata '{}'", path, key);
      (field == "seed" ? generators[name].seed : generators[name].offset) = detail::parse_unsigned(value, key, path);
    }
  }
  REMAT_CHECK(generators.count("default"), "training state: {} has no state of the default generator", path);
  const std::uint64_t step = detail::parse_unsigned(need("remat.step"), "remat.step", path),
                      position = detail::parse_unsigned(need("remat.data_position"), "remat.data_position", path);
  REMAT_CHECK(step <= static_cast<std::uint64_t>(INT64_MAX) && position <= static_cast<std::uint64_t>(INT64_MAX),
              "training state: {}: step {} or data position {} is out of range", path, step, position);
  out.step = static_cast<std::int64_t>(step);
  out.data_position = static_cast<std::int64_t>(position);

  optimizer.load_state(os);  // checks everything before it changes anything; the last check
  {
    no_grad guard;
    for (auto& [name, p] : params) std::memcpy(p->data(), file.at("model." + name).data.data(), p->nbytes());
  }
  default_generator().set_state(generators.at("default"));
  generators.erase("default");
  out.generators = std::move(generators);
  return out;
}

/// Reads `path` into model, optimizer and the default generator, and returns the caller's part.
/// Every name, dtype and shape is checked first; on a remat::Error nothing has changed.
inline TrainingState load_training_state(const std::string& path, nn::Module& model, optim::Optimizer& optimizer) {
  return load_training_state_bytes(io::detail::read_file(path, "training state"), path, model, optimizer);
}

}  // namespace remat::io
