// libFuzzer harness for the safetensors reader: any byte string either parses into tensors whose
// bytes match their shapes, or is rejected with remat::Error. Anything else — another exception
// type, a crash, an out-of-bounds read under ASan, undefined behaviour under UBSan — is a finding.
#include <cstddef>
#include <cstdint>

#include <remat/core/factory.hpp>
#include <remat/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const remat::io::TensorFile file = remat::io::parse_safetensors(data, size, "fuzz input");
    for (const auto& [name, entry] : file) {
      const std::size_t element = entry.dtype == "F32" ? 4 : entry.dtype == "BF16" ? 2 : entry.dtype == "BOOL" ? 1 : 8;
      if (entry.data.size() != static_cast<std::size_t>(entry.shape.numel()) * element) __builtin_trap();
      if (entry.dtype == "F32" || entry.dtype == "BF16") {
        const remat::Tensor t = entry.dtype == "F32" ? remat::io::from_entry<float>(entry, name)
                                                     : remat::to<float>(remat::io::from_entry<remat::bfloat16>(entry, name));
        float total = 0;
        for (std::int64_t i = 0; i < t.numel(); ++i) total += t.data()[i];
        (void)total;
      }
    }
  } catch (const remat::Error&) {
  }
  return 0;
}
