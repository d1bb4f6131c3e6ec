#pragma once
// The scalar codec shared by every backend: element encode/decode, scale-exponent rules, the NVFP4
// block arithmetic and the conversions to and from bf16/fp16/fp32. Everything here is integer
// arithmetic on bit patterns, or single IEEE fp32 operations written out one at a time, so that the
// host compiler and nvcc produce the same bits (docs/numerics.md). Tested exhaustively in
// tests/codec_test.cc against an independent formulation.
#include <cstdint>
#include <cstring>

#include <mxq/convert.hpp>
#include <mxq/types.hpp>

#if defined(__CUDACC__)
#define MXQ_HD __host__ __device__ __forceinline__
#define MXQ_HD_HOT __host__ __device__ __forceinline__
#else
#define MXQ_HD inline
#define MXQ_HD_HOT [[gnu::always_inline]] inline  // per-block code the fast paths inline with constant specs
#endif

namespace mxq::core {

// ---- bit casts and single IEEE operations --------------------------------------------------------------
MXQ_HD std::uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MXQ_HD float u2f(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
// NOTE: explicit round-to-nearest operations so that nvcc cannot contract them into FMAs; the host
// build uses -ffp-contract=off for the same reason.
MXQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MXQ_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MXQ_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MXQ_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// a + b rounded toward zero.
MXQ_HD float add_rz(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rz(a, b);
#else
  // NOTE: the host has no per-operation rounding mode. For a, b >= 0 with a finite sum (the only use):
  // round to nearest, then step down one ulp when that rounded up; TwoSum's error term (exact,
  // whatever the operands' order) says which way it went.
  const float s = a + b;
  const float bb = s - a;
  const float err = (a - (s - bb)) + (b - bb);
  const bool up = err < 0.0f;
  std::uint32_t u;
  std::memcpy(&u, &s, 4);
  if (up) --u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
#endif
}
// Truncation of a float in [0, 2^32) to an unsigned integer.
MXQ_HD std::uint32_t f2u_trunc(float v) {
#if defined(__CUDA_ARCH__)
  return __float2uint_rz(v);
#else
  return static_cast<std::uint32_t>(v);
#endif
}
// a * b + c with one rounding (IEEE fusedMultiplyAdd).
MXQ_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}
MXQ_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

MXQ_HD_HOT int clz64(std::uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return __builtin_clzll(v);
#endif
}

MXQ_HD_HOT int clz32(std::uint32_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return __builtin_clz(v);
#endif
}

MXQ_HD bool is_finite_bits(std::uint32_t u) { return (u & 0x7F800000u) != 0x7F800000u; }

// ---- binary floating-point format descriptions -----------------------------------------------------------
// A sign-magnitude binary format with `mbits` stored mantissa bits, smallest normal exponent `emin`
// (unbiased), largest finite exponent `emax`, and `maxcode` the magnitude code of the largest finite
// value. Codes are ((E - emin) << mbits) + n for the rounded significand n (see round_magnitude).
// INT8 fits the same scheme as a fixed-point grid: mbits 6, emin 0, so every value is n * 2^-6.
struct FloatSpec {
  int bits;        // storage width of a code, sign included
  int mbits;       // stored mantissa bits
  int emin;        // exponent of the smallest normal binade (subnormals below share its quantum)
  int emax;        // exponent of the largest finite binade
  std::uint32_t maxcode;  // magnitude code of the largest finite value
  bool twos_complement;   // INT8: negative codes are two's complement, no negative zero
};

// NOTE: device code may not odr-use a namespace-scope object of class type, so code that runs on the
// GPU takes the specs from these functions; the k* constants are for host code.
MXQ_HD constexpr FloatSpec spec_e2m1() { return {4, 1, 0, 2, 0x7, false}; }
MXQ_HD constexpr FloatSpec spec_e2m3() { return {6, 3, 0, 2, 0x1F, false}; }
MXQ_HD constexpr FloatSpec spec_e3m2() { return {6, 2, -2, 4, 0x1F, false}; }
MXQ_HD constexpr FloatSpec spec_e4m3() { return {8, 3, -6, 8, 0x7E, false}; }
MXQ_HD constexpr FloatSpec spec_e5m2() { return {8, 2, -14, 15, 0x7B, false}; }
MXQ_HD constexpr FloatSpec spec_int8() { return {8, 6, 0, 0, 0x7F, true}; }
MXQ_HD constexpr FloatSpec spec_bf16() { return {16, 7, -126, 127, 0x7F7F, false}; }
MXQ_HD constexpr FloatSpec spec_f16() { return {16, 10, -14, 15, 0x7BFF, false}; }
MXQ_HD constexpr FloatSpec spec_f32() { return {32, 23, -126, 127, 0x7F7FFFFFu, false}; }
constexpr FloatSpec kE2M1 = spec_e2m1();
constexpr FloatSpec kE2M3 = spec_e2m3();
constexpr FloatSpec kE3M2 = spec_e3m2();
constexpr FloatSpec kE4M3 = spec_e4m3();
constexpr FloatSpec kE5M2 = spec_e5m2();
constexpr FloatSpec kINT8 = spec_int8();
constexpr FloatSpec kBF16 = spec_bf16();
constexpr FloatSpec kF16 = spec_f16();
constexpr FloatSpec kF32 = spec_f32();

MXQ_HD constexpr FloatSpec elem_spec(ElemType t) {
  switch (t) {
    case ElemType::e2m1: return spec_e2m1();
    case ElemType::e2m3: return spec_e2m3();
    case ElemType::e3m2: return spec_e3m2();
    case ElemType::e4m3: return spec_e4m3();
    case ElemType::e5m2: return spec_e5m2();
    case ElemType::int8: return spec_int8();
  }
  return spec_e2m1();
}

// Element traits for compile-time dispatch (the kernels and the fast CPU path).
template <ElemType T>
struct Elem {
  static constexpr FloatSpec spec = elem_spec(T);
};

// Largest finite element value as an fp32 bit pattern.
MXQ_HD_HOT constexpr std::uint32_t max_value_bits(const FloatSpec& f) {
  if (f.twos_complement) return 0x3FFE0000u;  // 127 * 2^-6 = 1.984375
  // significand (2^mbits + mantissa) * 2^(emax - mbits)
  const std::uint32_t mant = f.maxcode & ((1u << f.mbits) - 1u);
  return (std::uint32_t(f.emax + 127) << 23) | (mant << (23 - f.mbits));
}

// ---- rounding an exact value sig * 2^exp onto a format's grid ----------------------------------------
// Returns the magnitude code of |value| rounded to nearest-even (stochastic = false) or rounded up
// with probability frac when stochastic (see below), saturating to maxcode. sig > 0.
//
// NOTE: the stochastic comparison is exact fixed-point arithmetic: with `shift` dropped bits and
// remainder rem (0 <= rem < 2^shift), the value rounds up iff rnd < t, t = rem * 2^(32-shift) when
// shift <= 32 (probability exactly rem / 2^shift), else t = floor(rem / 2^(shift-32)) (probability
// truncated to 32 fractional bits; only values far below the grid's quantum get here).
MXQ_HD std::uint32_t round_magnitude(std::uint64_t sig, int exp, const FloatSpec& f,
                                     bool stochastic = false, std::uint32_t rnd = 0) {
  const int E = exp + (63 - clz64(sig));  // floor(log2(value))
  if (E > f.emax) return f.maxcode;
  const int Ec = E < f.emin ? f.emin : E;
  const int shift = (Ec - f.mbits) - exp;  // bits of sig below the grid's quantum
  std::uint64_t n;
  if (shift <= 0) {
    n = sig << (-shift);
  } else {
    const std::uint64_t kept = shift >= 64 ? 0 : (sig >> shift);
    const std::uint64_t rem = shift >= 64 ? sig : (sig & ((std::uint64_t(1) << shift) - 1));
    n = kept;
    if (!stochastic) {
      if (shift <= 64) {
        const std::uint64_t half = std::uint64_t(1) << (shift - 1);
        if (rem > half || (rem == half && (kept & 1))) ++n;
      }
    } else {
      std::uint64_t t;
      if (shift <= 32) {
        t = rem << (32 - shift);
      } else {
        t = (shift - 32) >= 64 ? 0 : (rem >> (shift - 32));
      }
      if (std::uint64_t(rnd) < t) ++n;
    }
  }
  const std::uint64_t code = (std::uint64_t(Ec - f.emin) << f.mbits) + n;
  return code > f.maxcode ? f.maxcode : static_cast<std::uint32_t>(code);
}

// round_magnitude for sig < 2^24 (an fp32 significand) in 32-bit arithmetic, for the kernels' hot
// loops; equal to round_magnitude on that domain (codec_test checks it).
MXQ_HD_HOT std::uint32_t round_magnitude32(std::uint32_t sig, int exp, const FloatSpec& f, bool stochastic,
                                           std::uint32_t rnd) {
  const int E = exp + (31 - clz32(sig));
  if (E > f.emax) return f.maxcode;
  const int Ec = E < f.emin ? f.emin : E;
  const int shift = (Ec - f.mbits) - exp;
  std::uint32_t n;
  if (shift <= 0) {
    n = sig << (-shift);  // exact: the value is below 2^(emax+1), so n < 2^(mbits+2)
  } else if (shift < 32) {
    const std::uint32_t rem = sig & ((1u << shift) - 1u);
    n = sig >> shift;
    if (stochastic)
      n += rnd < (rem << (32 - shift)) ? 1u : 0u;
    else
      n += (rem > (1u << (shift - 1)) || (rem == (1u << (shift - 1)) && (n & 1u))) ? 1u : 0u;
  } else {  // everything is below the quantum; RNE gives 0 since sig < 2^24 <= half
    n = (stochastic && shift - 32 < 32 && rnd < (sig >> (shift - 32))) ? 1u : 0u;
  }
  const std::uint32_t code = (std::uint32_t(Ec - f.emin) << f.mbits) + n;
  return code > f.maxcode ? f.maxcode : code;
}

// Split a finite fp32 bit pattern into (sign, sig, exp) with |value| = sig * 2^exp. sig == 0 for zero.
struct Split {
  std::uint32_t sign;
  std::uint32_t sig;
  int exp;
};
MXQ_HD Split split_f32(std::uint32_t u) {
  const std::uint32_t e = (u >> 23) & 0xFF;
  const std::uint32_t m = u & 0x7FFFFF;
  if (e == 0) return {u >> 31, m, -149};
  return {u >> 31, m | 0x800000u, int(e) - 150};
}

// Apply the sign to a magnitude code.
MXQ_HD std::uint32_t signed_code(std::uint32_t mag, std::uint32_t sign, const FloatSpec& f) {
  if (f.twos_complement) return sign ? ((0u - mag) & ((1u << f.bits) - 1u)) : mag;
  return mag | (sign << (f.bits - 1));
}

// Element encode of x * 2^-scale_exp for non-NaN x (exact scaling: the exponent is adjusted, nothing
// is rounded before the one rounding onto the element grid). Signed zero is kept (except INT8); an
// infinity saturates (it reaches here only as qutlass_absmax's 3 * x overflowing fp32).
MXQ_HD std::uint32_t encode_scaled(std::uint32_t xbits, int scale_exp, const FloatSpec& f,
                                   bool stochastic = false, std::uint32_t rnd = 0) {
  if ((xbits & 0x7FFFFFFFu) == 0x7F800000u) return signed_code(f.maxcode, xbits >> 31, f);
  const Split s = split_f32(xbits);
  const std::uint32_t mag = s.sig ? round_magnitude(s.sig, s.exp - scale_exp, f, stochastic, rnd) : 0u;
  return signed_code(mag, s.sign, f);
}

// Encode an fp32 value directly (scale 1). Infinities saturate; NaN becomes the format's NaN (E4M3:
// S.1111.111, E5M2: S.11111.10) or 0 for formats without one. Block operations never pass NaN here.
MXQ_HD std::uint32_t encode_f32(std::uint32_t xbits, const FloatSpec& f, bool stochastic = false,
                                std::uint32_t rnd = 0) {
  if ((xbits & 0x7FFFFFFFu) > 0x7F800000u) {
    const std::uint32_t sign = xbits >> 31;
    if (f.bits == 8 && !f.twos_complement && f.emin == -6) return (sign << 7) | 0x7F;
    if (f.bits == 8 && !f.twos_complement && f.emin == -14) return (sign << 7) | 0x7E;
    if (f.bits == 16 && f.mbits == 7) return 0x7FC0;
    if (f.bits == 16) return 0x7E00;
    if (f.bits == 32) return 0x7FC00000u;
    return 0;
  }
  if ((xbits & 0x7FFFFFFFu) == 0x7F800000u) return signed_code(f.maxcode, xbits >> 31, f);
  return encode_scaled(xbits, 0, f, stochastic, rnd);
}

// Decode a code to (sign, n, p) with |value| = n * 2^p. Returns false for NaN/Inf codes.
MXQ_HD bool decode_parts(std::uint32_t code, const FloatSpec& f, std::uint32_t& sign, std::uint32_t& n,
                         int& p) {
  if (f.twos_complement) {
    const int v = static_cast<int>(static_cast<std::int8_t>(static_cast<std::uint8_t>(code)));
    sign = v < 0;
    n = static_cast<std::uint32_t>(v < 0 ? -v : v);
    p = -f.mbits;
    return true;
  }
  sign = (code >> (f.bits - 1)) & 1u;
  const std::uint32_t mag = code & ((1u << (f.bits - 1)) - 1u);
  if (mag > f.maxcode) return false;  // E4M3 NaN, E5M2 Inf/NaN, fp Inf/NaN
  const std::uint32_t ef = mag >> f.mbits;
  const std::uint32_t mant = mag & ((1u << f.mbits) - 1u);
  if (ef == 0) {
    n = mant;
    p = f.emin - f.mbits;
  } else {
    n = mant | (1u << f.mbits);
    p = f.emin + int(ef) - 1 - f.mbits;
  }
  return true;
}

// Exact fp32 value of an element code (all element values are exact in fp32). NaN for NaN/Inf codes
// of E4M3/E5M2 (E5M2 infinities decode to infinity).
MXQ_HD float decode_f32(std::uint32_t code, const FloatSpec& f) {
  std::uint32_t sign = 0, n = 0;
  int p = 0;
  if (!decode_parts(code, f, sign, n, p)) {
    const std::uint32_t mag = code & ((1u << (f.bits - 1)) - 1u);
    const bool inf = f.mbits == 2 && f.bits == 8 && (mag & 3u) == 0;  // E5M2 S.11111.00
    return u2f((sign << 31) | (inf ? 0x7F800000u : 0x7FC00000u));
  }
  if (n == 0) return u2f(sign << 31);
  const std::uint32_t bits = (sign << 31) | round_magnitude(n, p, spec_f32());  // exact: n has few bits
  return u2f(bits);
}

// ---- input and output dtypes -------------------------------------------------------------------------------
// bf16/fp16 -> fp32 are exact and public (mxq/convert.hpp: host code only; the kernels read their
// inputs with instructions of their own, cuda/common/vector_io.cuh).
using ::mxq::bf16_to_f32;
using ::mxq::f16_to_f32;

// Round a finite fp32 value to bf16 / fp16 with RNE, saturating to the largest finite value; NaN stays
// NaN; infinities stay infinities (a finite input never becomes Inf).
MXQ_HD std::uint16_t f32_to_bf16_sat(std::uint32_t u) {
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) return (u & 0x7FFFFFFFu) > 0x7F800000u ? std::uint16_t(0x7FC0) : std::uint16_t(u >> 16);
  const Split s = split_f32(u);
  const std::uint32_t mag = s.sig ? round_magnitude(s.sig, s.exp, spec_bf16()) : 0u;
  return static_cast<std::uint16_t>(mag | (s.sign << 15));
}
MXQ_HD std::uint16_t f32_to_f16_sat(std::uint32_t u) {
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u)
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? std::uint16_t(0x7E00) : std::uint16_t(((u >> 16) & 0x8000u) | 0x7C00u);
  const Split s = split_f32(u);
  const std::uint32_t mag = s.sig ? round_magnitude(s.sig, s.exp, spec_f16()) : 0u;
  return static_cast<std::uint16_t>(mag | (s.sign << 15));
}

