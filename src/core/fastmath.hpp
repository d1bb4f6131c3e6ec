#pragma once
// Branch-free per-element arithmetic shared by the fast CPU path and the CUDA kernels. Each function
// here equals a scalar-codec function bit for bit on the inputs its comment allows: fastmath_test
// proves each against the codec, and the op tests (quantize_test, qdq_test, ...) the backends.
//
// The MX round-to-nearest-even element step:
//   a = |x| * 2^-e                       exact, or an underflow far below the element grid
//   r = (a + C) - C, C = 1.5 * 2^(q+23)  RNE onto the grid of quantum 2^q (q from a's binade)
//   r = min(r, max_elem)                 saturation
// Every operation is written with mul_rn/add_rn so that nvcc cannot fuse it (the host build uses
// -ffp-contract=off).
#include <cstdint>

#include "core/codec.hpp"

namespace mxq::core {

MXQ_HD_HOT std::uint32_t umin(std::uint32_t a, std::uint32_t b) { return a < b ? a : b; }
MXQ_HD_HOT std::uint32_t umax(std::uint32_t a, std::uint32_t b) { return a > b ? a : b; }
MXQ_HD_HOT int imin(int a, int b) { return a < b ? a : b; }
MXQ_HD_HOT int imax(int a, int b) { return a > b ? a : b; }
// min(a, b) for b > 0 and not NaN (a NaN a gives b); on the GPU one FMNMX, which agrees there.
MXQ_HD_HOT float fminf_nn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return a < b ? a : b;
#endif
}
MXQ_HD_HOT float fabs_bits(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }

// 2^e as fp32, exact for e in [-149, 127].
MXQ_HD_HOT float pow2f(int e) {
  return e >= -126 ? u2f(std::uint32_t(e + 127) << 23) : u2f(1u << (e + 149));
}

// Bits of the rounding constant C = 1.5 * 2^(23 - MBITS) relative to a binade's exponent bits be:
// be + rne_const_bits<MBITS>() is C for that binade (its ulp is the grid's quantum).
template <int MBITS>
MXQ_HD_HOT constexpr std::uint32_t rne_const_bits() {
  return (std::uint32_t(23 - MBITS) << 23) | 0x400000u;
}

// The scale exponents e where the MX fast paths round in the unscaled domain (x, not x * 2^-e): every
// quantum 2^(q + e) of the grid is a normal fp32 (e >= lo: the smallest nonzero result >= 2^-126) and
// the rounding constant 1.5 * 2^(q + e + 23) stays finite (e <= hi). The CPU fast path and the CUDA
// kernels take their fast branch exactly here; fastmath_test proves the helpers below over this range.
template <ElemType ET>
struct MxFastRange {
  static constexpr FloatSpec f = Elem<ET>::spec;
  static constexpr int lo = -126 - (f.emin - f.mbits);
  static constexpr int hi = 254 - (f.emax + 1 + 127 + 23 - f.mbits);
  MXQ_HD_HOT static constexpr bool contains(int e) { return e >= lo && e <= hi; }
};

// Rounded magnitude of |x| * inv_scale on element format ET's grid (RNE, saturated). inv_scale is
// a power of two; |x| * inv_scale is exact or underflows below the grid's smallest quantum.
template <ElemType ET>
MXQ_HD_HOT float rne_mag(float x, float inv_scale) {
  constexpr FloatSpec f = Elem<ET>::spec;
  // C = 1.5 * 2^(E - mbits + 23) for a's binade E clamped to [emin, emax + 1], built on the exponent
  // bits (a subnormal a has exponent bits 0 and takes emin's quantum; NaN/Inf take the top binade).
  constexpr std::uint32_t lo = std::uint32_t(f.emin + 127) << 23, hi = std::uint32_t(f.emax + 1 + 127) << 23;
  constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
  const float a = mul_rn(fabs_bits(x), inv_scale);
  const float C = u2f(umin(umax(f2u(a) & 0x7F800000u, lo), hi) + kC);
  const float r = sub_rn(add_rn(a, C), C);
  return fminf_nn(r, u2f(max_value_bits(f)));
}

