#include <filesystem>
#include <map>
#include <cstdio>
#include <fstream>

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
  };
  std::size_t files = 0, valid = 0;
  for (const std::string& name : std::vector<std::string>{
           "valid_f32", "valid_all_dtypes", "valid_empty_and_scalar", "valid_rank4", "overflowing_shape", "float_size",
           "fractional_size", "negative_size", "overlapping", "hole", "trailing_bytes", "duplicate_name",
           "header_too_large", "truncated", "offsets_reversed", "unknown_dtype", "extra_key", "not_an_object",
           "metadata_not_strings"}) {
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
