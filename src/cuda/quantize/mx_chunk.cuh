#pragma once
// Quantize and QDQ of one chunk of an MX format (E8M0 block scale 2^e).
//
// Per element the same arithmetic as the CPU backends: the branch-free helpers of core/fastmath.hpp for
// round-to-nearest-even, the scalar codec (core/codec.hpp) for stochastic rounding and special cases.
#include "core/e2m1_pack.hpp"
#include "core/fastmath.hpp"
#include "cuda/common/params.cuh"
#include "cuda/common/reductions.cuh"
#include "cuda/quantize/choices.cuh"
#include "cuda/quantize/chunk_store.cuh"

namespace mxq::cuda {

// The FP8 (E4M3, E5M2) quantize of the MX fast path by cvt.rn.satfinite: the two codes of lo and hi,
// lo's in the low byte. Only where the conversion exists (sm_89+); elsewhere the read-off rounding.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHaveF8Cvt = true;
#else
constexpr bool kHaveF8Cvt = false;
#endif
template <ElemType ET, bool QDQ>
constexpr bool kF8Cvt = kHaveF8Cvt && !QDQ && (ET == ElemType::e4m3 || ET == ElemType::e5m2);
template <ElemType ET>
__device__ __forceinline__ u32 f8x2_satfinite(float lo, float hi) {
  unsigned short d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (ET == ElemType::e4m3) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// One C-element chunk xw (the input's own words) of an MX format: QDQ writes its outputs (of dtype ODT:
// the input's, or any dtype for a rotated fp32 chunk), quantize its codes, scale and clip-mask bits.
// Every lane of a warp calls it (group shuffles).
template <class Fmt, DType DT, int C, bool QDQ, class Ch, DType ODT = DT>
__device__ __forceinline__ void mx_chunk(const Params& p, const Coord& c, const u32 (&xw)[vec_words<DT, C>()]) {
  static_assert(Fmt::scale == ScaleKind::e8m0, "MX formats only");
  static_assert(ODT == DT || DT == DType::f32, "another output dtype only for fp32 chunks");
  constexpr ElemType ET = Fmt::elem;
  constexpr FloatSpec f = Fmt::spec;
  constexpr int kSignBit = ODT == DType::f32 ? 31 : 15;
  const bool sr = Ch::stochastic(p), quest = Ch::quest(p), absmax = Ch::absmax(p);
  // The elements as fp32 bits, unpacked where a path needs them: the bf16 path works on the words,
  // and keeping both forms live through the shuffles costs registers.
  u32 xb[C];
  auto unpack = [&] { unpack_words<DT, C, vec_words<DT, C>()>(xw, xb); };
  const u32 am = group_max(p, chunk_amax<DT, C>(xw, xb, unpack));
  const bool nonfinite = am >= 0x7F800000u;
  u32 rnd[C];
  if (sr) chunk_sr_words<C>(p, c, rnd);

  float questv = 0.0f;
  if (quest) {
    unpack();
    questv = group_quest_arg<C>(p, xb);
  }
  int e = -127;
  if (am != 0 && !nonfinite)
    e = quest    ? mx_scale_exp(ScaleRule::quest, u2f(am), questv, f)
        : absmax ? mx_scale_exp(ScaleRule::qutlass_absmax, u2f(am), 0.0f, f)
                 : amax_rule_exp<f.mbits>(p.arule, am);
  const std::uint8_t sb = nonfinite ? kE8M0NaN : static_cast<std::uint8_t>(e + kE8M0Bias);
  const float inv = pow2f(-e), scale = pow2f(e);
  // NOTE: as the CPU path, round in the unscaled domain where every grid value is a normal float
  // with at most 8 significant bits (MxFastRange): QDQ to bf16/fp32 is then a plain truncation, and a
  // code is read off the bits. Elsewhere (extreme scales, fp16 output) scale, round, scale back.
  const bool fast = MxFastRange<ET>::contains(e);
  constexpr bool kFastOk = QDQ ? ODT != DType::f16 : !f.twos_complement;
  const u32 lo = u32(f.emin + e + 127) << 23, hi = u32(f.emax + 1 + e + 127) << 23;
  constexpr u32 kC = rne_const_bits<f.mbits>();

  u32 pw[code_words<Fmt, C>()];  // quantize: the packed codes
  bool packed = false;           // the codes are already in pw (the bf16 pair path, e2m1_push)
  // bf16 input, round to nearest even, a scale of the fast range: two elements per instruction on the
  // input words (mx_qdq_bf16x2, mx_codes_bf16x2). Not for FP8 quantize where the conversion
  // instruction does it, nor for INT8 (no -0) and the QuTLASS rule (it scales x first).
  if constexpr (DT == DType::bf16 && !f.twos_complement && !kF8Cvt<ET, QDQ>) {
    if (!sr && !absmax && fast) {
      const MxPair k = mx_pair<ET>(e);
      u32 r[C / 2];
      auto run = [&](auto clamp_hi) {
        constexpr bool kHi = decltype(clamp_hi)::value;
#pragma unroll
        for (int j = 0; j < C / 2; ++j) r[j] = QDQ ? mx_qdq_bf16x2<ET, kHi>(xw[j], k) : mx_codes_bf16x2<ET, kHi>(xw[j], k);
      };
      if (quest) run(std::true_type{});
      else run(std::false_type{});
      if constexpr (QDQ) {
        if (c.active) store_packed<DT, C>(p, c.row, c.k0, c.full, r, nonfinite);  // no shuffles follow
        return;
      } else {
        // One code per 16-bit lane -> FP4: c0 | c1 << 4 in the low byte of r + (r >> 12), four such
        // bytes gathered per word; 8-bit codes: the lanes' low bytes.
        if constexpr (f.bits == 4) {
          if constexpr (C == 2) {
            pw[0] = r[0] + (r[0] >> 12);
          } else {
#pragma unroll
            for (int q = 0; q < C / 8; ++q) {
              u32 b[4];
#pragma unroll
              for (int j = 0; j < 4; ++j) b[j] = r[4 * q + j] + (r[4 * q + j] >> 12);
              pw[q] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
            }
          }
        } else {
          if constexpr (C == 2) {
            pw[0] = __byte_perm(r[0], 0u, 0x0020);
          } else {
#pragma unroll
            for (int q = 0; q < C / 4; ++q) pw[q] = __byte_perm(r[2 * q], r[2 * q + 1], 0x6420);
          }
        }
        packed = true;
      }
    }
  }

  u32 codes[C];  // element codes (quantize, and QDQ with the scalar codec)
  // MXFP4 quantize packs its codes into pw in each branch, so that only the packed words are live
  // after them (with e2m1_push below, codes and pw were both live: more registers); the other formats
  // pack once at the end (packing in the branches raised MXINT8's registers past a block per SM).
  constexpr bool kPackInBranch = ET == ElemType::e2m1;
  u32 out[C];    // QDQ output bits (hi16 form)
  u32 keep = 0;  // clip-mask bits, element i at bit i
  if (!packed) {  // (only the bf16 pair path has packed by here)
    unpack();
    if (absmax) {  // QuTLASS quantizes 3x (numerics.md)
#pragma unroll
      for (int i = 0; i < C; ++i) xb[i] = f2u(mul_rn(3.0f, u2f(xb[i])));
    }
  } else {
    if (!QDQ && p.mask) unpack();  // the clip mask compares the elements
  }
  if (packed) {
    // codes in pw
  } else if (sr) {
    if (kFastOk && !f.twos_complement && fast) {
      // The unscaled stochastic rounding (fastmath_test proves it equal to encode_scaled_sr there):
      // the dithered add for 16 or 8 random bits, the fixed-point fraction for 32.
      auto round_sr = [&](auto dither) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float r = decltype(dither)::value ? sr_round_dither<ET>(xb[i], e, rnd[i]) : sr_round_unscaled<ET>(xb[i], e, rnd[i]);
          if constexpr (QDQ) {
            out[i] = f2u(r) | (xb[i] & 0x80000000u);  // bf16: the high half, exact
          } else {
            // r is a grid value: r + Cc is exact, and its bits count r's quanta (as below).
            const u32 be = umax(f2u(r) & 0x7F800000u, lo), cb = be + kC;
            const u32 mag = umin(readoff_mag<f.mbits>(f2u(add_rn(r, u2f(cb))), be, cb, lo), f.maxcode);
            codes[i] = mag | ((xb[i] >> 31) << (f.bits - 1));
          }
        }
      };
      if (p.sr_bits <= 16) round_sr(std::true_type{});
      else round_sr(std::false_type{});
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        codes[i] = encode_scaled_sr<ET>(xb[i], e, rnd[i]);
        if (QDQ) out[i] = hi16<ODT>(mx_dequant_finite<ET, ODT>(codes[i], scale));
      }
    }
    if constexpr (!QDQ && kPackInBranch) pack_codes<Fmt, C>(codes, pw);
  } else {
    // MXFP4 quantize of a scale in the fast range: e2m1_push rounds and packs in one step per element
    // (fastmath_test: FastE2m1Pack.PushedCodesMatchTheCodec; it saturates past 6 2^e, so any rule
    // could take it). Static-choice kernels only: in the runtime-choice ones it raised the rotated
    // MXFP4 kernels' registers past two blocks per SM (128 -> 131).
    constexpr bool kE2m1Push = !QDQ && ET == ElemType::e2m1 && C % 8 == 0 && Ch::round == RoundChoice::rne;
    if (kE2m1Push && fast) {
      const E2m1Pack k = e2m1_pack_consts(e);
#pragma unroll
      for (int q = 0; q < C / 8; ++q) {
        u32 w = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) w = e2m1_push(w, xb[8 * q + i], k);
        pw[q] = w;
      }
      packed = true;
    } else if (kF8Cvt<ET, QDQ> && fast) {
      // FP8 codes by the hardware conversion (sm_89+): x * 2^-e is exact there (or far below the
      // smallest subnormal, where both round to a signed zero), and cvt.rn.satfinite rounds to
      // nearest even and saturates as the reference does. Two codes per conversion: codes[i] holds
      // the bytes of elements i and i + 1 and codes[i + 1] is 0, which the packing accepts.
#pragma unroll
      for (int i = 0; i < C; i += 2) {
        codes[i] = f8x2_satfinite<ET>(mul_rn(u2f(xb[i]), inv), mul_rn(u2f(xb[i + 1]), inv));
        codes[i + 1] = 0u;
      }
    } else if (kFastOk && fast) {
      const float maxv = mul_rn(u2f(max_value_bits(f)), scale);
      // NOTE: with the amax rules every |x| <= amax < 2^(emax + 1 + e), so the upper clamp of the
      // rounding binade never binds there; quest and the QuTLASS absmax rule can put x above it.
      auto round_all = [&](auto clamp_hi) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          u32 be = umax(xb[i] & 0x7F800000u, lo);  // exponent bits of the rounding binade
          if (decltype(clamp_hi)::value) be = umin(be, hi);
          const u32 cb = be + kC;
          const float Cc = u2f(cb);
          const float t = add_rn(fabs_op(u2f(xb[i])), Cc);  // Cc + n quanta: the grid point is t - Cc
          if constexpr (QDQ) {
            const float rm = fminf_nn(sub_rn(t, Cc), maxv);
            u32 sign = xb[i] & 0x80000000u;
            if (f.twos_complement) sign = rm != 0.0f ? sign : 0u;  // INT8 has no -0
            out[i] = f2u(rm) | sign;                               // bf16: the high half, exact; never fp16 here
          } else {
            // readoff_mag; past the largest value it saturates.
            const u32 mag = umin(readoff_mag<f.mbits>(f2u(t), be, cb, lo), f.maxcode);
            codes[i] = mag | ((xb[i] >> 31) << (f.bits - 1));
          }
        }
      };
      if (quest || absmax) round_all(std::true_type{});
      else round_all(std::false_type{});
    } else if constexpr (QDQ) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const float rm = rne_mag<ET>(u2f(xb[i]), inv);
        u32 sign = xb[i] >> 31;
        if (f.twos_complement) sign &= u32(rm != 0.0f);
        out[i] = hi16<ODT>(out_mag_bits<ODT>(mul_rn(rm, scale)) | (sign << kSignBit));
      }
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) codes[i] = code_of<ET>(rne_mag<ET>(u2f(xb[i]), inv), xb[i] >> 31);
    }
    if constexpr (!QDQ && kPackInBranch) {
      if (!packed) pack_codes<Fmt, C>(codes, pw);
    }
  }

  if constexpr (QDQ) {
    if (c.active) store_chunk<ODT, C>(p, c.row, c.k0, c.full, out, nonfinite);
  } else {
    if (p.mask) {  // the clip mask is optional: no compares when it is not wanted
      const float limit = mul_rn(u2f(max_value_bits(f)), scale);  // exact, or +Inf past FLT_MAX
#pragma unroll
      for (int i = 0; i < C; ++i) keep |= u32(!nonfinite && fabs_bits(u2f(xb[i])) < limit) << i;
    }
    if constexpr (!kPackInBranch) {  // MXFP4 packed in every branch above
      if (!packed) pack_codes<Fmt, C>(codes, pw);
    }
    store_quantized<Fmt, C>(p, c, nonfinite, sb, pw, keep);
  }
}

}  // namespace mxq::cuda