// Round the exact value (-1)^sign * n * 2^p (n < 2^32) to an output dtype, saturating.
MXQ_HD std::uint32_t round_exact_to(std::uint32_t sign, std::uint32_t n, int p, const FloatSpec& out) {
  const std::uint32_t mag = n ? round_magnitude(n, p, out) : 0u;
  return mag | (sign << (out.bits - 1));
}

// ---- E8M0 scale exponents ---------------------------------------------------------------------------------
// floor(log2(a)) for finite a > 0 (fp32 bits, subnormals included).
MXQ_HD_HOT int floor_log2_bits(std::uint32_t a) {
  const std::uint32_t e = (a >> 23) & 0xFF;
  if (e != 0) return int(e) - 127;
  return (63 - clz64(a & 0x7FFFFF)) - 149;
}
// The 24-bit normalized significand (1.m as an integer in [2^23, 2^24)) of finite a > 0.
MXQ_HD_HOT std::uint32_t norm_sig24(std::uint32_t a) {
  const std::uint32_t e = (a >> 23) & 0xFF;
  const std::uint32_t m = a & 0x7FFFFF;
  if (e != 0) return m | 0x800000u;
  return static_cast<std::uint32_t>(std::uint64_t(m) << (23 - (63 - clz64(m))));
}

constexpr int kE8M0Bias = 127;
constexpr std::uint8_t kE8M0NaN = 0xFF;
constexpr std::uint8_t kE4M3NaN = 0x7F;

