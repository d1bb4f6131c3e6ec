#pragma once
// The arithmetic of the fused producer ops (rms_norm, silu_mul; docs/numerics.md, "Fused producers"), shared by
// the CPU and CUDA backends so that both produce the same bytes: every operation is one correctly
// rounded fp32 operation written out (codec.hpp's *_rn), sums in one fixed order, exp without any
// library function.
#include <cmath>
#include <cstdint>

#include "core/problem.hpp"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace mxq::core {

// ---- rounding to the output dtype ------------------------------------------------------------------------
// fp32 -> bits of dtype t with RNE, as a cast does: overflow gives infinity (not saturation), NaN gives
// the dtype's canonical positive NaN (CPUs and GPUs disagree on the sign of a produced NaN).
MXQ_HD std::uint32_t round_to_dtype_bits(float v, DType t) {
  const std::uint32_t u = f2u(v), mag = u & 0x7FFFFFFFu, sign = u >> 31;
  if (mag > 0x7F800000u) return nan_bits(t);
  if (t == DType::f32) return u;
  // bf16: RNE on the bits (a carry out of the largest binade gives the infinity pattern)
  if (t == DType::bf16) return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
#if defined(__CUDA_ARCH__)
  (void)sign;
  return __half_as_ushort(__float2half_rn(v));  // RNE, overflow to Inf (IEEE conversion)
#else
  return mag >= 0x477FF000u ? ((sign << 15) | 0x7C00u) : f32_to_f16_sat(u);  // 65520 rounds to Inf
#endif
}
// The fp32 value of dtype bits.
MXQ_HD float dtype_bits_to_f32(std::uint32_t bits, DType t) {
  if (t == DType::f32) return u2f(bits);
  if (t == DType::bf16) return u2f(bits << 16);
  // f16: exact through the E5M10 decode of the codec
  const std::uint32_t sign = bits >> 15, e = (bits >> 10) & 0x1F, m = bits & 0x3FF;
  if (e == 0x1F) return u2f((sign << 31) | 0x7F800000u | (m << 13));
  if (e != 0) return u2f((sign << 31) | ((e + 112u) << 23) | (m << 13));
  return mul_rn(u2f((sign << 31) | (m ? (f2u(float(m))) : 0u)), u2f(0x33800000u));  // m * 2^-24, exact
}
MXQ_HD float round_to_dtype(float v, DType t) { return dtype_bits_to_f32(round_to_dtype_bits(v, t), t); }

// ---- RMSNorm: the sum of squares in a fixed order --------------------------------------------------------
// The row is read in chunks of 8 elements; chunk c belongs to lane c % 256. Each lane sums the squares
// of its elements sequentially in index order (mul_rn then add_rn); the 256 lane sums are combined
// by a butterfly inside each group of 32 lanes (v[i] += v[i ^ s] for s = 16, 8, 4, 2, 1) and the eight
// group sums by the same butterfly (s = 4, 2, 1). This is the order of a 256-thread CUDA block (lanes
// are threads, groups are warps, xor shuffles); the CPU replays it.
constexpr int kNormLanes = 256;
constexpr int kNormChunk = 8;

// r = 1 / sqrt(ss / K + eps), three correctly rounded operations and one division.
MXQ_HD float rms_inverse(float ss, std::int64_t K, float eps) {
  const float mean = div_rn(ss, float(K));  // float(K) exact for K < 2^24 (the entry layer's limit)
  return div_rn(1.0f, sqrt_rn(add_rn(mean, eps)));
}
// One normalised element: dtype(w * dtype(x * r)), as transformers' LlamaRMSNorm computes it in fp32
// and casts (the product of two dtype values is exact in fp32 for bf16 and f16).
MXQ_HD float rms_norm_element(float x, float w, float r, DType t) {
  return round_to_dtype(mul_rn(w, round_to_dtype(mul_rn(x, r), t)), t);
}

// ---- SiLU ------------------------------------------------------------------------------------------------
// exp(x) in fp32 from basic operations only (Cody-Waite reduction by ln 2 in two parts and Cephes'
// degree-6 polynomial, evaluated with fma_rn): within 2 ulp of the true value, the same bits everywhere.
// exp(x) = +Inf for x > 88.7228394, 0 for x < -103.972084, NaN for NaN.
MXQ_HD float exp_f32(float x) {
  if (!(x == x)) return x;
  if (x > 88.7228394f) return u2f(0x7F800000u);
  if (x < -103.972084f) return 0.0f;
  const float t = add_rn(mul_rn(x, 1.44269504088896341f), 0.5f);
#if defined(__CUDA_ARCH__)
  const float n = floorf(t);  // exact
#else
  const float n = std::floor(t);
#endif
  float r = fma_rn(-n, 0.693359375f, x);  // n * C1 is exact (C1 has 9 significant bits)
  r = fma_rn(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fma_rn(p, r, 1.3981999507e-3f);
  p = fma_rn(p, r, 8.3334519073e-3f);
  p = fma_rn(p, r, 4.1665795894e-2f);
  p = fma_rn(p, r, 1.6666665459e-1f);
  p = fma_rn(p, r, 5.0000001201e-1f);
  const float y = add_rn(fma_rn(p, mul_rn(r, r), r), 1.0f);
  // y * 2^n: exact while the result is normal; below that one rounding (2^(n+64) * 2^-64).
  const int k = int(n);
  if (k > 127) return mul_rn(mul_rn(y, u2f(254u << 23)), u2f(std::uint32_t(k - 127 + 127) << 23));
  if (k < -126) return mul_rn(mul_rn(y, u2f(std::uint32_t(k + 64 + 127) << 23)), u2f(std::uint32_t(-64 + 127) << 23));
  return mul_rn(y, u2f(std::uint32_t(k + 127) << 23));
}
// silu(g) * u as transformers' LlamaMLP computes act_fn(gate) * up: silu in fp32 (g / (1 + exp(-g)))
// cast to the dtype, then the product in fp32 cast to the dtype.
MXQ_HD float silu_mul_element(float g, float u, DType t) {
  const float s = div_rn(g, add_rn(1.0f, exp_f32(-g)));
  return round_to_dtype(mul_rn(round_to_dtype(s, t), u), t);
}

}  // namespace mxq::core
