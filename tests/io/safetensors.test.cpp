#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <cstdio>
#include <fstream>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include "support.hpp"

using namespace remat;

namespace {
using test::TempFile;

nn::GPT make_gpt(std::uint64_t seed) {
  Generator g(seed);
  return nn::GPT(test::gpt_config(7, 4, 1, 1, 4), g);
}

std::vector<std::vector<float>> snapshot(nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (Tensor* p : m.parameters()) out.push_back(p->to_vector());
  return out;
}
}  // namespace

TEST_CASE("safetensors: a module round-trips through a file", "[io][safetensors]") {
  TempFile f("roundtrip");
  nn::GPT a = make_gpt(1), b = make_gpt(2);
  REQUIRE(snapshot(a) != snapshot(b));
  io::save(a, f.path);
  io::load(b, f.path);
  CHECK(snapshot(a) == snapshot(b));
  const io::TensorFile file = io::read_safetensors(f.path);
  CHECK(file.at("transformer.wte.weight").dtype == "F32");
  CHECK(file.at("transformer.wte.weight").shape == Shape{7, 4});
}

TEST_CASE("safetensors: raw tensors of several dtypes round-trip", "[io][safetensors]") {
  TempFile f("dtypes");
  io::write_safetensors(f.path, {{"ids", io::to_entry(tensor<std::int64_t>({3, -1}))},
                                 {"x", io::to_entry(tensor<double>({0.5, 2.0}, {1, 2}))}});
  const io::TensorFile file = io::read_safetensors(f.path);
  CHECK(test::values(io::from_entry<std::int64_t>(file.at("ids"), "ids")) == std::vector<std::int64_t>{3, -1});
  CHECK(io::from_entry<double>(file.at("x"), "x").shape() == Shape{1, 2});
  REQUIRE_ERROR(io::from_entry<float>(file.at("x"), "x"), "'x'", "F64", "F32");
}

TEST_CASE("safetensors: bad files throw and leave the module unchanged", "[io][safetensors]") {
  TempFile good("good"), bad("bad");
  nn::GPT a = make_gpt(1);
  io::save(a, good.path);
  nn::GPT b = make_gpt(2);
  const auto before = snapshot(b);

  SECTION("truncated") {
    std::ifstream in(good.path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(bad.path, std::ios::binary) << bytes.substr(0, bytes.size() - 10);
    REQUIRE_ERROR(io::load(b, bad.path), "truncated");
  }
  SECTION("not safetensors at all") {
    std::ofstream(bad.path, std::ios::binary) << "hello";
    REQUIRE_ERROR(io::load(b, bad.path), "too short");
  }
  SECTION("wrong dtype") {
    io::TensorFile file = io::read_safetensors(good.path);
    file["lm_head.weight"] = io::to_entry(zeros<double>({7, 4}));
    io::write_safetensors(bad.path, file);
    REQUIRE_ERROR(io::load(b, bad.path), "lm_head.weight", "F64");
  }
  SECTION("wrong shape") {
    io::TensorFile file = io::read_safetensors(good.path);
    file["lm_head.weight"] = io::to_entry(zeros({4, 7}));
    io::write_safetensors(bad.path, file);
    REQUIRE_ERROR(io::load(b, bad.path), "lm_head.weight", "(4, 7)", "(7, 4)");
  }
  SECTION("unknown name") {
    io::TensorFile file = io::read_safetensors(good.path);
    file["extra.weight"] = io::to_entry(zeros({1}));
    io::write_safetensors(bad.path, file);
    REQUIRE_ERROR(io::load(b, bad.path), "extra.weight", "not a parameter");
  }
  SECTION("missing name") {
    io::TensorFile file = io::read_safetensors(good.path);
    file.erase("transformer.wpe.weight");
    io::write_safetensors(bad.path, file);
    REQUIRE_ERROR(io::load(b, bad.path), "transformer.wpe.weight", "needs");
  }
  SECTION("missing file") { REQUIRE_ERROR(io::load(b, "/nonexistent/remat.safetensors"), "cannot open"); }
  CHECK(snapshot(b) == before);
}

namespace {

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

// The fuzzer's seed corpus and every input it ever crashed on (tests/fuzz/corpus/safetensors):
// each parses, or is rejected with remat::Error — never another exception, never a crash.
TEST_CASE("safetensors: every corpus file parses or is rejected with remat::Error", "[io][safetensors][fuzz]") {
  const std::string dir = REMAT_FUZZ_CORPUS;
  const std::map<std::string, std::vector<const char*>> expected{
      {"overflowing_shape", {"'x'", "more elements"}},
      {"float_size", {"'x'", "non-negative integer", "1e+300"}},
      {"fractional_size", {"'x'", "non-negative integer", "-1.5"}},
      {"negative_size", {"'x'", "non-negative integer", "-1"}},
      {"overlapping", {"'b'", "overlap"}},
      {"hole", {"'b'", "a hole"}},
      {"trailing_bytes", {"trailing bytes"}},
      {"duplicate_name", {"'a' appears twice"}},
      {"header_too_large", {"above the format's limit"}},
      {"truncated", {"outside the", "truncated"}},
      {"offsets_reversed", {"'a'", "data_offsets [4, 0]"}},
      {"unknown_dtype", {"'a'", "F16"}},
      {"extra_key", {"'a'", "exactly dtype, shape and data_offsets"}},
      {"not_an_object", {"not a JSON object"}},
      {"metadata_not_strings", {"__metadata__"}},
      {"deep_arrays_entry", {"nests deeper than 64 levels"}},
      {"deep_objects_shape", {"nests deeper than 64 levels"}},
      {"deep_arrays_metadata", {"nests deeper than 64 levels"}},
      {"deep_objects_header", {"nests deeper than 64 levels"}},
  };
  std::size_t files = 0, valid = 0;
  for (const std::string& name : std::vector<std::string>{
           "valid_f32", "valid_all_dtypes", "valid_empty_and_scalar", "valid_rank4", "overflowing_shape", "float_size",
           "fractional_size", "negative_size", "overlapping", "hole", "trailing_bytes", "duplicate_name",
           "header_too_large", "truncated", "offsets_reversed", "unknown_dtype", "extra_key", "not_an_object",
           "metadata_not_strings", "deep_arrays_entry", "deep_objects_shape", "deep_arrays_metadata",
           "deep_objects_header"}) {
    const std::string path = dir + "/" + name + ".safetensors";
    const std::vector<unsigned char> bytes = read_bytes(path);
    REQUIRE(!bytes.empty());
    ++files;
    INFO(path);
    if (name.rfind("valid_", 0) == 0) {
      const io::TensorFile f = io::parse_safetensors(bytes.data(), bytes.size(), path);
      CHECK(!f.empty());
      ++valid;
      continue;
    }
    const auto& fragments = expected.at(name);
    bool threw = false;
    try {
      io::parse_safetensors(bytes.data(), bytes.size(), path);
    } catch (const Error& e) {
      threw = true;
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find(path) != std::string::npos);  // the file is named
      for (const char* fragment : fragments) CHECK(msg.find(fragment) != std::string::npos);
    }
    CHECK(threw);
  }
  CHECK(valid == 4);
  // Inputs the fuzzer found (crash-*, leak-*, timeout-* files added by hand) and any other file
  // in the folder: parse or remat::Error.
  std::size_t others = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::vector<unsigned char> bytes = read_bytes(entry.path().string());
    try {
      io::parse_safetensors(bytes.data(), bytes.size(), entry.path().string());
    } catch (const Error&) {
    }
    ++others;
  }
  CHECK(others >= files);
}