MXQ_HD_HOT int clamp_scale_exp(int e) { return e < -127 ? -127 : (e > 127 ? 127 : e); }

// Sum of g values in the fixed pairwise order S(v, g) = S(v, g/2) + S(v + g/2, g/2): the order of a
// shuffle reduction where each lane holds a contiguous chunk. g is a power of two, g <= 256.
// pairwise_reduce: the same levels in place on a[0..n) (each a[i] = a[2i] + a[2i+1]), n = G when G is a
// compile-time size (the host's fast paths: constant trip counts, so that each level vectorises), else g.
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__clang__)
#define MXQ_UNROLL_LEVELS _Pragma("GCC unroll 8")
#else
#define MXQ_UNROLL_LEVELS
#endif
template <int G = 0>
MXQ_HD float pairwise_reduce(float* a, int g = G) {
  MXQ_UNROLL_LEVELS
  for (int w = G ? G : g; w > 1; w >>= 1)
    for (int i = 0; i < w / 2; ++i) a[i] = add_rn(a[2 * i], a[2 * i + 1]);
  return a[0];
}
MXQ_HD float pairwise_sum(const float* v, int g) {
  float buf[256];
  for (int i = 0; i < g; ++i) buf[i] = v[i];
  return pairwise_reduce(buf, g);
}