// Element code from a rounded magnitude r (a grid value) and the sign bit.
template <ElemType ET>
MXQ_HD_HOT std::uint32_t code_of(float r, std::uint32_t sign) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) {
    const std::uint32_t n = static_cast<std::uint32_t>(static_cast<std::int32_t>(mul_rn(r, 64.0f)));
    const std::uint32_t neg = 0u - sign;  // all ones when negative
    return ((n ^ neg) + sign) & 0xFFu;    // two's complement negation when negative
  } else {
    constexpr float sub_mul = float(1u << (f.mbits - f.emin));  // 2^(mbits - emin): subnormal grid to integers
    constexpr std::uint32_t min_normal = std::uint32_t(f.emin + 127) << 23;
    const std::uint32_t rb = f2u(r);
    const std::uint32_t normal =
        ((((rb >> 23) - 127u - std::uint32_t(f.emin) + 1u) << f.mbits) | ((rb >> (23 - f.mbits)) & ((1u << f.mbits) - 1u)));
    const std::uint32_t sub = static_cast<std::uint32_t>(static_cast<std::int32_t>(mul_rn(r, sub_mul)));
    const std::uint32_t is_normal = 0u - std::uint32_t(rb >= min_normal);
    return ((normal & is_normal) | (sub & ~is_normal)) | (sign << (f.bits - 1));
  }
}

// |x|; on the GPU the operand modifier of the instruction that uses it (free), on the host a bit and.
MXQ_HD_HOT float fabs_op(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return fabs_bits(x);
#endif
}

// The code magnitude read off a round-to-nearest-even add (the element step above, in the unscaled
// or the scaled domain): t = a + Cc with Cc's bits cb = be + kC, be the exponent bits of a's binade
// clamped below at lo (the smallest normal binade's exponent bits). t - Cc is the rounded magnitude in
// quanta of the binade be, the ulp of Cc, so the code is ((be - lo) >> (23 - MBITS)) + bits(t) - cb:
// a carry into the next binade and the subnormal range come out right. be and lo have no bits below
// bit 23, so the difference shifts term by term: one shift-add and one three-way add.
template <int MBITS>
MXQ_HD_HOT std::uint32_t readoff_mag(std::uint32_t tbits, std::uint32_t be, std::uint32_t cb, std::uint32_t lo) {
  return (tbits + (be >> (23 - MBITS))) - (cb + (lo >> (23 - MBITS)));
}

// Magnitude bits, in output dtype OUT, of a non-negative fp32 value that is finite or +Inf after an
// overflow: RNE, saturated to the largest finite value (as round_exact_to).
template <DType OUT>
MXQ_HD_HOT std::uint32_t out_mag_bits(float v) {
  const std::uint32_t b = f2u(v);
  if constexpr (OUT == DType::f32) {
    return umin(b, 0x7F7FFFFFu);
  } else if constexpr (OUT == DType::bf16) {
    return umin(::mxq::bf16_rne_bits(b), 0x7F7Fu);  // mxq/convert.hpp (constexpr: callable on the GPU)
  } else {
    const std::uint32_t normal = ((b - (112u << 23)) + 0xFFFu + ((b >> 13) & 1u)) >> 13;
    const std::uint32_t sub = f2u(add_rn(v, 0.5f)) - 0x3F000000u;  // v < 2^-14: RNE onto multiples of 2^-24
    return umin(b >= 0x38800000u ? normal : sub, 0x7BFFu);
  }
}

// f32_to_dtype_bits for a value that is not NaN: finite values round and saturate, infinities stay
// infinities (the NVFP4 dequantize convention).
template <DType OUT>
MXQ_HD_HOT std::uint32_t to_dtype_bits_nonnan(float v) {
  const std::uint32_t b = f2u(v), sign = b >> 31, mag = b & 0x7FFFFFFFu;
  constexpr int sb = OUT == DType::f32 ? 31 : 15;
  if (mag == 0x7F800000u) return OUT == DType::f32 ? b : ((sign << 15) | (OUT == DType::bf16 ? 0x7F80u : 0x7C00u));
  return out_mag_bits<OUT>(u2f(mag)) | (sign << sb);
}

