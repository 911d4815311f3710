#pragma once
// The safetensors format (what PyTorch and Hugging Face users exchange): an 8-byte little-endian
// header length, a JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...},
// then the raw little-endian data. Reading validates everything before anything is used.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "remat/core/tensor.hpp"
#include "remat/core/autograd.hpp"
#include "remat/nn/module.hpp"

namespace remat::io {

/// One tensor of a safetensors file, as bytes: dtype is the format's name ("F32", "F64", "I64", "BOOL").
struct TensorEntry {
  std::string dtype;
  Shape shape;
  std::vector<unsigned char> data;
};
using TensorFile = std::map<std::string, TensorEntry>;

namespace detail {

template <class T>
constexpr const char* safetensors_dtype() {
  if constexpr (std::is_same_v<T, float>) return "F32";
  else if constexpr (std::is_same_v<T, double>) return "F64";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "I64";
  else if constexpr (std::is_same_v<T, bool>) return "BOOL";
  else static_assert(sizeof(T) == 0, "safetensors: unsupported element type");
}

inline std::size_t dtype_size(const std::string& dtype, const std::string& path, const std::string& name) {
  if (dtype == "F32") return 4;
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "BOOL") return 1;
  throw Error(fmt::format("safetensors: {}: tensor '{}' has dtype {}, which remat does not read (F32, F64, I64, "
                          "BOOL)", path, name, dtype));
}

}  // namespace detail

template <class T>
TensorEntry to_entry(const BasicTensor<T>& t) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 4 || sizeof(T) == 8, "safetensors: unsupported element size");
  TensorEntry e{detail::safetensors_dtype<T>(), t.shape(), std::vector<unsigned char>(t.nbytes())};
  if (t.nbytes()) std::memcpy(e.data.data(), t.data(), t.nbytes());
  return e;
}

/// The entry as a tensor of T; its dtype must be T's.
template <class T>
BasicTensor<T> from_entry(const TensorEntry& e, const std::string& name) {
  REMAT_CHECK(e.dtype == detail::safetensors_dtype<T>(), "safetensors: tensor '{}' has dtype {}, expected {}", name,
              e.dtype, detail::safetensors_dtype<T>());
  BasicTensor<T> t(e.shape);
  if (t.nbytes()) std::memcpy(t.data(), e.data.data(), t.nbytes());
  return t;
}

inline void write_safetensors(const std::string& path, const TensorFile& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, e] : tensors) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape.vec()}, {"data_offsets", {offset, offset + e.data.size()}}};
    offset += e.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  REMAT_CHECK(out.good(), "safetensors: cannot open {} for writing", path);
  const std::uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, e] : tensors) out.write(reinterpret_cast<const char*>(e.data.data()), static_cast<std::streamsize>(e.data.size()));
  REMAT_CHECK(out.good(), "safetensors: writing {} failed", path);
}

inline TensorFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REMAT_CHECK(in.good(), "safetensors: cannot open {}", path);
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REMAT_CHECK(bytes.size() >= 8, "safetensors: {} is {} bytes, too short for the 8-byte header length", path,
              bytes.size());
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{bytes[static_cast<std::size_t>(i)]} << (8 * i);
  REMAT_CHECK(n <= bytes.size() - 8, "safetensors: {} declares a {}-byte header but holds only {} bytes after the "
              "length (truncated?)", path, n, bytes.size() - 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("safetensors: {}: the header is not valid JSON ({})", path, e.what()));
  }
  REMAT_CHECK(header.is_object(), "safetensors: {}: the header is not a JSON object", path);
  const std::size_t data_start = 8 + static_cast<std::size_t>(n);
  const std::size_t buffer = bytes.size() - data_start;
  TensorFile file;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string dtype = info.at("dtype").get<std::string>();
      const std::vector<std::int64_t> shape = info.at("shape").get<std::vector<std::int64_t>>();
      const std::vector<std::uint64_t> off = info.at("data_offsets").get<std::vector<std::uint64_t>>();
      REMAT_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= buffer,
                  "safetensors: {}: tensor '{}' has data offsets outside the {}-byte data (truncated file?)", path, name,
                  buffer);
      REMAT_CHECK(shape.size() <= static_cast<std::size_t>(Shape::kMaxRank),
                  "safetensors: {}: tensor '{}' has rank {}, above remat's maximum {}", path, name, shape.size(),
                  Shape::kMaxRank);
      TensorEntry e{dtype, Shape(shape), {}};
      const std::size_t expected = static_cast<std::size_t>(e.shape.numel()) * detail::dtype_size(dtype, path, name);
      REMAT_CHECK(off[1] - off[0] == expected, "safetensors: {}: tensor '{}' of shape {} and dtype {} needs {} bytes, "
                  "its offsets span {}", path, name, e.shape, dtype, expected, off[1] - off[0]);
      e.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(data_start + off[0]),
                    bytes.begin() + static_cast<std::ptrdiff_t>(data_start + off[1]));
      file.emplace(name, std::move(e));
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("safetensors: {}: tensor '{}' has a malformed entry ({})", path, name, e.what()));
    }
  }
  return file;
}

/// Saves a module's parameters by name (shared parameters once, under their first name).
inline void save(nn::Module& module, const std::string& path) {
  TensorFile file;
  for (auto& [name, p] : module.named_parameters()) file.emplace(name, to_entry(*p));
  write_safetensors(path, file, {{"format", "pt"}});
}

/// Loads every parameter of `module` from `path`. The file must hold exactly the module's
/// parameters, each float32 of the right shape; on any mismatch nothing is changed.
inline void load(nn::Module& module, const std::string& path) {
  const TensorFile file = read_safetensors(path);
  const auto params = module.named_parameters();
  for (const auto& [name, p] : params) {
    const auto it = file.find(name);
    REMAT_CHECK(it != file.end(), "safetensors: {} has no tensor '{}', which the module needs", path, name);
    REMAT_CHECK(it->second.dtype == "F32", "safetensors: {}: tensor '{}' has dtype {}, the module's parameter is F32",
                path, name, it->second.dtype);
    REMAT_CHECK(it->second.shape == p->shape(), "safetensors: {}: tensor '{}' has shape {}, the module's parameter has {}",
                path, name, it->second.shape, p->shape());
  }
  for (const auto& [name, entry] : file) {
    bool known = false;
    for (const auto& [pname, p] : params) known = known || pname == name;
    REMAT_CHECK(known, "safetensors: {} has tensor '{}', which is not a parameter of the module", path, name);
  }
  no_grad guard;
  for (auto& [name, p] : params) std::memcpy(p->data(), file.at(name).data.data(), p->nbytes());
}

}  // namespace remat::io
