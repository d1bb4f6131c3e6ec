#pragma once
// The fp32 value of one element of a safetensors tensor, by the tensor's dtype name. The conversions
// themselves are the library's (mxq/convert.hpp: exact, tested over every bf16 and fp16 pattern).
#include <cstdint>
#include <cstring>
#include <string>

#include <mxq/convert.hpp>

namespace mxq::cli {

// A tensor's element type, resolved from its safetensors dtype name once per tensor: the element loops
// take this, not the name (comparing the name per element dominated the tool's error loops).
enum class SrcType { f32, bf16, f16 };
inline SrcType src_type(const std::string& dt) { return dt == "F32" ? SrcType::f32 : dt == "BF16" ? SrcType::bf16 : SrcType::f16; }

// One element of a BF16, F16 or F32 tensor at p, exactly.
inline float load_f32(const std::uint8_t* p, SrcType t) {
  if (t == SrcType::f32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return t == SrcType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}
inline float load_f32(const std::uint8_t* p, const std::string& dt) { return load_f32(p, src_type(dt)); }
// n consecutive elements of type t at p, as fp32 into y.
inline void load_f32s(const std::uint8_t* p, SrcType t, std::int64_t n, float* y) {
  const int es = t == SrcType::f32 ? 4 : 2;
  for (std::int64_t i = 0; i < n; ++i) y[i] = load_f32(p + i * es, t);
}

}  // namespace mxq::cli