// Exact fp32 value of an E2M1 magnitude code (0..7).
MXQ_HD_HOT float e2m1_value(std::uint32_t mag) {
  return mag < 2 ? u2f(mag ? 0x3F000000u : 0u) : u2f(((((mag >> 1) + 126u)) << 23) | ((mag & 1u) << 22));
}

// Division by the NVFP4 tensor scale without a division per element. For a in [0, 2688] (an E2M1
// magnitude times an E4M3 block scale) and S in [kRecipDivMinS, kRecipDivMaxS], with r = div_rn(1, S):
//   q = RN(a * r)  (within one ulp of a / S),  e = a - q * S  (exact, by one fma),  RN(q + e * r)
// is the correctly rounded a / S (Markstein's correction; no intermediate leaves the normal range in
// that S range). codec_test checks it against div_rn for every significand an E2M1 x E4M3 product can
// have and every one of the 2^23 significands of S; outside the range callers divide.
inline constexpr float kRecipDivMinS = 0x1p-32f, kRecipDivMaxS = 0x1p32f;
MXQ_HD_HOT bool recip_div_ok(float S) { return S >= kRecipDivMinS && S <= kRecipDivMaxS; }
MXQ_HD_HOT float recip_div(float a, float S, float r) {
  const float q = mul_rn(a, r);
  return fma_rn(fma_rn(-q, S, a), r, q);
}

// The bf16 outputs of the eight NVFP4 magnitude codes under one block scale sval (an E4M3 value, 0
// included) and S in recip_div's range (r = 1 / S): entry k is RN_bf16(RN(E2M1(k) * sval / S)), two
// per word (k = 2j in the low half of t[j]). The magnitudes are {1/2, 1, 2, 4} and {3/2, 3, 6} times
// sval: each set is one quotient scaled by powers of two, and scaling by 2^k commutes with both
// roundings while the results stay normal and finite, which holds here (a nonzero quotient lies in
// [2^-41, 2^41]). So two divisions give the table. fastmath_test checks it against nvfp4_decode for every
// E4M3 scale under S across recip_div's range.
MXQ_HD_HOT void nvfp4_bf16_table(float sval, float S, float r, std::uint32_t (&t)[4]) {
  const float q1 = recip_div(sval, S, r), q3 = recip_div(mul_rn(1.5f, sval), S, r);
  const std::uint32_t b1 = out_mag_bits<DType::bf16>(q1), b3 = out_mag_bits<DType::bf16>(q3);
  const std::uint32_t d = sval == 0.0f ? 0u : 0x80u;  // a zero scale: every entry is +0
  t[0] = (b1 - d) << 16;                              // 0 | 1/2
  t[1] = b1 | (b3 << 16);                             // 1 | 3/2
  t[2] = (b1 + d) | ((b3 + d) << 16);                 // 2 | 3
  t[3] = (b1 + 2 * d) | ((b3 + 2 * d) << 16);         // 4 | 6
}

// x * m for an NVFP4 element x under multiplier m, a zero x giving itself: nvfp4_encode's zero case
// (0 * Inf, a multiplier past fp32's range under a huge tensor scale, would be NaN).
MXQ_HD_HOT float nvfp4_product(std::uint32_t xbits, float m) {
  const float p = mul_rn(u2f(xbits), m);
  return (xbits & 0x7FFFFFFFu) == 0 ? u2f(xbits) : p;
}

// NVFP4 element code (RNE) of x under multiplier m: nvfp4_encode(x, m) without stochastic rounding.
MXQ_HD_HOT std::uint32_t nvfp4_encode_rne(std::uint32_t xbits, float m) {
  const std::uint32_t sign = xbits >> 31;
  if ((xbits & 0x7FFFFFFFu) == 0) return sign << 3;
  const float r = rne_mag<ElemType::e2m1>(mul_rn(u2f(xbits), m), 1.0f);
  return code_of<ElemType::e2m1>(r, sign);
}

