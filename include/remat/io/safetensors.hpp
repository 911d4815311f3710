#pragma once
// The safetensors format (what PyTorch and Hugging Face users exchange): an 8-byte little-endian
// header length, a JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...},
// then the raw little-endian data. Reading validates everything before anything is used.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "remat/core/tensor.hpp"
#include "remat/core/autograd.hpp"
#include "remat/nn/module.hpp"

/// Reading and writing tensors and training state: safetensors files and checkpoints to resume from.
namespace remat::io {

/// One tensor of a safetensors file, as bytes: dtype is the format's name ("F32", "BF16", "F64", "I64", "BOOL").
struct TensorEntry {
  /// The format's dtype name ("F32", "BF16", "F64", "I64", "BOOL").
  std::string dtype;
  /// The tensor's shape.
  Shape shape;
  /// The raw little-endian bytes, row-major.
  std::vector<unsigned char> data;
};
/// A safetensors file's tensors by name, as read_safetensors returns and write_safetensors takes.
using TensorFile = std::map<std::string, TensorEntry>;

namespace detail {

template <class T>
constexpr const char* safetensors_dtype() {
  if constexpr (std::is_same_v<T, float>) return "F32";
  else if constexpr (std::is_same_v<T, double>) return "F64";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "I64";
  else if constexpr (std::is_same_v<T, bool>) return "BOOL";
  else if constexpr (std::is_same_v<T, bfloat16>) return "BF16";  // PyTorch reads it as torch.bfloat16
  else static_assert(sizeof(T) == 0, "safetensors: unsupported element type");
}

}  // namespace detail

/// The tensor as an entry: its dtype name, shape and a copy of its bytes.
template <class T>
TensorEntry to_entry(const BasicTensor<T>& t) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "safetensors: unsupported element size");
  TensorEntry e{detail::safetensors_dtype<T>(), t.shape(), std::vector<unsigned char>(t.nbytes())};
  if (t.nbytes()) std::memcpy(e.data.data(), t.data(), t.nbytes());
  return e;
}

/// The entry as a tensor of T; its dtype must be T's.
template <class T>
BasicTensor<T> from_entry(const TensorEntry& e, const std::string& name) {
  REMAT_CHECK(e.dtype == detail::safetensors_dtype<T>(), "safetensors: tensor '{}' has dtype {}, expected {}", name,
              e.dtype, detail::safetensors_dtype<T>());
  // Entries read from a file were checked against their shapes; one built by hand may not be.
  const std::size_t bytes = static_cast<std::size_t>(e.shape.numel()) * sizeof(T);
  REMAT_CHECK(e.data.size() == bytes, "safetensors: tensor '{}' of dtype {} and shape {} needs {} bytes, its entry holds {}",
              name, e.dtype, e.shape, bytes, e.data.size());
  BasicTensor<T> t(e.shape);
  if (bytes) std::memcpy(t.data(), e.data.data(), bytes);
  return t;
}

namespace detail {

/// The header length: the file's first 8 bytes, little-endian (the caller checks there are 8).
inline std::uint64_t header_length(const unsigned char* bytes) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{bytes[i]} << (8 * i);
  return n;
}
inline std::uint64_t header_length(const std::string& bytes) {
  return header_length(reinterpret_cast<const unsigned char*>(bytes.data()));
}

