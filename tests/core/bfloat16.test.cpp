#include <cmath>
#include <cstring>
#include <random>

#include "support.hpp"

using namespace remat;

namespace {

float float_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
std::uint16_t bits_of(bfloat16 h) { return Eigen::numext::bit_cast<std::uint16_t>(h); }
bfloat16 bf16_of(std::uint16_t u) { return Eigen::numext::bit_cast<bfloat16>(u); }

/// The bfloat16 bits round-to-nearest-even gives for x, from the definition rather than the bit
/// trick: the nearer of the two bfloat16 values around x, the even one at a tie, the value above
/// the largest finite one being 2^128 (so that half an ulp above it rounds to the infinity). NaN:
/// a NaN of x's sign with the quiet bit set and the upper 7 bits of its payload.
std::uint16_t rne_reference(std::uint32_t u) {
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  if (magnitude == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7f80u);
  const std::uint16_t lo = static_cast<std::uint16_t>(magnitude >> 16), hi = static_cast<std::uint16_t>(lo + 1);
  const auto value = [](std::uint16_t m) {
    return m == 0x7f80u ? std::ldexp(1.0, 128) : static_cast<double>(float_of(std::uint32_t{m} << 16));
  };
  const double x = static_cast<double>(float_of(magnitude));
  const double below = x - value(lo), above = value(hi) - x;  // exact in double
  const std::uint16_t m = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | m);
}

/// Every exponent of both signs with every kept fraction (7 bits) and dropped halves at and around
/// the tie; every dropped half at exponents 0 (subnormals), 1, 126, 127, 254 and 255 (infinities
/// and NaNs) for an even and an odd kept fraction; then `random` uniformly random patterns.
std::vector<std::uint32_t> patterns(std::size_t random) {
  std::vector<std::uint32_t> out;
  std::mt19937 rng(27);
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t exponent = 0; exponent < 256; ++exponent)
      for (std::uint32_t kept = 0; kept < 128; ++kept)
        for (std::uint32_t dropped : {0x0000u, 0x0001u, 0x7ffeu, 0x7fffu, 0x8000u, 0x8001u, 0xfffeu, 0xffffu,
                                      static_cast<std::uint32_t>(rng() & 0xffffu)})
          out.push_back(sign | exponent << 23 | kept << 16 | dropped);
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t exponent : {0u, 1u, 126u, 127u, 254u, 255u})
      for (std::uint32_t kept : {0u, 1u, 64u, 127u})
        for (std::uint32_t dropped = 0; dropped < 0x10000u; ++dropped) out.push_back(sign | exponent << 23 | kept << 16 | dropped);
  for (std::size_t i = 0; i < random; ++i) out.push_back(static_cast<std::uint32_t>(rng()));
  return out;
}

Tensor floats_of(const std::vector<std::uint32_t>& bits) {
  Tensor t({static_cast<std::int64_t>(bits.size())});
  std::memcpy(t.data(), bits.data(), bits.size() * sizeof(float));
  return t;
}

}  // namespace

TEST_CASE("bfloat16: the element type is Eigen's, 2 bytes, named bfloat16", "[core][bfloat16]") {
  STATIC_REQUIRE(std::is_same_v<bfloat16, Eigen::bfloat16>);
  STATIC_REQUIRE(std::is_same_v<BFloat16Tensor, BasicTensor<bfloat16>>);
  STATIC_REQUIRE(sizeof(bfloat16) == 2);
  CHECK(std::string(BFloat16Tensor::dtype()) == "bfloat16");
  CHECK(std::string(Tensor::dtype()) == "float32");
  const BFloat16Tensor t = zeros<bfloat16>({3, 5});
  CHECK(t.nbytes() == 30);
  CHECK(t.ref().dtype == std::string("bfloat16"));
  CHECK_FALSE(t.requires_grad());
}

