// Both halves of the bfloat16 safetensors parity check with PyTorch (bf16_parity.py between them):
//   bf16_parity write DIR   float32 values of every kind (normal data, ties, subnormals, the
//                           overflow edge, infinities, NaNs, random bit patterns), remat's bfloat16
//                           of them, and all 65536 bfloat16 patterns, to DIR/remat_bf16.safetensors
//   bf16_parity check DIR   reads PyTorch's bfloat16 of the same floats (DIR/torch_bf16.safetensors)
//                           and requires remat's bits for every non-NaN element, a NaN for a NaN
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <remat/remat.hpp>

namespace {

using namespace remat;

std::uint16_t bits_of(bfloat16 h) { return Eigen::numext::bit_cast<std::uint16_t>(h); }

Tensor values() {
  std::vector<std::uint32_t> bits{0x00000000u, 0x80000000u, 0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u,
                                  0x00000001u, 0x00008000u, 0x00018000u, 0x00008001u, 0x007fffffu, 0x807fffffu,
                                  0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u,
                                  0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa00000u};
  std::mt19937 rng(27);
  for (int i = 0; i < 100000; ++i) bits.push_back(static_cast<std::uint32_t>(rng()));
  for (std::uint32_t i = 0; i < 4096; ++i) bits.push_back(i << 12);  // subnormals and small normals
  Generator gen(2024);
  const Tensor normal = randn({3000}, gen);  // data as models hold it
  for (float v : normal.to_vector()) bits.push_back(Eigen::numext::bit_cast<std::uint32_t>(v));
  Tensor x({static_cast<std::int64_t>(bits.size())});
  std::memcpy(x.data(), bits.data(), x.nbytes());
  return x;
}

int write(const std::string& dir) {
  const Tensor x = values();
  BFloat16Tensor all({256, 256});
  for (std::uint32_t u = 0; u < 65536; ++u) all.data()[u] = Eigen::numext::bit_cast<bfloat16>(static_cast<std::uint16_t>(u));
  io::write_safetensors(dir + "/remat_bf16.safetensors",
                        {{"x", io::to_entry(x)}, {"h", io::to_entry(to<bfloat16>(x))}, {"all", io::to_entry(all)}});
  fmt::print("remat: {} floats, their bfloat16 and all 65536 bfloat16 patterns written to {}\n", x.numel(), dir);
  return 0;
}

int check(const std::string& dir) {
  const io::TensorFile file = io::read_safetensors(dir + "/torch_bf16.safetensors");
  const Tensor x = values();
  const BFloat16Tensor mine = to<bfloat16>(x);
  const BFloat16Tensor theirs = io::from_entry<bfloat16>(file.at("h"), "h");
  REMAT_CHECK(theirs.shape() == mine.shape(), "bf16_parity: PyTorch's tensor has shape {}, remat's {}", theirs.shape(),
              mine.shape());
  std::int64_t differ = 0, nans = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (std::isnan(x.data()[i])) {
      ++nans;
      if (!std::isnan(static_cast<float>(theirs.data()[i]))) ++differ;
    } else if (bits_of(theirs.data()[i]) != bits_of(mine.data()[i])) {
      if (differ++ < 5)
        fmt::print("  element {}: float bits {:#010x}: PyTorch {:#06x}, remat {:#06x}\n", i,
                   Eigen::numext::bit_cast<std::uint32_t>(x.data()[i]), bits_of(theirs.data()[i]), bits_of(mine.data()[i]));
    }
  }
  fmt::print("remat reads PyTorch's BF16 file: {} elements ({} NaN), {} differ from remat's to<bfloat16> ({} kernel)\n",
             x.numel(), nans, differ, detail::bfloat16_kernel());
  return differ == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  REMAT_CHECK(argc == 3 && (std::string(argv[1]) == "write" || std::string(argv[1]) == "check"),
              "usage: bf16_parity write|check DIR");
  return std::string(argv[1]) == "write" ? write(argv[2]) : check(argv[2]);
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