/// The directory holding `path` and the name of `path` within it.
inline std::pair<std::string, std::string> split_path(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

/// Removes the temporary files of writers of `path` that died before their rename (a killed
/// save leaves one; nothing else would ever remove it). A temporary is removed only if both its
/// pid field names no process (kill fails with ESRCH) and no one holds its lock (locks die with
/// their process): a live writer — another thread, another process, or a process in another pid
/// namespace sharing the directory — is never touched. The limit: a dead writer's pid reused by a
/// live process keeps its temporary until a later save finds that pid free.
inline void remove_stale_temporaries(const std::string& path) {
  const auto [dir, base] = split_path(path);
  const std::string prefix = base + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;  // creating the temporary reports why the directory is unusable
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (::kill(static_cast<pid_t>(std::stol(digits)), 0) == 0 || errno != ESRCH) continue;
    const std::string stale = dir + "/" + name;
    const int fd = ::open(stale.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(stale.c_str());
    ::close(fd);
  }
  ::closedir(d);
}

/// Replaces `path` with new bytes so that a crash at any moment leaves either the old file or the
/// new one, never a mix or a truncation: written to a temporary file in the same directory,
/// flushed to the device (fsync), renamed over `path` (atomic on POSIX), and the directory
/// flushed so the rename itself is durable. Each writer has a temporary of its own,
/// `<path>.tmp.<pid>.<serial>`, created exclusively and locked until renamed, so concurrent saves
/// of one path (threads or processes) never share one: each is atomic, and the last rename wins.
/// Constructing it begins the save (and first removes dead writers' temporaries); write appends;
/// commit puts the file in place. Destroyed without commit, the temporary is removed.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path) : path_(std::move(path)) {
    remove_stale_temporaries(path_);
    static std::atomic<std::uint64_t> serial{0};
    do {  // EEXIST: a dead writer's temporary with our reused pid
      tmp_ = fmt::format("{}.tmp.{}.{}", path_, ::getpid(), serial.fetch_add(1));
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    } while (fd_ < 0 && errno == EEXIST);
    REMAT_CHECK(fd_ >= 0, "io: cannot save {}: cannot create a temporary file beside it ({}): {}", path_, tmp_,
                std::strerror(errno));
    if (::flock(fd_, LOCK_EX) != 0) fail("cannot lock the temporary file " + tmp_);
  }
  ~AtomicFileWriter() { abandon(); }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const char* data, std::size_t size) {
    REMAT_ASSERT(fd_ >= 0);
    std::size_t done = 0;
    while (done < size) {
      const ::ssize_t n = ::write(fd_, data + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) errno = ENOSPC;
      if (n <= 0) fail("writing the temporary file " + tmp_ + " failed");
      done += static_cast<std::size_t>(n);
    }
  }

  /// Puts the written bytes in place of `path`; the lock is held until the rename is done.
  void commit() {
    REMAT_ASSERT(fd_ >= 0);
    if (::fsync(fd_) != 0) fail("flushing the temporary file " + tmp_ + " failed");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("could not put " + tmp_ + " in place");
    ::close(fd_);  // after a successful fsync and rename, the new file is in place whatever close says
    fd_ = -1;
    const std::string dir = split_path(path_).first;
    if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

  const std::string& temporary() const { return tmp_; }

 private:
  [[noreturn]] void fail(const std::string& what) {
    const std::string why = std::strerror(errno);
    abandon();
    throw Error(fmt::format("io: cannot save {}: {}: {}", path_, what, why));
  }
  void abandon() noexcept {
    if (fd_ < 0) return;
    ::unlink(tmp_.c_str());  // before close: still locked, so no cleaner races the unlink
    ::close(fd_);
    fd_ = -1;
  }

  std::string path_, tmp_;
  int fd_ = -1;
};

/// Replaces `path` with `bytes`, atomically (AtomicFileWriter).
inline void write_file_atomically(const std::string& path, const std::string& bytes) {
  AtomicFileWriter writer(path);
  writer.write(bytes.data(), bytes.size());
  writer.commit();
}

/// The whole of a file (`what` names the reader in errors, with the OS's reason).
inline std::string read_file(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REMAT_CHECK(fd >= 0, "{}: cannot open {}: {}", what, path, std::strerror(errno));
  std::string bytes;
  char buffer[1 << 16];
  for (;;) {
    const ::ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw Error(fmt::format("{}: cannot read {}: {}", what, path, why));
    }
    if (n == 0) break;
    bytes.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return bytes;
}

/// The bytes of a safetensors file.
inline std::string safetensors_bytes(const TensorFile& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, e] : tensors) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape.vec()}, {"data_offsets", {offset, offset + e.data.size()}}};
    offset += e.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out;
  out.reserve(8 + text.size() + offset);
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(static_cast<unsigned char>(n >> (8 * i))));
  out += text;
  for (const auto& [name, e] : tensors) out.append(reinterpret_cast<const char*>(e.data.data()), e.data.size());
  return out;
}

}  // namespace detail

/// Writes a safetensors file atomically (detail::write_file_atomically): a crash leaves the old
/// file or the new one.
inline void write_safetensors(const std::string& path, const TensorFile& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  detail::write_file_atomically(path, detail::safetensors_bytes(tensors, metadata));
}

