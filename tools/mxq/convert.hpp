#pragma once
// Scalar conversions the tool needs on raw tensor bytes (the library's codec is internal).
#include <cstdint>
#include <cstring>
#include <string>

namespace mxq::cli {

// fp32 -> bf16, round to nearest even (finite inputs; the tool only makes finite test data).
inline std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// The fp32 value of one element of a BF16, F16 or F32 safetensors tensor (exact).
inline float load_f32(const std::uint8_t* p, const std::string& dt) {
  std::uint32_t u;
  if (dt == "F32") {
    std::memcpy(&u, p, 4);
  } else {
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    if (dt == "BF16") {
      u = std::uint32_t(h) << 16;
    } else {  // F16
      const std::uint32_t s = std::uint32_t(h >> 15) << 31, e = (h >> 10) & 0x1F, m = h & 0x3FF;
      if (e == 0x1F) u = s | 0x7F800000u | (m << 13);
      else if (e) u = s | ((e + 112) << 23) | (m << 13);
      else if (m == 0) u = s;
      else {
        int sh = 0;
        std::uint32_t mm = m;
        while (!(mm & 0x400)) mm <<= 1, ++sh;
        u = s | (std::uint32_t(113 - sh) << 23) | ((mm & 0x3FF) << 13);
      }
    }
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace mxq::cli
