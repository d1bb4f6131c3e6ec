#pragma once
// Per-element arithmetic of the fast paths, branch-free: selects on bit patterns, NVFP4's element
// product and code, an element code with its sign, the MX read-off rounding to nearest even, and
// stochastic rounding's integer form (core::sr_code_unscaled) in AVX2 / AVX-512F lanes.
#include "cpu/common/tiles.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// ---- branch-free selects -----------------------------------------------------------------------------------
// c ? a : b on bit patterns, written with masks: GCC keeps a select of floating-point values (and
// the float operations that feed only one side) as control flow under -ftrapping-math, which stops
// the vectoriser; on integers it does not.
MXQ_INLINE std::uint32_t bsel(bool c, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t m = 0u - std::uint32_t(c);
  return (a & m) | (b & ~m);
}

// to_dtype_bits_nonnan (fastmath.hpp) with the infinity case selected instead of returned early.
template <DType OUT>
MXQ_INLINE std::uint32_t to_dtype_bits_nonnan_bf(float v) {
  const std::uint32_t b = f2u(v), sign = b >> 31, mag = b & 0x7FFFFFFFu;
  constexpr int sb = OUT == DType::f32 ? 31 : 15;
  const std::uint32_t inf = OUT == DType::f32 ? b : ((sign << 15) | (OUT == DType::bf16 ? 0x7F80u : 0x7C00u));
  return bsel(mag == 0x7F800000u, inf, out_mag_bits<OUT>(u2f(mag)) | (sign << sb));
}

// nvfp4_product (fastmath.hpp) with its zero case a select on bits (a float select stays a branch and
// stops the vectoriser).
MXQ_INLINE std::uint32_t nvfp4_product_bits_bf(std::uint32_t xbits, float m) {
  return bsel((xbits & 0x7FFFFFFFu) == 0, xbits, f2u(mul_rn(u2f(xbits), m)));
}

// nvfp4_encode_rne_readoff (fastmath.hpp) with its saturating min written as a select.
MXQ_INLINE std::uint32_t nvfp4_code_rne_bf(std::uint32_t xbits, float m) {
  constexpr std::uint32_t lo = 127u << 23, kC = rne_const_bits<1>();
  const float prod = u2f(nvfp4_product_bits_bf(xbits & 0x7FFFFFFFu, m));
  const float a = u2f(bsel(prod < 6.0f, f2u(prod), 0x40C00000u));
  const std::uint32_t be = umax(f2u(a) & 0x7F800000u, lo), cb = be + kC;
  return readoff_mag<1>(f2u(add_rn(a, u2f(cb))), be, cb, lo) | ((xbits >> 31) << 3);
}

// ---- MX element codes --------------------------------------------------------------------------------------
// A magnitude code with its sign: sign-magnitude, or two's complement for INT8 (no -0), as signed_code.
template <ElemType ET>
MXQ_INLINE std::uint32_t sign_code(std::uint32_t mag, std::uint32_t sign) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) {
    const std::uint32_t neg = 0u - sign;
    return ((mag ^ neg) + sign) & 0xFFu;
  } else {
    return mag | (sign << (f.bits - 1));
  }
}

// The binades an element of a block scaled by 2^e (e in MxFastRange) is clamped to when rounded in
// the unscaled domain: lo that of the smallest normal element, hi one past the largest.
struct MxBinades {
  std::uint32_t lo, hi;
};
template <ElemType ET>
MXQ_INLINE MxBinades mx_binades(int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  return {std::uint32_t(f.emin + e + 127) << 23, std::uint32_t(f.emax + 1 + e + 127) << 23};
}
// The RNE code of one element with magnitude bits xa and sign bit `sign` under those binades, read
// off the rounding's bits (readoff_mag) and saturated at the largest code.
template <ElemType ET>
MXQ_INLINE std::uint32_t mx_code_rne_fast(std::uint32_t xa, std::uint32_t sign, MxBinades bn) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
  const std::uint32_t be = umin(umax(xa & 0x7F800000u, bn.lo), bn.hi), cb = be + kC;
  const std::uint32_t t = f2u(add_rn(u2f(xa), u2f(cb)));
  return sign_code<ET>(umin(readoff_mag<f.mbits>(t, be, cb, bn.lo), f.maxcode), sign);
}

