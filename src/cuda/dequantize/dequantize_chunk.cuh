#pragma once
// Dequantize of one chunk: C codes and their block's scale byte -> C outputs of DT.
#include "core/fastmath.hpp"
#include "cuda/common/fp4_lookup.cuh"
#include "cuda/common/nvfp4_scale.cuh"
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// The chunk's codes (one per element, and as packed words cw) and its block's scale byte sb.
template <class Fmt, int C>
__device__ __forceinline__ void load_codes(const Params& p, const Coord& c, u32 (&codes)[C], std::uint8_t& sb,
                                           u32 (&w)[code_words<Fmt, C>()]) {
  sb = p.scales[scale_index<C>(p, c.row, c.block)];
  const std::uint8_t* crow = p.codes + c.row * p.codes_stride;
  const i64 valid = p.K - c.k0 < C ? p.K - c.k0 : C;
  constexpr int kBits = Fmt::code_bits;
  constexpr int NB = C * kBits / 8;
#pragma unroll
  for (int j = 0; j < code_words<Fmt, C>(); ++j) w[j] = 0;
  const std::uint8_t* s = crow + c.k0 * kBits / 8;
  if (c.full && p.codes_vec) {
    if constexpr (NB >= 4) load_words<NB / 4>(s, w);
    else if constexpr (NB == 2) w[0] = *reinterpret_cast<const std::uint16_t*>(s);
    else w[0] = *s;
  } else {
    const i64 nbytes = (valid * kBits + 7) / 8;
#pragma unroll
    for (int j = 0; j < NB; ++j)
      if (j < nbytes) w[j / 4] |= u32(s[j]) << (8 * (j % 4));
  }
#pragma unroll
  for (int i = 0; i < C; ++i) codes[i] = (w[i * kBits / 32] >> ((i * kBits) % 32)) & ((1u << kBits) - 1u);
}

// MX, the general form: the outputs (hi16 form) of C codes under scale byte sb.
template <class Fmt, DType DT, int C>
__device__ __forceinline__ void mx_dequant_values(const u32 (&codes)[C], std::uint8_t sb, u32 (&out)[C]) {
  constexpr FloatSpec f = Fmt::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  const float scale = pow2f(int(sb) - kE8M0Bias);
#pragma unroll
  for (int i = 0; i < C; ++i) {
    u32 sign = 0, n = 0;
    int pe = 0;
    if (sb == kE8M0NaN || !decode_parts(codes[i], f, sign, n, pe)) {
      out[i] = hi16<DT>(mx_dequant_bits(codes[i], sb, f, DT));
    } else {
      const float v = mul_rn(mul_rn(float(n), pow2f(pe)), scale);  // exact, or +Inf past FLT_MAX
      out[i] = hi16<DT>(out_mag_bits<DT>(v) | (sign << kSignBit));
    }
  }
}

// MX: element value x 2^e, rounded once to DT (saturating); NaN scale or NaN/Inf codes as decoded.
template <class Fmt, DType DT, int C>
__device__ __forceinline__ void mx_dequant_chunk(const Params& p, const Coord& c, const u32 (&codes)[C], std::uint8_t sb,
                                                 const u32 (&cw)[code_words<Fmt, C>()]) {
  constexpr ElemType ET = Fmt::elem;
  if constexpr (ET == ElemType::e2m1 && DT == DType::bf16 && C % 8 == 0) {
    // MXFP4, a finite scale 2^e with e in [-125, 125]: every product is a normal bf16, so the table
    // is the eight magnitudes' bf16 bits with e added to the exponent field (0 stays 0; for e < 0
    // the add wraps without a borrow between the halves).
    const int e = int(sb) - kE8M0Bias;
    if (e >= -125 && e <= 125) {
      const u32 d = u32(e) << 7, d2 = d * 0x10001u;  // bf16 bits of 0, 0.5 | 1, 1.5 | 2, 3 | 4, 6
      u32 o[C / 2];
      fp4_bf16_lookup<C>(cw, 0x3F000000u + (d << 16), 0x3FC03F80u + d2, 0x40404000u + d2, 0x40C04080u + d2, 0u, o);
      store_packed<DT, C>(p, c.row, c.k0, c.full, o, false);
      return;
    }
  }
  if constexpr (ET == ElemType::e4m3 && DT == DType::bf16) {
    // MXFP8 (E4M3) under a finite scale 2^e, e in [-117, 119], no NaN code in the chunk: e4m3_bf16_hi.
    const int e = int(sb) - kE8M0Bias;
    bool nan_code = false;
#pragma unroll
    for (int i = 0; i < C; ++i) nan_code |= (codes[i] & 0x7Fu) == 0x7Fu;
    if (e >= -117 && e <= 119 && !nan_code) {
      const float sc = pow2f(e), sc2 = pow2f(e + 1);
      u32 out[C];
#pragma unroll
      for (int i = 0; i < C; ++i) out[i] = e4m3_bf16_hi(codes[i], sc, sc2);
      store_chunk<DT, C>(p, c.row, c.k0, c.full, out, false);
      return;
    }
  }
  u32 out[C];
  mx_dequant_values<Fmt, DT, C>(codes, sb, out);
  store_chunk<DT, C>(p, c.row, c.k0, c.full, out, false);
}