// nvfp4_encode_rne for a non-NaN x, with the code read off the rounding: a = min(|x| m, 6) (a
// product past 6, an overflow included, saturates at code 7; a zero x stays 0 even under an infinite
// m), and t = a + Cc holds the rounded magnitude in quanta of a's binade clamped below at 1
// (readoff_mag). fastmath_test checks it against nvfp4_encode_rne.
MXQ_HD_HOT std::uint32_t nvfp4_encode_rne_readoff(std::uint32_t xbits, float m) {
  constexpr std::uint32_t lo = 127u << 23, kC = rne_const_bits<1>();
  const float a = fminf_nn(nvfp4_product(xbits & 0x7FFFFFFFu, m), 6.0f);
  const std::uint32_t be = umax(f2u(a) & 0x7F800000u, lo), cb = be + kC;
  return readoff_mag<1>(f2u(add_rn(a, u2f(cb))), be, cb, lo) | ((xbits >> 31) << 3);
}

// The NVFP4 block-scale code E4M3_RN_satfinite(y) (encode_f32 onto E4M3) of y >= 0, finite or +Inf,
// read off the rounding: y clamped at 448 (so past the largest value it saturates), the binade clamped
// below at E4M3's smallest normal one (2^-6: the subnormals' quantum 2^-9). fastmath_test checks it
// against encode_f32.
MXQ_HD_HOT std::uint32_t e4m3_code_rne_sat(float y) {
  constexpr std::uint32_t lo = 121u << 23, kC = rne_const_bits<3>();
  const float a = fminf_nn(y, 448.0f);
  const std::uint32_t be = umax(f2u(a) & 0x7F800000u, lo), cb = be + kC;
  return readoff_mag<3>(f2u(add_rn(a, u2f(cb))), be, cb, lo);
}

// RN(v / 6) without a division (the NVFP4 block scale's argument amax * S / 6): recip_div with S = 6,
// q = RN(v * RN(1/6)) and one fma correction. Correctly rounded for every v >= 0 whose quotient is a
// normal number; below that (v < 6 * 2^-126) at most one subnormal ulp off, where e4m3_code_rne_sat
// gives 0 either way; +Inf gives NaN, which e4m3_code_rne_sat saturates as it does +Inf. Hence
// nvfp4_scale_code_fast(v) == e4m3_code_rne_sat(div_rn(v, 6)) for every v in [0, +Inf]: fastmath_test
// checks each one. Three instructions where the division takes about twelve and a branch.
MXQ_HD_HOT float div6_rn_normal(float v) { return recip_div(v, 6.0f, 0x1.555556p-3f); }  // RN(1/6)
// The NVFP4 block-scale code E4M3_RN_satfinite(v / 6) of v = amax * S (v >= 0, finite or +Inf; the
// reference's nvfp4_block_scale_code).
MXQ_HD_HOT std::uint32_t nvfp4_scale_code_fast(float v) { return e4m3_code_rne_sat(div6_rn_normal(v)); }

// nvfp4_quest_scale_code (codec.hpp) by e4m3_code_rne_sat: the same code for every t >= 0 and +Inf
// (fastmath_test), kE4M3NaN for a NaN t.
MXQ_HD_HOT std::uint32_t nvfp4_quest_scale_code_fast(float t) { return t != t ? 0x7Fu : e4m3_code_rne_sat(t); }