TEST_CASE("bfloat16: factories fill the values they promise", "[core][bfloat16]") {
  const auto as_floats = [](const BFloat16Tensor& t) { return test::values(to<float>(t)); };
  CHECK(as_floats(zeros<bfloat16>({2, 2})) == std::vector<float>{0, 0, 0, 0});
  CHECK(as_floats(ones<bfloat16>({3})) == std::vector<float>{1, 1, 1});
  CHECK(as_floats(full<bfloat16>({2}, bfloat16(2.5f))) == std::vector<float>{2.5f, 2.5f});
  CHECK(as_floats(scalar(bfloat16(-3.0f))) == std::vector<float>{-3.0f});
  CHECK(scalar(bfloat16(-3.0f)).dim() == 0);
  const BFloat16Tensor t = tensor<bfloat16>({bfloat16(1.0f), bfloat16(2.0f), bfloat16(3.0f), bfloat16(4.0f)}, {2, 2});
  CHECK(static_cast<float>(t.at({1, 0})) == 3.0f);
  CHECK(as_floats(zeros_like(t)) == std::vector<float>{0, 0, 0, 0});
  CHECK(as_floats(ones_like(t)) == std::vector<float>{1, 1, 1, 1});
  const BFloat16Tensor e = empty<bfloat16>({4, 0, 2});
  CHECK(e.numel() == 0);
  CHECK(to<bfloat16>(Tensor(Shape{0})).numel() == 0);
  REQUIRE_ERROR(t.item(), "item", "(2, 2)");
}

TEST_CASE("bfloat16: memory books count 2 bytes an element", "[core][bfloat16][memory]") {
  const std::size_t before = memory_stats().live_bytes;
  {
    const BFloat16Tensor a = zeros<bfloat16>({10, 10});
    CHECK(memory_stats().live_bytes - before == 200);
    const Tensor x = zeros({1000});
    MemoryScope scope;
    const BFloat16Tensor h = to<bfloat16>(x);
    CHECK(scope.peak_bytes_above_start() == 2000);
    CHECK(memory_stats().live_bytes - before == 200 + 4000 + 2000);
  }
  CHECK(memory_stats().live_bytes == before);
}

TEST_CASE("bfloat16: a tensor prints its values as floats", "[core][bfloat16]") {
  const BFloat16Tensor t = to<bfloat16>(tensor({1.5f, -2.0f, 0.1f, 3e38f}, {2, 2}));
  // 0.1 is 0.10009765625 in bfloat16, 3e38 is 3.00405527e38 (as PyTorch prints them).
  CHECK(fmt::format("{}", t) == "tensor([[1.5, -2],\n        [0.1001, 3.004e+38]], shape=(2, 2), dtype=bfloat16)");
  CHECK(fmt::format("{}", scalar(bfloat16(0.5f))) == "tensor(0.5, shape=(), dtype=bfloat16)");
}

TEST_CASE("bfloat16: narrowing rounds to nearest even at the cases that matter", "[core][bfloat16]") {
  const std::vector<std::pair<std::uint32_t, std::uint16_t>> cases{
      {0x3f800000u, 0x3f80u},  // 1
      {0x3f808000u, 0x3f80u},  // a tie, even below: down
      {0x3f818000u, 0x3f82u},  // a tie, odd below: up
      {0x3f807fffu, 0x3f80u},  // just under the tie
      {0x3f808001u, 0x3f81u},  // just over it
      {0xbf818000u, 0xbf82u},  // ties are symmetric in sign
      {0x00000000u, 0x0000u}, {0x80000000u, 0x8000u},  // signed zeros
      {0x00000001u, 0x0000u},  // the smallest subnormal: far under half a bfloat16 ulp
      {0x00008000u, 0x0000u},  // a subnormal tie, even below
      {0x00018000u, 0x0002u},  // a subnormal tie, odd below
      {0x00008001u, 0x0001u},  // the smallest bfloat16 subnormal
      {0x007fffffu, 0x0080u},  // the largest subnormal rounds up to the smallest normal
      {0x807fffffu, 0x8080u},
      {0x7f7f7fffu, 0x7f7fu},  // under half an ulp above the largest bfloat16
      {0x7f7f8000u, 0x7f80u},  // half an ulp above it: a tie with an odd lsb overflows to inf
      {0x7f7fffffu, 0x7f80u},  // FLT_MAX
      {0xff7fffffu, 0xff80u},
      {0x7f800000u, 0x7f80u}, {0xff800000u, 0xff80u},  // infinities
      {0x7fc00000u, 0x7fc0u}, {0xffc00000u, 0xffc0u},  // quiet NaNs keep their sign
      {0x7f800001u, 0x7fc0u},  // a signalling NaN whose payload truncation drops: quiet, not inf
      {0xff800001u, 0xffc0u},
      {0x7fa00000u, 0x7fe0u},  // the upper payload is kept
      {0xffffffffu, 0xffffu},
  };
  std::vector<std::uint32_t> inputs;
  for (const auto& [in, out] : cases) {
    INFO(fmt::format("{:#010x}", in));
    CHECK(detail::bfloat16_bits(float_of(in)) == out);
    CHECK(rne_reference(in) == out);
  }
  for (int copy = 0; copy < 4; ++copy)  // long enough for the vector kernel's blocks, not only its tail
    for (const auto& c : cases) inputs.push_back(c.first);
  const BFloat16Tensor h = to<bfloat16>(floats_of(inputs));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    INFO(fmt::format("{:#010x} on the {} kernel", inputs[i], detail::bfloat16_kernel()));
    CHECK(bits_of(h.data()[i]) == cases[i % cases.size()].second);
  }
  // Eigen's own float -> bfloat16 (what bfloat16(x) does) rounds every non-NaN case the same way.
  for (const auto& [in, out] : cases)
    if (!std::isnan(float_of(in))) CHECK(bits_of(bfloat16(float_of(in))) == out);
}