#if defined(MXQ_CPU_AVX2)
// ---- stochastic rounding in vector lanes -------------------------------------------------------------------
// + e + 127 (one value per lane: e may differ by lane) with the comparison words w, every shift count
// as there (variable shifts of 32 or more give 0, which its clamps stand for; every intermediate stays
// below 2^31).
template <ElemType ET>
__attribute__((target("avx2"))) inline __m256i sr_mags8_avx2(__m256i a, __m256i vlo, __m256i w) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256(), v32 = _mm256_set1_epi32(32);
  const __m256i fld = _mm256_srli_epi32(a, 23);
  const __m256i E = _mm256_max_epi32(fld, one);
  const __m256i sig =
      _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)), _mm256_andnot_si256(_mm256_cmpeq_epi32(fld, zero), _mm256_set1_epi32(0x800000)));
  const __m256i up = _mm256_max_epi32(_mm256_sub_epi32(E, vlo), zero);
  const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(23 - f.mbits), _mm256_max_epi32(_mm256_sub_epi32(vlo, E), zero));
  const __m256i t = _mm256_add_epi32(_mm256_slli_epi32(up, f.mbits), _mm256_srlv_epi32(sig, sh));
  const __m256i rem = _mm256_and_si256(sig, _mm256_sub_epi32(_mm256_sllv_epi32(one, sh), one));
  const __m256i thr = _mm256_or_si256(_mm256_sllv_epi32(rem, _mm256_sub_epi32(v32, sh)), _mm256_srlv_epi32(rem, _mm256_sub_epi32(sh, v32)));
  const __m256i flip = _mm256_set1_epi32(int(0x80000000u));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_xor_si256(thr, flip), _mm256_xor_si256(w, flip));  // w < thr, unsigned
  return _mm256_min_epu32(_mm256_sub_epi32(t, below), _mm256_set1_epi32(int(f.maxcode)));
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// sr_mags8_avx2 with AVX-512F: sixteen lanes, the same operations.
template <ElemType ET>
MXQ_INLINE __attribute__((target("avx512f"))) __m512i sr_mags16_avx512(__m512i a, __m512i vlo, __m512i w) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), v32 = _mm512_set1_epi32(32);
  const __m512i fld = _mm512_srli_epi32(a, 23);
  const __m512i E = _mm512_max_epi32(fld, one);
  const __m512i mant = _mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF));
  const __m512i sig = _mm512_mask_or_epi32(mant, _mm512_test_epi32_mask(fld, fld), mant, _mm512_set1_epi32(0x800000));
  const __m512i up = _mm512_max_epi32(_mm512_sub_epi32(E, vlo), zero);
  const __m512i sh = _mm512_add_epi32(_mm512_set1_epi32(23 - f.mbits), _mm512_max_epi32(_mm512_sub_epi32(vlo, E), zero));
  const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(up, f.mbits), _mm512_srlv_epi32(sig, sh));
  const __m512i rem = _mm512_and_si512(sig, _mm512_sub_epi32(_mm512_sllv_epi32(one, sh), one));
  const __m512i thr = _mm512_or_si512(_mm512_sllv_epi32(rem, _mm512_sub_epi32(v32, sh)), _mm512_srlv_epi32(rem, _mm512_sub_epi32(sh, v32)));
  const __mmask16 below = _mm512_cmplt_epu32_mask(w, thr);
  return _mm512_min_epu32(_mm512_mask_add_epi32(t, below, t, one), _mm512_set1_epi32(int(f.maxcode)));
}
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace mxq::cpu