namespace detail {

/// The largest header the format allows (the reference implementation's limit): a length field
/// above it is a corrupt or hostile file, not a reason to allocate.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// How deep a header may nest: the format needs 3 (header object, entry, shape array); the rest
/// is headroom for tools that add structure. Checked while parsing, before anything deeper is
/// built, so neither the parser, nor the value's destructor, nor an error message's printing of
/// it (all of which recurse once per level somewhere) can exhaust the stack on a hostile file.
inline constexpr int kMaxHeaderDepth = 64;

/// A bounded piece of `text` for an error message (a key or value of a hostile header can be
/// megabytes long).
inline std::string preview(const std::string& text, std::size_t limit = 200) {
  return text.size() <= limit ? text : text.substr(0, limit) + "...";
}

/// A bounded preview of a header value, for error messages: at most about `limit` characters,
/// without printing the whole value first (dump's cost is the value's size).
inline void preview_into(const nlohmann::json& v, std::string& out, std::size_t limit) {
  const auto text = [](const nlohmann::json& s) { return s.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); };
  if (out.size() >= limit) return;
  if (v.is_string()) {
    out += text(preview(v.get_ref<const std::string&>(), limit - out.size()));
  } else if (v.is_object() || v.is_array()) {
    out += v.is_object() ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() < limit; ++it, first = false) {
      if (!first) out += ',';
      if (v.is_object()) out += text(preview(it.key(), limit)) + ":";
      preview_into(it.value(), out, limit);
    }
    out += v.is_object() ? '}' : ']';
  } else {
    out += v.dump();
  }
}
inline std::string preview(const nlohmann::json& v, std::size_t limit = 200) {
  std::string out;
  preview_into(v, out, limit);
  return preview(out, limit);
}

/// The parser's callback: rejects a header nested deeper than kMaxHeaderDepth, and a JSON object
/// that repeats a key (nlohmann keeps the last one silently; the format forbids duplicates, and a
/// file whose meaning depends on which copy wins is not read).
class HeaderCheck {
 public:
  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    // depth counts the containers around this one: the header object starts at 0.
    if ((event == E::object_start || event == E::array_start) && depth >= kMaxHeaderDepth)
      throw Error(fmt::format("the header nests deeper than {} levels", kMaxHeaderDepth));
    if (event == E::object_start) keys_.emplace_back();
    if (event == E::object_end) keys_.pop_back();
    if (event == E::key) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys_.back().insert(k).second) throw Error(fmt::format("the header's key '{}' appears twice", preview(k)));
    }
    return true;
  }

 private:
  std::vector<std::unordered_set<std::string>> keys_;
};

/// A non-negative JSON integer (no floats, no negatives, no strings), or an error naming `what`.
inline std::uint64_t json_size(const nlohmann::json& v, const char* what) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(v.get<std::int64_t>());
  throw Error(fmt::format("{} must be a non-negative integer, got {}", what, preview(v)));
}

/// The bytes of one element of a dtype remat reads; 0 for any other name.
inline std::size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16") return 2;
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "BOOL") return 1;
  return 0;
}

/// One header entry checked against the format: exactly dtype, shape and data_offsets; sizes that
/// are integers whose product (and byte count) fits; offsets within the data buffer.
inline void read_entry(const nlohmann::json& info, std::uint64_t buffer, std::string& dtype, std::vector<std::int64_t>& shape,
                       std::uint64_t& begin, std::uint64_t& end) {
  REMAT_CHECK(info.is_object() && info.size() == 3 && info.contains("dtype") && info.contains("shape") &&
                  info.contains("data_offsets"),
              "the entry must be an object with exactly dtype, shape and data_offsets, got {}", preview(info));
  REMAT_CHECK(info["dtype"].is_string(), "dtype must be a string, got {}", preview(info["dtype"]));
  dtype = info["dtype"].get<std::string>();
  const std::size_t element = dtype_bytes(dtype);
  REMAT_CHECK(element != 0, "dtype {} is not one remat reads (F32, BF16, F64, I64, BOOL)", preview(dtype));
  const nlohmann::json& sizes = info["shape"];
  REMAT_CHECK(sizes.is_array() && sizes.size() <= static_cast<std::size_t>(Shape::kMaxRank),
              "shape must be an array of at most {} sizes, got {}", Shape::kMaxRank, preview(sizes));
  std::uint64_t bytes = element;
  shape.clear();
  for (const nlohmann::json& v : sizes) {
    const std::uint64_t n = json_size(v, "every size in shape");
    REMAT_CHECK(n == 0 || bytes <= static_cast<std::uint64_t>(Shape::kMaxNumel) / n,
                "shape {} has more elements than a tensor can hold", preview(sizes));
    bytes *= n;
    shape.push_back(static_cast<std::int64_t>(n));
  }
  const nlohmann::json& off = info["data_offsets"];
  REMAT_CHECK(off.is_array() && off.size() == 2, "data_offsets must be [begin, end], got {}", preview(off));
  begin = json_size(off[0], "data_offsets[0]");
  end = json_size(off[1], "data_offsets[1]");
  REMAT_CHECK(begin <= end && end <= buffer, "data_offsets [{}, {}] are outside the {}-byte data (truncated file?)",
              begin, end, buffer);
  REMAT_CHECK(end - begin == bytes, "shape {} of dtype {} needs {} bytes, its data_offsets span {}", preview(sizes), dtype,
              bytes, end - begin);
}