TEST_CASE("safetensors: values read back are the values written, for every dtype in the corpus", "[io][safetensors]") {
  const std::vector<unsigned char> bytes = read_bytes(std::string(REMAT_FUZZ_CORPUS) + "/valid_all_dtypes.safetensors");
  const io::TensorFile f = io::parse_safetensors(bytes.data(), bytes.size(), "valid_all_dtypes");
  CHECK(io::from_entry<float>(f.at("a"), "a").to_vector() == std::vector<float>{1.5f, -2.0f});
  CHECK(io::from_entry<double>(f.at("b"), "b").to_vector() == std::vector<double>{3.25});
  CHECK(io::from_entry<std::int64_t>(f.at("c"), "c").to_vector() == std::vector<std::int64_t>{-7});
  CHECK(f.at("d").data == std::vector<unsigned char>{1, 0, 1});
  REQUIRE_ERROR(Shape({std::int64_t{1} << 40, std::int64_t{1} << 40}), "Shape", "more than");
}

namespace {

/// The temporary files of savers of `path` left in its directory (the current one).
std::vector<std::string> temporaries(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("."))
    if (e.path().filename().string().rfind(path + ".tmp.", 0) == 0) out.push_back(e.path().string());
  return out;
}

io::TensorFile filled(float value, std::int64_t n = 4096) {
  return {{"w", io::to_entry(full({n}, value))}};
}

}  // namespace