// The quest rule's argument t = sigma * 2.92247856 / 6 + 1e-8 for one block (zeros padded in),
// sigma the population standard deviation: mean = S(x) / g, var = S((x - mean)^2) / g, all fp32,
// each operation rounded on its own, sums in pairwise_sum's order. G: a compile-time g (0: the runtime g;
// g is read only then).
template <int G = 0>
MXQ_HD float quest_arg(const float* x, int g = G) {
  constexpr int N = G ? G : 256;
  const int n = G ? G : g;
  float a[N], d2[N];
  for (int i = 0; i < n; ++i) a[i] = x[i];
  const float mean = div_rn(pairwise_reduce<G>(a, n), float(n));
  for (int i = 0; i < n; ++i) {
    const float d = sub_rn(x[i], mean);
    d2[i] = mul_rn(d, d);
  }
  const float var = div_rn(pairwise_reduce<G>(d2, n), float(n));
  const float sigma = sqrt_rn(var);
  return add_rn(div_rn(mul_rn(sigma, 2.92247856f), 6.0f), 1e-8f);
}
#undef MXQ_UNROLL_LEVELS

// E8M0 scale exponent for a finite, non-zero block (amax > 0). `quest` is quest_arg of the block
// (only read by ScaleRule::quest). The result is clamped to [-127, 127].
MXQ_HD_HOT int mx_scale_exp(ScaleRule rule, float amax, float quest, const FloatSpec& f) {
  const std::uint32_t a = f2u(amax);
  const int fl = floor_log2_bits(a);
  int e = 0;
  switch (rule) {
    case ScaleRule::floor: e = fl - f.emax; break;
    case ScaleRule::ceil: e = fl + (norm_sig24(a) != 0x800000u ? 1 : 0) - f.emax; break;
    case ScaleRule::even: {
      // Round amax's significand to mbits (RNE); a carry out of the binade bumps the exponent.
      // NOTE: sig + (half - 1 + lsb) carries past bit 23 exactly when RNE rounds up to 2^(mbits+1);
      // written without branches because the fast paths run it once per block.
      const std::uint32_t sig = norm_sig24(a);
      const int drop = 23 - f.mbits;
      const std::uint32_t inc = (1u << (drop - 1)) - 1u + ((sig >> drop) & 1u);
      e = fl + int((sig + inc) >> 24) - f.emax;
      break;
    }
    case ScaleRule::even_fp4:
      // RNE of amax's significand to E2M1's one mantissa bit carries out of the binade exactly when
      // the significand is >= 1.75 (1.75 itself is a tie that goes to the even 2.0).
      e = fl + (norm_sig24(a) >= 0xE00000u ? 1 : 0) - f.emax;
      break;
    case ScaleRule::rceil: {
      // ceil(log2(amax / max)) exactly: compare the normalized significands
      const std::uint32_t mx = max_value_bits(f);
      e = fl - floor_log2_bits(mx) + (norm_sig24(a) > norm_sig24(mx) ? 1 : 0);
      break;
    }
    case ScaleRule::quest: e = floor_log2_bits(f2u(quest)); break;
    case ScaleRule::qutlass_absmax: e = floor_log2_bits(f2u(add_rn(amax, 1e-8f))); break;
    case ScaleRule::nvfp4:
    case ScaleRule::nvfp4_e5m3: break;  // not E8M0 rules
  }
  return clamp_scale_exp(e);
}