/// The JSON of a header (bytes [begin, end)), nested at most kMaxHeaderDepth deep and without
/// repeated keys; `source` names it in errors.
inline nlohmann::json parse_header(const unsigned char* begin, const unsigned char* end, const std::string& source) {
  try {
    return nlohmann::json::parse(begin, end, HeaderCheck{});
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("safetensors: {}: the header is not valid JSON ({})", source, preview(std::string(e.what()), 400)));
  } catch (const Error& e) {
    throw Error(fmt::format("safetensors: {}: {}", source, e.what()));
  }
}

}  // namespace detail

/// Parses a safetensors image held in memory; `source` names it in errors (a path, say). Every
/// rule of the format is checked before anything is returned: the header length is bounded and
/// within the image, the header is a JSON object without repeated keys, sizes and offsets are
/// integers with checked arithmetic, and the tensors' byte ranges tile the data buffer exactly
/// (no overlap, no hole, nothing after the last one).
inline TensorFile parse_safetensors(const unsigned char* bytes, std::size_t size, const std::string& source) {
  REMAT_CHECK(size >= 8, "safetensors: {} is {} bytes, too short for the 8-byte header length", source, size);
  const std::uint64_t n = detail::header_length(bytes);
  REMAT_CHECK(n <= detail::kMaxHeaderBytes, "safetensors: {} declares a {}-byte header, above the format's limit of {} "
              "bytes (corrupt file?)", source, n, detail::kMaxHeaderBytes);
  REMAT_CHECK(n <= size - 8, "safetensors: {} declares a {}-byte header but holds only {} bytes after the length "
              "(truncated?)", source, n, size - 8);
  const nlohmann::json header = detail::parse_header(bytes + 8, bytes + 8 + n, source);
  REMAT_CHECK(header.is_object(), "safetensors: {}: the header is not a JSON object", source);
  const std::uint64_t buffer = size - 8 - n;
  const unsigned char* data = bytes + 8 + n;
  struct Range {
    std::uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  TensorFile file;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      REMAT_CHECK(info.is_object(), "safetensors: {}: __metadata__ must be an object of strings", source);
      for (const auto& [k, v] : info.items())
        REMAT_CHECK(v.is_string(), "safetensors: {}: __metadata__ value '{}' is not a string", source, detail::preview(k));
      continue;
    }
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t begin = 0, end = 0;
    try {
      detail::read_entry(info, buffer, dtype, shape, begin, end);
    } catch (const Error& e) {
      throw Error(fmt::format("safetensors: {}: tensor '{}': {}", source, detail::preview(name), e.what()));
    }
    ranges.push_back({begin, end, name});
    file.emplace(name, TensorEntry{dtype, Shape(shape), std::vector<unsigned char>(data + begin, data + end)});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  for (const Range& r : ranges) {
    REMAT_CHECK(r.begin == covered, "safetensors: {}: tensor '{}' starts at byte {} of the data, but the previous tensor "
                "ends at {} ({}); the format requires the tensors to tile the data exactly", source, r.name, r.begin,
                covered, r.begin < covered ? "they overlap" : "a hole");
    covered = r.end;
  }
  REMAT_CHECK(covered == buffer, "safetensors: {}: the tensors cover {} bytes of data but the file holds {} (trailing "
              "bytes)", source, covered, buffer);
  return file;
}

/// Reads the safetensors file at `path`: its tensors by name, checked to tile its data exactly.
inline TensorFile read_safetensors(const std::string& path) {
  const std::string bytes = detail::read_file(path, "safetensors");
  return parse_safetensors(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), path);
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
