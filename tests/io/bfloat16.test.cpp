#include <cstring>
#include <fstream>
#include <iterator>

#include "support.hpp"

using namespace remat;

namespace {

std::uint16_t bits_of(bfloat16 h) { return Eigen::numext::bit_cast<std::uint16_t>(h); }

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A safetensors image of one header (padded to 8 bytes, as writers do) and `data`.
std::vector<unsigned char> image(std::string header, const std::vector<unsigned char>& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<unsigned char> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(header.size() >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

}  // namespace

TEST_CASE("safetensors: BF16 tensors round-trip bit for bit, every pattern", "[io][safetensors][bfloat16]") {
  test::TempFile f("bf16_roundtrip");
  BFloat16Tensor all({256, 256});  // every bfloat16: zeros, subnormals, infinities, NaN payloads
  for (std::uint32_t u = 0; u < 65536; ++u) all.data()[u] = Eigen::numext::bit_cast<bfloat16>(static_cast<std::uint16_t>(u));
  const Tensor x = randn({3, 5});
  io::write_safetensors(f.path, {{"all", io::to_entry(all)}, {"x", io::to_entry(x)}, {"h", io::to_entry(to<bfloat16>(x))}});
  const io::TensorFile file = io::read_safetensors(f.path);
  CHECK(file.at("all").dtype == "BF16");
  CHECK(file.at("all").shape == Shape{256, 256});
  CHECK(file.at("all").data.size() == 2 * 65536);
  const BFloat16Tensor back = io::from_entry<bfloat16>(file.at("all"), "all");
  CHECK(std::memcmp(back.data(), all.data(), all.nbytes()) == 0);
  const BFloat16Tensor h = io::from_entry<bfloat16>(file.at("h"), "h");
  const Tensor xf = io::from_entry<float>(file.at("x"), "x");
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(bits_of(h.data()[i]) == detail::bfloat16_bits(xf.data()[i]));
  REQUIRE_ERROR(io::from_entry<float>(file.at("h"), "h"), "'h'", "BF16", "F32");
  REQUIRE_ERROR(io::from_entry<bfloat16>(file.at("x"), "x"), "'x'", "F32", "BF16");
}

TEST_CASE("safetensors: BF16 is written little-endian, 2 bytes an element, under the format's name",
          "[io][safetensors][bfloat16]") {
  test::TempFile f("bf16_layout");
  io::write_safetensors(f.path, {{"h", io::to_entry(to<bfloat16>(tensor({1.5f, -2.0f})))}});
  const std::vector<unsigned char> bytes = file_bytes(f.path);
  REQUIRE(bytes.size() >= 12);
  const std::string header(bytes.begin() + 8, bytes.end() - 4);
  CHECK(header.find(R"("h":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]})") != std::string::npos);
  CHECK(std::vector<unsigned char>(bytes.end() - 4, bytes.end()) == std::vector<unsigned char>{0xc0, 0x3f, 0x00, 0xc0});
}

TEST_CASE("safetensors: a BF16 tensor whose bytes do not match its shape is rejected", "[io][safetensors][bfloat16]") {
  const std::string entry = R"({"h":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,)";
  for (std::size_t size : {6u, 11u, 13u, 24u}) {  // the element counted as 1, 4 bytes; one byte off
    const std::vector<unsigned char> bytes = image(entry + std::to_string(size) + "]}}", std::vector<unsigned char>(size));
    INFO(size << " bytes");
    REQUIRE_ERROR(io::parse_safetensors(bytes.data(), bytes.size(), "bf16.safetensors"), "bf16.safetensors", "'h'",
                  "dtype BF16 needs 12 bytes");
  }
  const std::vector<unsigned char> good = image(entry + "12]}}", std::vector<unsigned char>(12));
  CHECK(io::parse_safetensors(good.data(), good.size(), "bf16.safetensors").at("h").shape == Shape{2, 3});
  // An entry built by hand is checked too before its bytes are copied.
  const io::TensorEntry short_entry{"BF16", Shape{2, 3}, std::vector<unsigned char>(11)};
  REQUIRE_ERROR(io::from_entry<bfloat16>(short_entry, "h"), "'h'", "BF16", "(2, 3)", "needs 12 bytes", "holds 11");
}

TEST_CASE("safetensors: the fuzz corpus's BF16 seeds read as written, or are rejected", "[io][safetensors][bfloat16]") {
  const std::string dir = REMAT_FUZZ_CORPUS;
  const std::vector<unsigned char> valid = file_bytes(dir + "/valid_bf16.safetensors");
  const io::TensorFile f = io::parse_safetensors(valid.data(), valid.size(), "valid_bf16");
  const BFloat16Tensor h = io::from_entry<bfloat16>(f.at("h"), "h");
  std::vector<std::uint16_t> bits;
  for (std::int64_t i = 0; i < h.numel(); ++i) bits.push_back(bits_of(h.data()[i]));
  CHECK(bits == std::vector<std::uint16_t>{0x3fc0, 0xc000, 0x7f80, 0x7fc0, 0x0001});
  const Tensor x = to<float>(h);
  CHECK(x.data()[0] == 1.5f);
  CHECK(x.data()[1] == -2.0f);
  CHECK(std::isinf(x.data()[2]));
  CHECK(std::isnan(x.data()[3]));
  CHECK(x.data()[4] == std::ldexp(1.0f, -133));  // the smallest bfloat16 subnormal
  const std::vector<unsigned char> bad = file_bytes(dir + "/bf16_size_mismatch.safetensors");
  REQUIRE(!bad.empty());
  REQUIRE_ERROR(io::parse_safetensors(bad.data(), bad.size(), "bf16_size_mismatch"), "'h'", "BF16", "needs 10 bytes",
                "span 9");
}