// ---- NVFP4 ---------------------------------------------------------------------------------------------------
// Encode scale S from the tensor amax (docs/numerics.md, "NVFP4").
MXQ_HD float nvfp4_encode_scale(float amax_tensor) {
  const std::uint32_t a = f2u(amax_tensor) & 0x7FFFFFFFu;
  if (a == 0 || !is_finite_bits(a)) return 1.0f;
  const float s = div_rn(448.0f * 6.0f, u2f(a));
  return is_finite_bits(f2u(s)) ? s : u2f(0x7F7FFFFFu);
}
// NVFP4 under rule quest (QuTLASS's fusedQuantizeNv method "quest"): the E4M3 block-scale code of the
// block's quest statistic t = quest_arg (RN, saturating at 448: t >= 1e-8 > 0, +Inf where the fp32
// statistics overflow); the tensor scale is 1, so the elements' multiplier is RN(1/s). A NaN t (the
// fp32 sum overflowing to +Inf and -Inf in a finite block) gives kE4M3NaN whatever its sign bit, and
// every backend then treats the block as a non-finite one (zero codes, mask 0, NaN on dequantize).
MXQ_HD std::uint32_t nvfp4_quest_scale_code(float t) { return t != t ? 0x7Fu : encode_f32(f2u(t), spec_e4m3()); }
// E4M3 block-scale code for a finite block: E4M3_RN_satfinite((amax_block * S) / 6).
MXQ_HD std::uint32_t nvfp4_block_scale_code(float amax_block, float S) {
  const float t = div_rn(mul_rn(amax_block, S), 6.0f);
  return encode_f32(f2u(t), spec_e4m3());  // t >= 0; an overflow to +Inf saturates to 448
}
// Element multiplier m = S / float(s), 0 when s is zero.
MXQ_HD float nvfp4_multiplier(std::uint32_t scale_code, float S) {
  const float s = decode_f32(scale_code, spec_e4m3());
  return s == 0.0f ? 0.0f : div_rn(S, s);
}
// Element code E2M1_RNE_sat(x * m); a zero x keeps its sign (0 * Inf never reaches the rounding).
MXQ_HD std::uint32_t nvfp4_encode(std::uint32_t xbits, float m, bool stochastic = false, std::uint32_t rnd = 0) {
  if ((xbits & 0x7FFFFFFFu) == 0) return (xbits >> 31) << 3;
  return encode_f32(f2u(mul_rn(u2f(xbits), m)), spec_e2m1(), stochastic, rnd);
}
// Dequantized fp32 value (e2m1 * float(s)) / S.
MXQ_HD float nvfp4_decode(std::uint32_t code, std::uint32_t scale_code, float S) {
  if ((scale_code & 0x7F) == kE4M3NaN) return u2f(0x7FC00000u);
  return div_rn(mul_rn(decode_f32(code, spec_e2m1()), decode_f32(scale_code, spec_e4m3())), S);
}