// ---- two bf16 elements per 32-bit word (the kernels' bf16 MX fast path) --------------------------------
// Lane-wise helpers on two 16-bit lanes: on the GPU single SIMD instructions, on the host the same
// arithmetic per lane. bf16x2_add is the correctly rounded (RNE) sum; the host forms it from the
// fp32 sum, which is exact for the operands mx_*_bf16x2 add (see there).
MXQ_HD_HOT std::uint32_t vmaxu2(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  return umax(a & 0xFFFFu, b & 0xFFFFu) | (umax(a >> 16, b >> 16) << 16);
#endif
}
MXQ_HD_HOT std::uint32_t vminu2(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vminu2(a, b);
#else
  return umin(a & 0xFFFFu, b & 0xFFFFu) | (umin(a >> 16, b >> 16) << 16);
#endif
}
// a + b (sign * -1 for b: a - b) on both bf16 lanes, one rounding (fma.rn.bf16x2 with a unit factor).
template <bool SUB = false>
MXQ_HD_HOT std::uint32_t bf16x2_add(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  std::uint32_t d;
  constexpr std::uint32_t one = SUB ? 0xBF80BF80u : 0x3F803F80u;  // (-1, -1) or (1, 1)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(b), "r"(one), "r"(a));
  return d;
#else
  auto lane = [](std::uint32_t x, std::uint32_t y) {
    const float s = SUB ? sub_rn(u2f(x << 16), u2f(y << 16)) : add_rn(u2f(x << 16), u2f(y << 16));
    return std::uint32_t(::mxq::f32_to_bf16(s));  // mxq/convert.hpp
  };
  return lane(a & 0xFFFFu, b & 0xFFFFu) | (lane(a >> 16, b >> 16) << 16);
#endif
}
// min of two bf16 lanes that are not NaN.
MXQ_HD_HOT std::uint32_t bf16x2_min(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  std::uint32_t d;
  asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  auto lane = [](std::uint32_t x, std::uint32_t y) { return u2f(x << 16) < u2f(y << 16) ? x : y; };
  return lane(a & 0xFFFFu, b & 0xFFFFu) | (lane(a >> 16, b >> 16) << 16);
#endif
}

// The MX round-to-nearest-even element step (see the top of this file) on a word of two bf16 inputs
// under the scale 2^e, in bf16 arithmetic: per lane, be = the exponent bits of |x|'s binade clamped
// to [lo, hi], C = 1.5 * 2^(binade - mbits + 7) (its bf16 ulp is the quantum), t = |x| + C rounds onto
// the grid; |x| either has its lowest bit at or above C's fp32 ulp or lies below a quarter quantum,
// so the host's fp32 sum rounds as the bf16 add does. e must lie in the kernels' fast range, where C
// and t - C are normal bf16 values. fastmath_test checks both functions against the reference for every
// bf16 pair lane and scale of that range.
struct MxPair {
  std::uint32_t lo2, hi2, kc2, k2, maxv2;  // each a 16-bit constant in both lanes
};
template <ElemType ET>
MXQ_HD_HOT MxPair mx_pair(int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const std::uint32_t lo = std::uint32_t(f.emin + e + 127) << 7, hi = std::uint32_t(f.emax + 1 + e + 127) << 7;
  const std::uint32_t maxv = f2u(mul_rn(u2f(max_value_bits(f)), pow2f(e))) >> 16;  // at most 4 significant bits: exact
  return MxPair{lo * 0x10001u, hi * 0x10001u, ((std::uint32_t(7 - f.mbits) << 7) | 0x40u) * 0x10001u,
                (lo >> (7 - f.mbits)) * 0x10001u, maxv * 0x10001u};
}
// QDQ: the two rounded, saturated values as bf16 (signs kept). Formats without two's complement.
template <ElemType ET, bool CLAMP_HI>
MXQ_HD_HOT std::uint32_t mx_qdq_bf16x2(std::uint32_t w, const MxPair& k) {
  std::uint32_t be = vmaxu2(w & 0x7F807F80u, k.lo2);
  if (CLAMP_HI) be = vminu2(be, k.hi2);
  const std::uint32_t cb = be + k.kc2;  // lanes stay below 0x7F80: no carry between them
  const std::uint32_t t = bf16x2_add(w & 0x7FFF7FFFu, cb);
  return bf16x2_min(bf16x2_add<true>(t, cb), k.maxv2) | (w & 0x80008000u);
}
// Two fp32 values (bits a, b) rounded to bf16 by round to odd: truncated, the last bit set when any
// dropped bit was set; packed a's in the low lane. NaN stays NaN, +-Inf and +-0 are exact. For the
// MX floats' round to nearest even after it (formats of at most 4 significant bits, in the fast range
// where every grid point and midpoint is a bf16 with its last bit clear) the result is the direct
// rounding of a and b: an inexact input lands strictly between the same two such values as itself
// (fastmath_test: FastBf16Pairs.RoundToOddThenPairsMatchTheFp32Reference).
MXQ_HD_HOT std::uint32_t rto_bf16x2(std::uint32_t a, std::uint32_t b) {
  const std::uint32_t sticky = std::uint32_t((a & 0xFFFFu) != 0u) | (std::uint32_t((b & 0xFFFFu) != 0u) << 16);
  return ((a >> 16) | (b & 0xFFFF0000u)) | sticky;
}
// Quantize: the two element codes (sign at bit bits - 1), one per 16-bit lane; the lanes' magnitudes
// read off t as readoff_mag does (be has no bits below bit 7, so the shift keeps the lanes apart).
template <ElemType ET, bool CLAMP_HI>
MXQ_HD_HOT std::uint32_t mx_codes_bf16x2(std::uint32_t w, const MxPair& k) {
  constexpr FloatSpec f = Elem<ET>::spec;
  std::uint32_t be = vmaxu2(w & 0x7F807F80u, k.lo2);
  if (CLAMP_HI) be = vminu2(be, k.hi2);
  const std::uint32_t cb = be + k.kc2;
  const std::uint32_t t = bf16x2_add(w & 0x7FFF7FFFu, cb);
  const std::uint32_t mag = vminu2((t + (be >> (7 - f.mbits))) - (cb + k.k2), std::uint32_t(f.maxcode) * 0x10001u);
  return mag | ((w >> (16 - f.bits)) & (0x10001u << (f.bits - 1)));
}

