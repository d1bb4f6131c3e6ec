#pragma once
// Conversions between fp32 and the 16-bit floating dtypes, on bit patterns: for callers that hold raw
// tensor bytes (checkpoint files, test data). The library's own conversions to bf16 and fp16 outputs
// saturate instead (docs/numerics.md); these are the plain IEEE ones. tests/convert_test.cc checks
// each against an independent formulation: every bf16 and fp16 pattern, and fp32 -> bf16 on every
// tie, its neighbours and a sweep of the fp32 patterns.
#include <bit>
#include <cstdint>

namespace mxq {

// bf16 bits -> fp32, exact: a bf16 is the upper half of an fp32 (a NaN keeps its sign and payload).
constexpr float bf16_to_f32(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t(h) << 16); }

// fp16 bits -> fp32, exact for every pattern: subnormals become normal fp32 values, a NaN keeps its
// sign, quiet bit and payload (shifted into the top of the fp32 significand).
constexpr float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h >> 15) << 31, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (m << 13));  // Inf, NaN
  if (e != 0) return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
  const float v = float(m) * 0x1p-24f;  // zero or subnormal m * 2^-24: exact in fp32
  return sign ? -v : v;
}

// The round-to-nearest-even step alone: the bf16 bits of fp32 bits `u` that are not a NaN (a value at
// or beyond the largest finite bf16 plus half its ulp becomes Inf). f32_to_bf16 below, and the
// library's saturating outputs (core::out_mag_bits, on the CPU and the GPU), are this step.
constexpr std::uint32_t bf16_rne_bits(std::uint32_t u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }

// fp32 -> bf16 bits, round to nearest, ties to even (IEEE, as __float2bfloat16_rn for numbers):
// fp32 subnormals round like any other value (no flush), and a value at or beyond the largest finite
// bf16 plus half its ulp (0x7F7F8000) becomes Inf. A NaN stays a quiet NaN with its sign and the top 7
// bits of its payload: (bits >> 16) | 0x0040, as x86's VCVTNEPS2BF16. NOTE: the rounding add alone
// would carry a NaN's low payload bits into Inf (0x7F800001 -> 0x7F80) or into the sign
// (0x7FFFFFFF -> 0x8000, -0); the NaN test keeps it out.
constexpr std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>(bf16_rne_bits(u));
}

}  // namespace mxq
