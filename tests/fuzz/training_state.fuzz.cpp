// libFuzzer harness for the training-state loader: any byte string loads into a fixed model and
// AdamW or is rejected with remat::Error. The checksum would stop almost every input at the door,
// so the harness first makes it right for the input (when it has a checksum field), letting the
// fuzzer reach the metadata, the names, shapes and dtypes, and the optimizer's checks.
#include <cstddef>
#include <cstdint>
#include <string>

#include <remat/io/training_state.hpp>
#include <remat/nn/linear.hpp>
#include <remat/optim/adamw.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace remat;
  static Generator init(1);
  static nn::Linear model(2, 3, true, init);
  static optim::AdamW opt(model.parameters());
  std::string bytes(reinterpret_cast<const char*>(data), size);
  if (bytes.size() >= 8) {
    const std::uint64_t header = io::detail::header_length(bytes);
    if (header <= bytes.size() - 8) {
      const std::size_t at = io::detail::checksum_digits_at(bytes, header);
      if (at != std::string::npos) {
        bytes.replace(at, io::detail::kChecksumDigits, std::string(io::detail::kChecksumDigits, '0'));
        bytes.replace(at, io::detail::kChecksumDigits, io::detail::checksum(bytes));
      }
    }
  }
  try {
    const io::TrainingState s = io::load_training_state_bytes(bytes, "fuzz input", model, opt);
    (void)s;
  } catch (const Error&) {
  }
  return 0;
}