// NVFP4, the general form: the outputs (hi16 form) of C codes under scale byte sb; returns whether the
// scale is the NaN code (the whole block is NaN; out is then meaningless).
// A scale byte with its sign bit set (not produced by quantize, but any byte is accepted) flips the
// sign of the block: the product's sign is the XOR, its magnitude that of |s|.
template <DType DT, int C>
__device__ __forceinline__ bool nvfp4_dequant_values(const NvScale& nv, const u32 (&codes)[C], std::uint8_t sb, u32 (&out)[C]) {
  const float sval = decode_f32(sb & 0x7Fu, spec_e4m3());
  const u32 ssign = u32(sb) >> 7;
  auto decode = [&](auto fast) {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const u32 o = nv_out<decltype(fast)::value, DT>(mul_rn(e2m1_value(codes[i] & 7u), sval), (codes[i] >> 3) ^ ssign, nv);
      out[i] = hi16<DT>(o);
    }
  };
  if (nv.fast) decode(std::true_type{});
  else decode(std::false_type{});
  return (sb & 0x7F) == kE4M3NaN;
}

// NVFP4: (E2M1 value * E4M3 scale) / S, rounded once to DT; the NaN scale code gives a NaN chunk.
template <DType DT, int C>
__device__ __forceinline__ void nvfp4_dequant_chunk(const Params& p, const Coord& c, const NvScale& nv, const u32 (&codes)[C],
                                                    std::uint8_t sb, const u32 (&cw)[code_words<core::FormatTraits<Format::nvfp4>, C>()]) {
  const bool nan = (sb & 0x7F) == kE4M3NaN;
  if constexpr (DT == DType::bf16 && C % 8 == 0) {
    if (!nan) {
      // The eight magnitudes' outputs (E2M1 value * s) / S once per chunk (C = 16 is one block); the
      // sign is the code's XOR the scale byte's (nvfp4_dequant_values).
      u32 t[4], o[C / 2];
      nv_table<DT>(decode_f32(sb & 0x7Fu, spec_e4m3()), nv, t);
      fp4_bf16_lookup<C>(cw, t[0], t[1], t[2], t[3], (sb & 0x80u) ? 0x88888888u : 0u, o);
      store_packed<DT, C>(p, c.row, c.k0, c.full, o, false);
      return;
    }
  }
  u32 out[C];
  nvfp4_dequant_values<DT, C>(nv, codes, sb, out);
  store_chunk<DT, C>(p, c.row, c.k0, c.full, out, nan);
}