// encode_scaled with stochastic rounding for a non-NaN x, in 32-bit arithmetic (infinities saturate).
template <ElemType ET>
MXQ_HD_HOT std::uint32_t encode_scaled_sr(std::uint32_t xbits, int scale_exp, std::uint32_t rnd) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const std::uint32_t sign = xbits >> 31, ex = (xbits >> 23) & 0xFFu, m = xbits & 0x7FFFFFu;
  if (ex == 0xFFu) return signed_code(f.maxcode, sign, f);
  const std::uint32_t sig = ex ? (m | 0x800000u) : m;
  const int exp = (ex ? int(ex) - 150 : -149) - scale_exp;
  return signed_code(sig ? round_magnitude32(sig, exp, f, true, rnd) : 0u, sign, f);
}

// Stochastic rounding in the unscaled domain (the fast paths' form of encode_scaled_sr): the rounded
// magnitude of |x| on ET's grid scaled by 2^e, for a finite x, |x| < 2^(emax+1+e) (the amax rules)
// and e in the kernels' fast range [-126 - (emin - mbits), 254 - (emax + 151 - mbits)]: every
// quantum is a normal fp32 and the rounding constant stays finite. t = |x| truncated to its binade's quantum Q by a round-toward-zero add, and
// it rounds up by Q when rnd < floor((|x| - t) / Q * 2^32): round_magnitude32's comparison on the
// same fixed-point fraction. Saturates at the largest value. fastmath_test checks it against
// decode(encode_scaled_sr) for every bf16 pattern at every such scale.
template <ElemType ET>
MXQ_HD_HOT float sr_round_unscaled(std::uint32_t xbits, int e, std::uint32_t rnd) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
  const std::uint32_t lo = std::uint32_t(f.emin + e + 127) << 23;
  // |x| at or above 2^(emax + 1 + e) (quest, the QuTLASS rule) saturates: clamping it there keeps the
  // rounding constant finite and still rounds to the largest value.
  const std::uint32_t xa = umin(xbits & 0x7FFFFFFFu, std::uint32_t(f.emax + 1 + e + 127) << 23);
  const std::uint32_t be = umax(xa & 0x7F800000u, lo);                    // the binade's exponent bits
  const float Cc = u2f(be + kC);
  const float t = sub_rn(add_rz(u2f(xa), Cc), Cc);                        // truncated to the grid
  const float q = u2f(be - (std::uint32_t(f.mbits) << 23));               // the quantum Q
  const int qexp = int(be >> 23) - 127 - f.mbits;
  // (|x| - t) / Q * 2^32, exact where it is >= 1 (below 1 its floor is 0 whatever the rounding)
  const float frac = mul_rn(mul_rn(sub_rn(u2f(xa), t), pow2f(-qexp)), 4294967296.0f);
  const std::uint32_t thr = frac >= 4294967296.0f ? 0xFFFFFFFFu : f2u_trunc(frac);
  const float r = rnd < thr ? add_rn(t, q) : t;
  return fminf_nn(r, mul_rn(u2f(max_value_bits(f)), pow2f(e)));
}

