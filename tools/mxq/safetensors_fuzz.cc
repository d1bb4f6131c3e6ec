// libFuzzer target for the safetensors reader: any byte string either parses into a view whose every
// tensor lies inside the buffer, or raises st::Error; nothing else (no crash, no other exception).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    mxq::st::View v({data, size}, "fuzz");
    std::uint64_t sum = 0;
    for (const mxq::st::TensorInfo& t : v.tensors()) {
      const auto bytes = v.data(t);
      if (bytes.data() < data || bytes.data() + bytes.size() > data + size) std::abort();
      if (!bytes.empty()) sum += bytes[0] + bytes[bytes.size() - 1];  // touch both ends
    }
    (void)sum;
  } catch (const mxq::st::Error&) {
  }
  return 0;
}
