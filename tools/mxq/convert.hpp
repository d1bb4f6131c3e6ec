#pragma once
// The fp32 value of one element of a safetensors tensor, by the tensor's dtype name. The conversions
// themselves are the library's (mxq/convert.hpp: exact, tested over every bf16 and fp16 pattern).
#include <cstdint>
#include <cstring>
#include <string>

#include <mxq/convert.hpp>

namespace mxq::cli {

// One element of a BF16, F16 or F32 tensor at p, exactly.
inline float load_f32(const std::uint8_t* p, const std::string& dt) {
  if (dt == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return dt == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
}

}  // namespace mxq::cli