// sr_round_unscaled's result as ET's magnitude code, in integer arithmetic (no rounding constant, no
// fp32 subtraction): for any non-NaN x (infinities and |x| past the largest value saturate) and e in
// the kernels' fast range, so that the smallest normal element's binade field lo >= 1. |x| = sig 2^(E-150)
// (E its exponent field, a subnormal read in field 1 without the implicit bit); below lo the quantum
// stays lo's: sh = 23 - mbits + max(lo - E, 0) bits of sig lie below it. The grid point under |x| as
// a code is (max(E - lo, 0) << mbits) + (sig >> sh) (IEEE codes count quanta across binades), and it
// rounds up by one code when rnd < floor(frac 2^32), frac = (sig mod 2^sh) / 2^sh: round_magnitude32's
// comparison on the same fraction. Every shift count is below 32. fastmath_test checks it against
// encode_scaled_sr.
template <ElemType ET>
MXQ_HD_HOT std::uint32_t sr_code_unscaled(std::uint32_t xbits, int e, std::uint32_t rnd) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const std::uint32_t fld = (xbits >> 23) & 0xFFu, E = umax(fld, 1u);
  const std::uint32_t sig = (xbits & 0x7FFFFFu) | (std::uint32_t(fld != 0u) << 23);
  const std::uint32_t lo = std::uint32_t(f.emin + e + 127);
  const std::uint32_t up = E > lo ? E - lo : 0u, sh = std::uint32_t(23 - f.mbits) + (lo > E ? lo - E : 0u);
  const std::uint32_t t = (up << f.mbits) + (sig >> umin(sh, 31u));  // sig < 2^24: 0 from sh = 24 on
  const std::uint32_t rem = sig & ((1u << umin(sh, 24u)) - 1u);
  const std::uint32_t thr = (rem << (32u - umin(sh, 32u))) >> umin(umax(sh, 32u) - 32u, 31u);
  return umin(t + std::uint32_t(rnd < thr), f.maxcode);
}

// The value of a magnitude code of ET scaled by 2^e (e in the kernels' fast range), as fp32 bits: a
// normal code's exponent and mantissa fields placed in binade lo - 1 + (code >> mbits); a subnormal
// code c read as 2^(lo-1) (1 + c 2^-mbits), less 2^(lo-1), doubled: c 2^(lo-mbits). Exact throughout.
template <ElemType ET>
MXQ_HD_HOT std::uint32_t sr_code_value_bits(std::uint32_t code, int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const std::uint32_t lo1 = std::uint32_t(f.emin + e + 126) << 23;  // 2^(lo-1)'s bits
  const std::uint32_t v = lo1 + (code << (23 - f.mbits));
  const float sub = mul_rn(sub_rn(u2f(v), u2f(lo1)), 2.0f);
  return code < (1u << f.mbits) ? f2u(sub) : v;
}