// ---- NVFP4 with UE5M3 scales (nvfp4_e5m3; docs/numerics.md) -----------------------------------------------
// UE5M3: unsigned, 5 exponent bits (bias 15), 3 mantissa bits, subnormals m * 2^-17, no NaN or Inf (0xFF
// decodes to 122880). Described as a sign-magnitude spec whose sign (bit 8) is never set. Quantizers saturate
// at 0xFE (114688), the vllm-qdq-plugin's clamp; decode accepts every byte. Format::nvfp4_e5m3's backends
// all take these (the block operations: core/problem.hpp's nvfp4_e5m3_* helpers).
MXQ_HD constexpr FloatSpec spec_ue5m3() { return {9, 3, -14, 16, 0xFE, false}; }
MXQ_HD constexpr FloatSpec spec_ue5m3_decode() { return {9, 3, -14, 16, 0xFF, false}; }
MXQ_HD float ue5m3_decode(std::uint32_t code) { return decode_f32(code & 0xFFu, spec_ue5m3_decode()); }
// Block-scale code UE5M3_RNE_sat(fp32(amax / 6)). A NaN amax gives 0xFE as in the plugin (its bit-level
// rounding turns NaN into Inf before the clamp); +Inf saturates to 0xFE.
MXQ_HD std::uint32_t ue5m3_block_scale_code(float amax_block) {
  const float v = div_rn(amax_block, 6.0f);
  if (v != v) return spec_ue5m3().maxcode;
  return encode_f32(f2u(v), spec_ue5m3());
}
// Element code E2M1_RNE_sat(fp32(x / s)) (a division, as the plugin); a zero scale gives +0 for every x.
// x must not be NaN (the block operations treat a NaN block on their own).
MXQ_HD std::uint32_t nvfp4_e5m3_encode(std::uint32_t xbits, std::uint32_t scale_code) {
  const float s = ue5m3_decode(scale_code);
  if (s == 0.0f) return 0u;
  return encode_f32(f2u(div_rn(u2f(xbits), s)), spec_e2m1());
}
// Dequantized fp32 value e2m1 * float(s) (exact).
MXQ_HD float nvfp4_e5m3_decode(std::uint32_t code, std::uint32_t scale_code) {
  return mul_rn(decode_f32(code, spec_e2m1()), ue5m3_decode(scale_code));
}
// fp32 -> fp16, RNE with IEEE overflow: |v| >= 65520 (the midpoint above 65504) gives Inf, NaN the quiet NaN.
// nvfp4_e5m3's fp16 outputs take it (the plugin's cast, docs/numerics.md); mxq's other outputs saturate.
MXQ_HD std::uint16_t f32_to_f16_rn(std::uint32_t u) {
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u && a <= 0x7F800000u) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7C00u);
  return f32_to_f16_sat(u);
}

