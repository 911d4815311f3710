#include <cstdio>
#include <fstream>

#include "support.hpp"

using namespace remat;

namespace {
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& name) : path("remat_test_" + name + ".safetensors") {}
  ~TempFile() { std::remove(path.c_str()); }
};

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