// sr_round_unscaled for a comparison word of B <= 16 random bits (sr_word: the field r in the word's B
// high bits, the 32 - B low bits set), by a dithered add. The rule rounds up iff r < floor(frac 2^B),
// frac = (|x| - t) / Q: for integers that is r + 1 <= frac 2^B, i.e. frac + (2^B - 1 - r) 2^-B >= 1. So
// the result is |x| + (2^B - 1 - r) 2^-B Q truncated onto the grid. The dither is D - Q with D = Q (1 +
// (2^B - 1 - r) 2^-B), whose bits are Q's with the inverted field as the top mantissa bits (~word >> 9,
// exact for B <= 23); D - Q is exact (Sterbenz). The sum is rounded toward zero, which cannot carry it
// past a grid point (grid points are fp32 values), and then truncated onto the grid by the constant of
// |x|'s binade as in sr_round_unscaled (one binade up, the grid point 2^(E+1) is still exact there).
// Q must be a normal fp32: e in MxFastRange<ET>. fastmath_test checks it against the scalar codec.
template <ElemType ET>
MXQ_HD_HOT float sr_round_dither(std::uint32_t xbits, int e, std::uint32_t word) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
  const std::uint32_t lo = std::uint32_t(f.emin + e + 127) << 23;
  const std::uint32_t xa = umin(xbits & 0x7FFFFFFFu, std::uint32_t(f.emax + 1 + e + 127) << 23);
  const std::uint32_t be = umax(xa & 0x7F800000u, lo);    // the binade's exponent bits
  const std::uint32_t qb = be - (std::uint32_t(f.mbits) << 23);  // the quantum Q's bits
  const float d = sub_rn(u2f(qb | (~word >> 9)), u2f(qb));  // (2^B - 1 - r) 2^-B Q, exact
  const float Cc = u2f(be + kC);
  const float t = sub_rn(add_rz(add_rz(u2f(xa), d), Cc), Cc);
  return fminf_nn(t, mul_rn(u2f(max_value_bits(f)), pow2f(e)));
}

// The E2M1 magnitude code (0..7) of a grid value v >= 0 of E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6): from 1 up
// the exponent and the one mantissa bit, (bits >> 22) - 252; below, 0.5 is the only nonzero value.
MXQ_HD_HOT std::uint32_t e2m1_code_of_grid(float v) {
  const std::uint32_t b = f2u(v);
  return b >= 0x3F800000u ? (b >> 22) - 252u : std::uint32_t(b != 0u);
}

// nvfp4_encode with stochastic rounding (x * m rounded once in fp32, then onto E2M1).
MXQ_HD_HOT std::uint32_t nvfp4_encode_sr(std::uint32_t xbits, float m, std::uint32_t rnd) {
  if ((xbits & 0x7FFFFFFFu) == 0) return (xbits >> 31) << 3;
  return encode_scaled_sr<ElemType::e2m1>(f2u(mul_rn(u2f(xbits), m)), 0, rnd);
}

// bf16 bits (high half of the returned word, sign at bit 31) of an E4M3 code that is not NaN under
// the scale 2^e, e in [-117, 119] (sc = 2^e, sc2 = 2^(e+1)): every product is then a normal bf16 with
// at most 4 significant bits. The magnitude bits placed in an fp32 (exponent field + 120) are the
// value of a normal code; a subnormal code (field 0) gives (1 + m/8) 2^-7, and subtracting 2^-7 then
// doubling gives m 2^-9. Exact throughout; fastmath_test checks it against mx_dequant_bits.
MXQ_HD_HOT std::uint32_t e4m3_bf16_hi(std::uint32_t code, float sc, float sc2) {
  const std::uint32_t mag = code & 0x7Fu;
  const bool sub = mag < 8u;
  const float v = add_rn(u2f((mag << 20) + (120u << 23)), sub ? -0.0078125f : 0.0f);
  return (f2u(mul_rn(v, sub ? sc2 : sc)) & 0xFFFF0000u) | ((code & 0x80u) << 24);
}

// mx_dequant_bits for an element code that is not NaN/Inf, under a finite scale 2^e (scale = pow2f(e),
// e in [-127, 127]): the element value and its product with the scale are exact in fp32 (or +Inf
// past FLT_MAX, which saturates).
template <ElemType ET, DType OUT>
MXQ_HD_HOT std::uint32_t mx_dequant_finite(std::uint32_t code, float scale) {
  constexpr FloatSpec f = Elem<ET>::spec;
  std::uint32_t sign = 0, n = 0;
  int pe = 0;
  decode_parts(code, f, sign, n, pe);
  const float v = mul_rn(mul_rn(float(n), pow2f(pe)), scale);
  return out_mag_bits<OUT>(v) | (sign << (OUT == DType::f32 ? 31 : 15));
}

}  // namespace mxq::core