TEST_CASE("safetensors: a save removes the temporaries of writers killed mid-save, never a live writer's",
          "[io][safetensors][atomic]") {
  TempFile f("stale_temporaries");
  io::write_safetensors(f.path, filled(1));
  for (int k = 0; k < 3; ++k) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // what a SIGKILL mid-save leaves: the temporary, its lock released, its pid dead
      try {
        io::detail::AtomicFileWriter writer(f.path);
        writer.write("partial", 7);
        ::_exit(0);
      } catch (...) {
        ::_exit(1);
      }
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
    REQUIRE(temporaries(f.path).size() == 1);  // each writer removed its dead predecessor's
  }
  io::detail::AtomicFileWriter live(f.path);  // this process's, mid-save: left alone
  io::write_safetensors(f.path, filled(2));
  CHECK(temporaries(f.path) == std::vector<std::string>{"./" + live.temporary()});
  CHECK(io::read_safetensors(f.path).at("w").data == filled(2).at("w").data);
  const std::string bytes = io::detail::safetensors_bytes(filled(3), {});
  live.write(bytes.data(), bytes.size());
  live.commit();
  CHECK(temporaries(f.path).empty());
  CHECK(io::read_safetensors(f.path).at("w").data == filled(3).at("w").data);
}

TEST_CASE("safetensors: threads saving one path at once each save atomically, no temporary remains",
          "[io][safetensors][atomic]") {
  TempFile f("concurrent");
  io::write_safetensors(f.path, filled(-1));
  constexpr int kThreads = 4, kRounds = 25;
  std::atomic<int> failures{0};
  std::string first_failure;
  std::mutex mutex;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        try {
          io::write_safetensors(f.path, filled(static_cast<float>(t)));
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mutex);
          if (failures++ == 0) first_failure = e.what();
        }
      }
    });
  for (std::thread& t : threads) t.join();
  INFO(first_failure);
  CHECK(failures == 0);
  const std::vector<unsigned char> got = io::read_safetensors(f.path).at("w").data;
  bool one_of_them = false;
  for (int t = 0; t < kThreads; ++t) one_of_them = one_of_them || got == filled(static_cast<float>(t)).at("w").data;
  CHECK(one_of_them);
  CHECK(temporaries(f.path).empty());
}

TEST_CASE("safetensors: a save or load that the OS refuses names the file and the OS's reason", "[io][safetensors]") {
  const char* const missing = std::strerror(ENOENT);
  REQUIRE_ERROR(io::write_safetensors("/no/such/dir/x.safetensors", filled(1)),
                "cannot save /no/such/dir/x.safetensors", "temporary file", missing);
  REQUIRE_ERROR(io::read_safetensors("/no/such/dir/x.safetensors"), "/no/such/dir/x.safetensors", missing);
  const char* const directory = std::strerror(EISDIR);
  REQUIRE_ERROR(io::read_safetensors("/"), "cannot read /", directory);
}

namespace {

/// A safetensors image whose header is `header` (unpadded) and whose data is 4 zero bytes.
std::vector<unsigned char> image_with_header(const std::string& header) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(header.size() >> (8 * i)));
  out += header + std::string(4, '\0');
  return {out.begin(), out.end()};
}

std::string nested_arrays(std::size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }
std::string nested_objects(std::size_t levels) {
  std::string out;
  for (std::size_t i = 0; i < levels; ++i) out += "{\"a\":";
  return out + "1" + std::string(levels, '}');
}

}  // namespace

TEST_CASE("safetensors: a header nested deeper than 64 levels is an error wherever the nesting is, never a crash",
          "[io][safetensors][fuzz]") {
  for (const auto& deep : {nested_arrays(100'000), nested_objects(100'000)}) {
    for (const std::string& header :
         {deep, "{\"x\":" + deep + "}", "{\"x\":{\"dtype\":\"F32\",\"shape\":" + deep + ",\"data_offsets\":[0,4]}}",
          "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"__metadata__\":{\"m\":" + deep + "}}",
          "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":" + deep + "}}"}) {
      INFO(header.substr(0, 60));
      const std::vector<unsigned char> bytes = image_with_header(header);
      REQUIRE_ERROR(io::parse_safetensors(bytes.data(), bytes.size(), "deep.safetensors"),
                    "safetensors: deep.safetensors: the header nests deeper than 64 levels");
    }
  }
  // 64 levels (header, __metadata__ and 62 arrays) are read, and fail for their real reason; 65 are not.
  const std::string entry = "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}";
  const auto metadata = [&](std::size_t arrays) {
    return image_with_header("{" + entry + ",\"__metadata__\":{\"m\":" + nested_arrays(arrays) + "}}");
  };
  const std::vector<unsigned char> at_limit = metadata(62), past_limit = metadata(63);
  REQUIRE_ERROR(io::parse_safetensors(at_limit.data(), at_limit.size(), "f"), "__metadata__ value 'm' is not a string");
  REQUIRE_ERROR(io::parse_safetensors(past_limit.data(), past_limit.size(), "f"), "nests deeper than 64 levels");
  // A long value is shown in a message as a bounded preview.
  const std::vector<unsigned char> wide = image_with_header(
      "{\"x\":{\"dtype\":\"F32\",\"shape\":[" + std::string(100'000, '7') + "],\"data_offsets\":[0,4]}}");
  try {
    io::parse_safetensors(wide.data(), wide.size(), "f");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).size() < 1000);
  }
}