// ---- Philox4x32-10 (stochastic rounding) ---------------------------------------------------------------------
struct U32x4 {
  std::uint32_t v[4];
};
MXQ_HD U32x4 philox4x32_10(U32x4 c, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const std::uint64_t p0 = std::uint64_t(M0) * c.v[0];
    const std::uint64_t p1 = std::uint64_t(M1) * c.v[2];
    const std::uint32_t hi0 = std::uint32_t(p0 >> 32), lo0 = std::uint32_t(p0);
    const std::uint32_t hi1 = std::uint32_t(p1 >> 32), lo1 = std::uint32_t(p1);
    c = U32x4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += W0;
    k1 += W1;
  }
  return c;
}
// Philox4x32-10 of the 64-bit counter c keyed by the seed: the 128 random bits of counter c.
MXQ_HD U32x4 philox_block(std::uint64_t seed, std::uint64_t c) {
  return philox4x32_10(U32x4{{std::uint32_t(c), std::uint32_t(c >> 32), 0u, 0u}}, std::uint32_t(seed),
                       std::uint32_t(seed >> 32));
}

// log2 of the elements one Philox call serves with B random bits each: 128 / B = 2^(7 - log2 B).
MXQ_HD int sr_log2_per_call(int B) { return B == 8 ? 4 : B == 16 ? 3 : 2; }
// The comparison word of a B-bit random field r (B = 8, 16, 32): r as the word's B high bits, the
// 32 - B low bits set. With it "rnd < t" rounds up with probability floor(t / 2^(32-B)) / 2^B: the
// rounding fraction truncated to B bits (docs/numerics.md). B = 32 is r itself.
MXQ_HD std::uint32_t sr_word(std::uint32_t r, int B) {
  return B == 32 ? r : (r << (32 - B)) | ((1u << (32 - B)) - 1u);
}
// Word q (0..3) of a Philox output, by selects (a runtime index would put r in local memory on the GPU).
MXQ_HD std::uint32_t philox_word(const U32x4& r, std::uint32_t q) {
  return q == 0 ? r.v[0] : q == 1 ? r.v[1] : q == 2 ? r.v[2] : r.v[3];
}
// The comparison word of element k (0 <= k < 32 / B) of a word w holding 32 / B fields of B bits,
// least significant first.
MXQ_HD std::uint32_t sr_field_of_word(std::uint32_t w, int k, int B) {
  return B == 32 ? w : sr_word((w >> (k * B)) & ((1u << B) - 1u), B);
}

// The random comparison word for logical element j (= offset + linear index) with B random bits per
// element (QuantOptions::random_bits: 32, 16 or 8): field f = j % (128 / B) of Philox at counter
// j / (128 / B) keyed by the seed, i.e. bits [f B, f B + B) of its 128 output bits (word-major, least
// significant first). For 32 bits: word j % 4 of counter j / 4.
MXQ_HD std::uint32_t sr_bits(std::uint64_t seed, std::uint64_t j, int B = 32) {
  const int lp = sr_log2_per_call(B);
  const std::uint32_t f = std::uint32_t(j) & ((1u << lp) - 1u);
  const U32x4 r = philox_block(seed, j >> lp);
  const std::uint32_t bit = f * std::uint32_t(B);
  return sr_field_of_word(philox_word(r, bit >> 5), int(bit & 31) / B, B);
}

}  // namespace mxq::core
