#pragma once
// What the validated entry points hand to a backend: the request with every derived quantity
// computed once (group size, block count, element spec, layout geometry).
#include <cstdint>

#include <mxq/ops.hpp>

#include "core/codec.hpp"

namespace mxq::core {

struct Problem {
  const char* fn = "";      // the public entry point, for messages
  QuantOptions opt;
  FormatInfo info;
  FloatSpec elem;           // element format
  std::int64_t rows = 0;
  std::int64_t K = 0;       // logical columns
  int g = 32;               // group size
  std::int64_t nblocks = 0; // ceil(K / g) scale columns
  std::int64_t scale_rows_padded = 0, scale_cols_padded = 0;  // swizzled geometry
  bool stochastic = false;
  int sr_bits = 32;         // stochastic rounding: random bits per element (32, 16, 8)
  bool fp4 = false;         // two codes per byte
  // NVFP4 encode scale, resolved by the entry layer's plan: given, 1 for an empty tensor, the host
  // amax's for the CPU backends; on the CUDA backend without a given scale, amax_acc (4 bytes of
  // device memory) receives the tensor amax and the kernels derive S from it.
  float S = 1.0f;
  std::uint32_t* amax_acc = nullptr;
  bool empty = false;       // no elements: nothing to compute, only fixed outputs to write

  bool nvfp4() const { return opt.format == Format::nvfp4; }
  // NVFP4 under rule quest: block scales from the quest statistic, tensor scale 1.
  bool nvfp4_quest() const { return nvfp4() && opt.rule == ScaleRule::quest; }
  // NVFP4 with UE5M3 block scales (the vllm-qdq-plugin's; no tensor scale).
  bool e5m3() const { return opt.format == Format::nvfp4_e5m3; }
  // Byte offset of scale (r, b) in the scale tensor.
  std::int64_t scale_offset(std::int64_t r, std::int64_t b, std::int64_t linear_stride) const {
    return opt.scale_layout == ScaleLayout::swizzled ? swizzled_offset(r, b, scale_cols_padded)
                                                     : r * linear_stride + b;
  }
};

inline std::int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::u8: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 1;
}

MXQ_HD FloatSpec out_spec(DType t) { return t == DType::f32 ? spec_f32() : (t == DType::f16 ? spec_f16() : spec_bf16()); }

// Element (r, c) of a floating view as fp32 (exact).
inline float load_f32(const Tensor& t, std::int64_t r, std::int64_t c) {
  const std::int64_t i = r * t.stride() + c;
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(t.data)[i]);
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(t.data)[i]);
    case DType::u8:
    case DType::i32:
    case DType::i64: break;
  }
  return 0.0f;
}

// Store a value given as bits of the view's dtype (low 16 bits for bf16/f16).
inline void store_bits(const Tensor& t, std::int64_t r, std::int64_t c, std::uint32_t bits) {
  const std::int64_t i = r * t.stride() + c;
  if (t.dtype == DType::f32)
    static_cast<std::uint32_t*>(t.data)[i] = bits;
  else
    static_cast<std::uint16_t*>(t.data)[i] = static_cast<std::uint16_t>(bits);
}

// fp32 value -> bits of an output dtype, RNE, saturating finite values.
MXQ_HD std::uint32_t f32_to_dtype_bits(float v, DType t) {
  const std::uint32_t u = f2u(v);
  if (t == DType::bf16) return f32_to_bf16_sat(u);
  if (t == DType::f16) return f32_to_f16_sat(u);
  return u;
}

MXQ_HD constexpr std::uint32_t nan_bits(DType t) {
  return t == DType::f32 ? 0x7FC00000u : (t == DType::bf16 ? 0x7FC0u : 0x7E00u);
}

// Bits, in dtype t, of the dequantized value of one MX element code under E8M0 scale byte sb: NaN
// for the NaN scale; element x 2^e rounded once (saturating); NaN/Inf element codes as decoded.
MXQ_HD std::uint32_t mx_dequant_bits(std::uint32_t code, std::uint8_t sb, const FloatSpec& elem, DType t) {
  if (sb == kE8M0NaN) return nan_bits(t);
  std::uint32_t sign = 0, n = 0;
  int pe = 0;
  if (decode_parts(code, elem, sign, n, pe)) return round_exact_to(sign, n, pe + (int(sb) - kE8M0Bias), out_spec(t));
  return f32_to_dtype_bits(decode_f32(code, elem), t);
}

// ---- nvfp4_e5m3 block operations (docs/numerics.md, "NVFP4 with UE5M3 scales"), for every backend ----------
// The UE5M3 scale byte of a block whose largest |x| has fp32 bits amax_bits (the integer maximum of the
// elements' bits with the sign cleared: a NaN element makes it a NaN, as torch's amax propagates NaN):
// UE5M3_RNE_sat(amax / 6); a NaN or an Inf amax saturates to 0xFE.
MXQ_HD std::uint32_t nvfp4_e5m3_scale_code(std::uint32_t amax_bits) { return ue5m3_block_scale_code(u2f(amax_bits)); }
// The E2M1 code of an element (fp32 bits) under scale byte sc: E2M1_RNE_sat(x / s), every code +0 when s is 0.
// NOTE: E2M1 has no NaN and UE5M3 no NaN scale, so quantize cannot carry a NaN: a NaN element gets code 0.
// qdq() returns NaN there instead (nvfp4_e5m3_qdq_bits).
MXQ_HD std::uint32_t nvfp4_e5m3_code(std::uint32_t xbits, std::uint32_t sc) {
  return (xbits & 0x7FFFFFFFu) > 0x7F800000u ? 0u : nvfp4_e5m3_encode(xbits, sc);
}
// Its clip-mask bit: 1 where the element is not clipped, |fp32(x / s)| < 6, or s is 0 (every element of such a
// block is within 6 * 2^-18 and quantizes to 0 by the rule); 0 for NaN and Inf elements.
MXQ_HD bool nvfp4_e5m3_kept(std::uint32_t xbits, std::uint32_t sc) {
  if ((xbits & 0x7FFFFFFFu) >= 0x7F800000u) return false;
  const float s = ue5m3_decode(sc);
  return s == 0.0f || (f2u(div_rn(u2f(xbits), s)) & 0x7FFFFFFFu) < 0x40C00000u;  // 6.0f
}
// Bits, in dtype t, of code x scale: exact in fp32 (at most 6 significant bits, never below 2^-18), hence in
// bf16 and fp16 too, except that fp16 overflows to Inf from 65520 on (the plugin's cast, not saturation).
MXQ_HD std::uint32_t nvfp4_e5m3_out_bits(std::uint32_t code, std::uint32_t sc, DType t) {
  const std::uint32_t v = f2u(nvfp4_e5m3_decode(code, sc));
  return t == DType::f16 ? f32_to_f16_rn(v) : t == DType::bf16 ? f32_to_bf16_sat(v) : v;
}
// QDQ of one element: the dequantized code, except that a NaN stays NaN (the dtype's quiet NaN), as in the
// plugin's QDQ.
MXQ_HD std::uint32_t nvfp4_e5m3_qdq_bits(std::uint32_t xbits, std::uint32_t sc, DType t) {
  if ((xbits & 0x7FFFFFFFu) > 0x7F800000u) return nan_bits(t);
  return nvfp4_e5m3_out_bits(nvfp4_e5m3_encode(xbits, sc), sc, t);
}

}  // namespace mxq::core