TEST_CASE("bfloat16: the kernel to<bfloat16> runs gives the scalar rule's bits for every kind of pattern",
          "[core][bfloat16]") {
  const std::vector<std::uint32_t> bits = patterns(4'000'000);
  const Tensor x = floats_of(bits);
  const std::int64_t n = x.numel();
  BFloat16Tensor kernel(x.shape());
  detail::narrow_to_bfloat16(x.data(), kernel.data(), n);
  const BFloat16Tensor api = to<bfloat16>(x);
  std::int64_t differ_kernel = 0, differ_api = 0, differ_definition = 0;
  std::uint32_t first_bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint16_t scalar = detail::bfloat16_bits(x.data()[i]);
    const std::uint32_t u = bits[static_cast<std::size_t>(i)];
    if (bits_of(kernel.data()[i]) != scalar && !differ_kernel++) first_bad = u;
    if (bits_of(api.data()[i]) != scalar) ++differ_api;
    if (rne_reference(u) != scalar) ++differ_definition;
  }
  INFO(fmt::format("{} patterns on the {} kernel; first kernel mismatch at {:#010x}", n, detail::bfloat16_kernel(),
                   first_bad));
  CHECK(n > 5'000'000);
  CHECK(differ_kernel == 0);
  CHECK(differ_api == 0);
  CHECK(differ_definition == 0);
}

TEST_CASE("bfloat16: any length at any offset converts each element by the same rule", "[core][bfloat16]") {
  // Subnormals among normals land in every lane of the vector kernel and in its scalar tail.
  std::vector<std::uint32_t> bits;
  for (std::uint32_t i = 0; i < 200; ++i) bits.push_back(i % 3 == 0 ? 0x00018000u + i : 0x3f818000u + (i << 8));
  const Tensor x = floats_of(bits);
  for (std::int64_t offset = 0; offset < 17; ++offset)
    for (std::int64_t n : {0, 1, 15, 16, 17, 31, 33, 64, 150}) {
      std::vector<bfloat16> out(static_cast<std::size_t>(n));
      detail::narrow_to_bfloat16(x.data() + offset, out.data(), n);
      for (std::int64_t i = 0; i < n; ++i) {
        INFO("offset " << offset << ", length " << n << ", element " << i);
        CHECK(bits_of(out[static_cast<std::size_t>(i)]) == detail::bfloat16_bits(x.data()[offset + i]));
      }
    }
}