// The chunk's values as fp32 bits (exact, or +Inf past FLT_MAX, as the reference's fp32 dequantize;
// an NVFP4 NaN/Inf block as NaN): the input of the inverse rotations. c must be live (active, k0 < K).
template <class Fmt, int C>
__device__ __forceinline__ void dequant_f32(const Params& p, const Coord& c, u32 (&v)[C]) {
  u32 codes[C], cw[code_words<Fmt, C>()];
  std::uint8_t sb;
  load_codes<Fmt, C>(p, c, codes, sb, cw);
  if constexpr (Fmt::nvfp4) {
    if (nvfp4_dequant_values<DType::f32, C>(nv_scale(p), codes, sb, v)) {
#pragma unroll
      for (int e = 0; e < C; ++e) v[e] = 0x7FC00000u;
    }
  } else if constexpr (Fmt::elem == ElemType::e2m1) {
    // MXFP4 under a scale 2^e, e in [-125, 125]: every product is a normal fp32 (or zero), exact.
    const int e = int(sb) - kE8M0Bias;
    if (e >= -125 && e <= 125) {
      const float sc = pow2f(e);
#pragma unroll
      for (int i = 0; i < C; ++i) v[i] = f2u(mul_rn(e2m1_value(codes[i] & 7u), sc)) | ((codes[i] >> 3) << 31);
    } else {
      mx_dequant_values<Fmt, DType::f32, C>(codes, sb, v);
    }
  } else {
    mx_dequant_values<Fmt, DType::f32, C>(codes, sb, v);
  }
}

template <class Fmt, DType DT, int C>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const Params p) {
  const Coord c = coord<C>(p, i64(blockIdx.x) * kThreads + threadIdx.x);
  if (!c.active || c.k0 >= p.K) return;
  u32 codes[C], cw[code_words<Fmt, C>()];
  std::uint8_t sb;
  load_codes<Fmt, C>(p, c, codes, sb, cw);
  if constexpr (Fmt::nvfp4) nvfp4_dequant_chunk<DT, C>(p, c, nv_scale(p), codes, sb, cw);
  else mx_dequant_chunk<Fmt, DT, C>(p, c, codes, sb, cw);
}

// Two fp32 values rounded to nearest even onto bf16 or f16 by the hardware conversion (sm_80+), lo in
// the low half: IEEE rounding with subnormals, so for magnitudes below kNoOverflow<DT> (where no value
// can round past the largest finite one) the same bits as to_dtype_bits_nonnan.
template <DType DT>
__device__ __forceinline__ u32 cvt_rn_x2(float lo, float hi) {
  static_assert(DT == DType::bf16 || DT == DType::f16);
  u32 d;
  if constexpr (DT == DType::bf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// The fp32 magnitude bits below which rounding onto DT stays finite: the midpoint between DT's largest
// finite value and the next power of two (a tie there rounds to even, which is the infinity).
template <DType DT>
inline constexpr u32 kNoOverflow = DT == DType::bf16 ? 0x7F7F8000u : 0x477FF000u;  // 65520 for f16

// C fp32 values (bits) rounded once to DT (a NaN: DT's canonical NaN; = f32_to_dtype_bits) and stored at
// chunk c of the output: the last step of the rotated dequantize kernels. A chunk of 2-byte outputs
// whose magnitudes all stay below kNoOverflow (no NaN, infinity or saturation) takes the hardware
// conversion, two values per instruction; any other chunk the reference's rounding per element.
template <DType DT, int C>
__device__ __forceinline__ void store_rounded_chunk(const Params& p, const Coord& c, const u32 (&v)[C]) {
  if constexpr (DT != DType::f32) {
    u32 mx = 0;
#pragma unroll
    for (int e = 0; e < C; ++e) mx = umax(mx, v[e] & 0x7FFFFFFFu);
    if (mx < kNoOverflow<DT>) {
      u32 w[C / 2];
#pragma unroll
      for (int j = 0; j < C / 2; ++j) w[j] = cvt_rn_x2<DT>(u2f(v[2 * j]), u2f(v[2 * j + 1]));
      store_packed<DT, C>(p, c.row, c.k0, c.full, w, false);
      return;
    }
  }
  u32 out[C];
#pragma unroll
  for (int e = 0; e < C; ++e) {
    const float f = u2f(v[e]);
    out[e] = hi16<DT>(f != f ? nan_bits(DT) : to_dtype_bits_nonnan<DT>(f));
  }
  store_chunk<DT, C>(p, c.row, c.k0, c.full, out, false);
}

}  // namespace mxq::cuda