TEST_CASE("bfloat16: widening is exact for all 65536 patterns, and narrowing it back is the identity",
          "[core][bfloat16]") {
  BFloat16Tensor h({65536});
  for (std::uint32_t u = 0; u < 65536; ++u) h.data()[u] = bf16_of(static_cast<std::uint16_t>(u));
  const Tensor f = to<float>(h);
  const BFloat16Tensor back = to<bfloat16>(f);
  const DoubleTensor d = to<double>(h);
  std::int64_t inexact = 0, changed = 0, quieted = 0;
  for (std::uint32_t u = 0; u < 65536; ++u) {
    if (bits_of(f.data()[u]) != u << 16) ++inexact;
    const bool nan = (u & 0x7fffu) > 0x7f80u;
    const std::uint16_t expected = static_cast<std::uint16_t>(nan ? u | 0x0040u : u);  // NaNs come back quiet
    if (bits_of(back.data()[u]) != expected) ++changed;
    if (nan && expected != u) ++quieted;
    if (!nan && d.data()[u] != static_cast<double>(f.data()[u])) ++inexact;
  }
  CHECK(inexact == 0);
  CHECK(changed == 0);
  CHECK(quieted == 2 * 63);  // signalling NaNs: fraction 1..63, either sign
}

TEST_CASE("bfloat16: other element types convert through float32, as PyTorch does", "[core][bfloat16]") {
  // 1 + 2^-8 + 2^-30 is nearer 1 + 2^-7 than 1, but float32 first makes it 1 + 2^-8, a tie that
  // goes to the even 1: PyTorch's .to(torch.bfloat16) on a float64 gives the same.
  const DoubleTensor d = tensor<double>({1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), -2.5, 1e300});
  const BFloat16Tensor h = to<bfloat16>(d);
  CHECK(bits_of(h.data()[0]) == 0x3f80u);
  CHECK(static_cast<float>(h.data()[1]) == -2.5f);
  CHECK(std::isinf(static_cast<float>(h.data()[2])));
  CHECK(test::values(to<std::int64_t>(to<bfloat16>(tensor<std::int64_t>({3, -7, 257})))) ==
        std::vector<std::int64_t>{3, -7, 256});  // 257 ties between 256 and 258: to the even 256
  CHECK(test::values(to<double>(h)) == std::vector<double>{1.0, -2.5, std::numeric_limits<double>::infinity()});
}

TEST_CASE("bfloat16: the conversion gives the same bits on every thread count", "[core][bfloat16][threads]") {
  const int threads = get_num_threads();
  std::vector<std::uint32_t> bits = patterns(0);
  bits.resize(300'001);  // many grains, and a ragged end
  const Tensor x = floats_of(bits);
  std::vector<std::vector<std::uint16_t>> runs;
  for (int t : {1, 2, 3, 4}) {
    set_num_threads(t);
    const BFloat16Tensor h = to<bfloat16>(x);
    const Tensor f = to<float>(h);
    std::vector<std::uint16_t> v(static_cast<std::size_t>(h.numel()));
    std::memcpy(v.data(), h.data(), h.nbytes());
    runs.push_back(v);
    for (std::int64_t i = 0; i < f.numel(); i += 997) CHECK(bits_of(f.data()[i]) == std::uint32_t{v[static_cast<std::size_t>(i)]} << 16);
  }
  set_num_threads(threads);
  for (std::size_t i = 1; i < runs.size(); ++i) CHECK(runs[i] == runs[0]);
  for (std::size_t i = 0; i < bits.size(); i += 101) CHECK(runs[0][i] == detail::bfloat16_bits(float_of(bits[i])));
}

TEST_CASE("bfloat16: a cast of a tensor that needs a gradient is recorded, without grad it converts", "[core][bfloat16]") {
  Tensor x = tensor({1.0f, 2.0f, 3.0f}, {1, 3}).requires_grad_();
  const BFloat16Tensor h = to<bfloat16>(x);
  CHECK(h.requires_grad());
  CHECK_FALSE(h.is_leaf());
  CHECK(to<bfloat16>(x * 2.0f).requires_grad());
  CHECK(to<double>(x).requires_grad());  // every cast between floating types is recorded
  const BFloat16Tensor d = to<bfloat16>(x.detach());
  CHECK_FALSE(d.requires_grad());
  CHECK(test::values(to<float>(d)) == std::vector<float>{1, 2, 3});
  {
    no_grad guard;
    const BFloat16Tensor n = to<bfloat16>(x);
    CHECK_FALSE(n.requires_grad());
    CHECK(test::values(to<float>(n)) == std::vector<float>{1, 2, 3});
  }
  // A cast to an integer type has no history (such tensors take no gradient), as in PyTorch.
  CHECK_FALSE(to<std::int64_t>(x).requires_grad());
}
