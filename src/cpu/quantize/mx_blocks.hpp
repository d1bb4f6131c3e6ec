#pragma once
// Quantize and QDQ of MX blocks (E8M0 block scale 2^e) on the fast CPU path: the counterpart of
// src/cuda/quantize/mx_chunk.cuh. A function that serves both operations takes QDQ as a template
// parameter, as mx_chunk does: everything up to the rounding is shared, and only the end differs (QDQ
// stores the dequantized outputs, quantize the codes and scale bytes).
#include "core/format_traits.hpp"
#include "cpu/common/elements.hpp"
#include "cpu/common/reductions.hpp"
#include "cpu/common/sr_words.hpp"
#include "cpu/common/vector_io.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// ---- staged blocks (fp32 values in a buffer) -----------------------------------------------------------
// Element codes of one finite MX block (scale exponent e in [-127, 127]) from its staged fp32 values
// (after the QuTLASS rule's 3x): encode_scaled's result, rounded to nearest even or stochastically
// with the comparison words rnd. In MxFastRange the rounding is done in the unscaled domain and the
// code read off the rounding's bits (readoff_mag, as the CUDA kernels do; the binade clamped above at
// emax + 1 + e so that quest's and the QuTLASS rule's elements past the scaled maximum saturate);
// elsewhere by rne_mag / code_of, or encode_scaled_sr.
template <ElemType ET, int G>
MXQ_INLINE void mx_block_codes(int g_rt, const float* xf, int e, bool sr, const std::uint32_t* rnd,
                               std::uint32_t* codes) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const int g = G ? G : g_rt;
  if (MxFastRange<ET>::contains(e)) {
    const MxBinades bn = mx_binades<ET>(e);
    if (!sr) {
      for (int i = 0; i < g; ++i) {
        const std::uint32_t xb = f2u(xf[i]);
        codes[i] = mx_code_rne_fast<ET>(xb & 0x7FFFFFFFu, xb >> 31, bn);
      }
      return;
    }
    if constexpr (!f.twos_complement) {
      for (int i = 0; i < g; ++i) {  // the integer form (fastmath_test)
        const std::uint32_t xb = f2u(xf[i]);
        codes[i] = sign_code<ET>(sr_code_unscaled<ET>(xb, e, rnd[i]), xb >> 31);
      }
      return;
    }
  }
  if (!sr) {
    const float inv = pow2f(-e);
    for (int i = 0; i < g; ++i) codes[i] = code_of<ET>(rne_mag<ET>(xf[i], inv), f2u(xf[i]) >> 31);
  } else {
    for (int i = 0; i < g; ++i) codes[i] = encode_scaled_sr<ET>(f2u(xf[i]), e, rnd[i]);
  }
}

// ---- full blocks straight from bf16/fp32 storage -----------------------------------------------------------
// Where mx_block_direct writes: QDQ the outputs y; quantize the element codes, the scale byte sb and,
// where keep is given, the clip-mask bits (one word per element).
template <DType DT>
struct MxBlockOut {
  Storage<DT>* y = nullptr;
  std::uint32_t* codes = nullptr;
  std::uint8_t* sb = nullptr;
  std::uint32_t* keep = nullptr;
};

// One full block of G elements of an amax rule (floor, ceil, even, rceil) or quest, rounded to nearest
// even, straight from bf16/fp32 storage s (no staging; quest: its statistic given, or computed here):
// the arithmetic of the staged path on the same fp32 values. QDQ handles every scale; quantize returns
// false, writing nothing, where the scale lies outside MxFastRange (the caller stages the block).
template <ElemType ET, DType DT, int G, bool QDQ>
MXQ_INLINE bool mx_block_direct(ScaleRule rule, const Storage<DT>* s, const MxBlockOut<DT>& o, const float* quest = nullptr) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignShift = DT == DType::f32 ? 31 : 15;
  std::uint32_t am = 0;
  for (int i = 0; i < G; ++i) am = std::max(am, abs_bits<DT>(s[i]));
  if (am >= 0x7F800000u) {  // a NaN or Inf: NaN outputs; the NaN scale and zero codes
    if constexpr (QDQ) {
      for (int i = 0; i < G; ++i) o.y[i] = static_cast<Storage<DT>>(nan_bits(DT));
    } else {
      *o.sb = kE8M0NaN;
      for (int i = 0; i < G; ++i) o.codes[i] = 0;
      if (o.keep)
        for (int i = 0; i < G; ++i) o.keep[i] = 0;
    }
    return true;
  }
  const float qa = rule == ScaleRule::quest && am ? (quest ? *quest : quest_arg_direct<DT, G>(s)) : 0.0f;
  const int e = am ? mx_scale_exp(rule, u2f(am), qa, f) : -127;
  if constexpr (QDQ) {
    // NOTE: in the common range of e, round in the unscaled domain: C' = 1.5 * 2^(q + e + 23) is a
    // normal float whose ulp is the grid's quantum 2^(q+e), so (|x| + C') - C' is the dequantized
    // value itself, exactly; it has at most 8 significant bits and lies in bf16/fp32's normal range,
    // so the output conversion is a truncation. Outside that range the scaled path below is used.
    if (MxFastRange<ET>::contains(e)) {
      const std::uint32_t lo = std::uint32_t(f.emin + e + 127) << 23, hi = std::uint32_t(f.emax + 1 + e + 127) << 23;
      constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
      const float maxv = u2f(max_value_bits(f)) * pow2f(e);
      for (int i = 0; i < G; ++i) {
        const std::uint32_t xb = abs_bits<DT>(s[i]);
        const float C = u2f(std::min(std::max(xb & 0x7F800000u, lo), hi) + kC);
        const float rm = std::min((u2f(xb) + C) - C, maxv);
        std::uint32_t sign = std::uint32_t(s[i]) >> kSignShift;
        if constexpr (f.twos_complement) sign &= rm != 0.0f;  // INT8 has no -0
        if constexpr (DT == DType::f32)
          o.y[i] = f2u(rm) | (sign << 31);
        else
          o.y[i] = static_cast<Storage<DT>>((f2u(rm) >> 16) | (sign << 15));
      }
      return true;
    }
    const float inv = pow2f(-e), scale = pow2f(e);
    for (int i = 0; i < G; ++i) {
      const float xv = to_f32<DT>(s[i]);
      const float rm = rne_mag<ET>(xv, inv);
      std::uint32_t sign = f2u(xv) >> 31;
      if constexpr (f.twos_complement) sign &= rm != 0.0f;  // INT8 has no -0
      o.y[i] = static_cast<Storage<DT>>(out_mag_bits<DT>(rm * scale) | (sign << kSignShift));
    }
  } else {
    if (!MxFastRange<ET>::contains(e)) return false;
    *o.sb = static_cast<std::uint8_t>(e + kE8M0Bias);
    const MxBinades bn = mx_binades<ET>(e);
    for (int i = 0; i < G; ++i) o.codes[i] = mx_code_rne_fast<ET>(abs_bits<DT>(s[i]), std::uint32_t(s[i]) >> kSignShift, bn);
    if (o.keep) {  // the clip mask: |x| * 2^-e < the largest element value, as the staged path
      const float inv = pow2f(-e), maxv = u2f(max_value_bits(f));
      for (int i = 0; i < G; ++i) o.keep[i] = u2f(abs_bits<DT>(s[i])) * inv < maxv;
    }
  }
  return true;
}

// Quantize of eight full MX blocks of 32 (an amax rule, no clip mask) straight from bf16/fp32 storage: the
// arithmetic of mx_block_direct a step at a time across the eight blocks (the rule's exponent
// by amax_rule_exp, which fastmath_test holds equal to mx_scale_exp). Returns false, writing nothing,
// when a block is zero, not finite or scaled outside MxFastRange (the caller takes them one by one).
// SR: stochastic rounding with the 256 comparison words rnd (mx_block_codes' integer form,
// sr_code_unscaled; not INT8, whose two's-complement codes take the staged path).
template <ElemType ET, DType DT, bool QUEST = false, bool SR = false>
MXQ_INLINE bool mx_blocks8_direct(const core::AmaxRule& k, const Storage<DT>* s, std::uint8_t* d, std::uint8_t* sb,
                                  const float* quest = nullptr, const std::uint32_t* rnd = nullptr) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignShift = DT == DType::f32 ? 31 : 15;
  alignas(64) std::uint32_t xb[256], codes[256], am[8];
  int e[8];
  for (int i = 0; i < 256; ++i) xb[i] = abs_bits<DT>(s[i]);
  for (int j = 0; j < 8; ++j) {
    std::uint32_t a = 0;
    for (int i = 0; i < 32; ++i) a = std::max(a, xb[32 * j + i]);
    am[j] = a;
  }
  bool ok = true;
  for (int j = 0; j < 8; ++j) {
    ok &= am[j] != 0 && am[j] < 0x7F800000u;
    if constexpr (QUEST)  // its statistics given
      e[j] = mx_scale_exp(ScaleRule::quest, u2f(am[j] | std::uint32_t(am[j] == 0)), quest[j], f);
    else
      e[j] = core::amax_rule_exp<f.mbits>(k, am[j] | std::uint32_t(am[j] == 0));  // (a zero block is refused above)
    ok &= MxFastRange<ET>::contains(e[j]);
  }
  if (!ok) return false;
  for (int j = 0; j < 8; ++j) {
    if constexpr (SR) {
      static_assert(!f.twos_complement, "INT8's stochastic rounding takes the staged path");
      for (int i = 0; i < 32; ++i)
        codes[32 * j + i] =
            sign_code<ET>(sr_code_unscaled<ET>(xb[32 * j + i], e[j], rnd[32 * j + i]), std::uint32_t(s[32 * j + i]) >> kSignShift);
    } else {
      const MxBinades bn = mx_binades<ET>(e[j]);
      for (int i = 0; i < 32; ++i)
        codes[32 * j + i] = mx_code_rne_fast<ET>(xb[32 * j + i], std::uint32_t(s[32 * j + i]) >> kSignShift, bn);
    }
    sb[j] = static_cast<std::uint8_t>(e[j] + kE8M0Bias);
  }
  if constexpr (f.bits == 4) {
    alignas(16) std::uint8_t pk[128];
    for (int i = 0; i < 128; ++i) pk[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xFu) | ((codes[2 * i + 1] & 0xFu) << 4));
    std::memcpy(d, pk, 128);
  } else {
    alignas(16) std::uint8_t c8[256];
    for (int i = 0; i < 256; ++i) c8[i] = static_cast<std::uint8_t>(codes[i]);
    std::memcpy(d, c8, 256);
  }
  return true;
}

// mx_blocks8_direct's instance for quest's statistics (quest non-null) and stochastic rounding's words
// (rnd non-null; never for INT8).
template <ElemType ET, DType DT>
MXQ_INLINE bool mx_blocks8_any(const core::AmaxRule& k, const Storage<DT>* s, std::uint8_t* d, std::uint8_t* sb,
                               const float* quest, const std::uint32_t* rnd) {
  if constexpr (!Elem<ET>::spec.twos_complement) {
    if (rnd)
      return quest ? mx_blocks8_direct<ET, DT, true, true>(k, s, d, sb, quest, rnd)
                   : mx_blocks8_direct<ET, DT, false, true>(k, s, d, sb, nullptr, rnd);
  }
  return quest ? mx_blocks8_direct<ET, DT, true>(k, s, d, sb, quest) : mx_blocks8_direct<ET, DT>(k, s, d, sb);
}

#if defined(MXQ_CPU_AVX2)
// ---- stochastic rounding with AVX-512F ------------------------------------------------------------------
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// One full MX block of 32 (bf16/fp32) for the AVX-512F stochastic-rounding runs (quantize and QDQ):
// its elements' fp32 bits xb and magnitudes a, and its scale exponent e, the rule's of the block amax
// (the staged path's mx_scale_exp). False where the block is zero, not finite or scaled outside
// MxFastRange, which those runs leave to the staged path.
template <ElemType ET, DType DT>
MXQ_INLINE __attribute__((target("avx512f"))) bool mx_sr_block_avx512(ScaleRule rule, const Storage<DT>* s, __m512i (&xb)[2],
                                                                      __m512i (&a)[2], int& e) {
  for (int h = 0; h < 2; ++h) {
    xb[h] = load16_bits_avx512<DT>(s + 16 * h);
    a[h] = _mm512_and_si512(xb[h], _mm512_set1_epi32(0x7FFFFFFF));
  }
  const std::uint32_t am = _mm512_reduce_max_epu32(_mm512_max_epu32(a[0], a[1]));
  if (am == 0 || am >= 0x7F800000u) return false;
  e = mx_scale_exp(rule, u2f(am), 0.0f, Elem<ET>::spec);
  return MxFastRange<ET>::contains(e);
}

// Stochastic quantize or QDQ of up to nb consecutive full MX blocks of 32 (an amax rule, not INT8,
// bf16/fp32) with AVX-512F, straight from the source: the staged path's arithmetic (the rule's exponent
// from the block amax, sr_code_unscaled via sr_mags16_avx512; QDQ: the code's value, sr_code_value_bits,
// and the sign) sixteen lanes at a time, the words of the row's elements k0 + 32 j from srw. QDQ: the
// outputs to d; quantize: the codes to d (packed as store_codes), the scale bytes to sb. Returns the
// blocks done: it stops, writing nothing of it, at a block that is zero, not finite or scaled outside
// MxFastRange (the caller takes that one and the rest by the other paths).
template <ElemType ET, DType DT, bool QDQ>
__attribute__((target("avx512f"))) std::int64_t mx_sr_blocks_avx512(ScaleRule rule, const Storage<DT>* s, std::int64_t nb, SrWindow& srw,
                                                                  std::int64_t k0, BlockDst<DT, QDQ>* d, std::uint8_t* sb) {
  constexpr FloatSpec f = Elem<ET>::spec;
  static_assert(!f.twos_complement);
  constexpr int kStep = QDQ ? 32 : (f.bits == 4 ? 16 : 32);  // d's elements per block: outputs, or code bytes
  for (std::int64_t j = 0; j < nb; ++j, s += 32, d += kStep) {
    prefetch_ahead(s, 32);
    __m512i xb[2], a[2];
    int e;
    if (!mx_sr_block_avx512<ET, DT>(rule, s, xb, a, e)) return j;
    const std::uint32_t* w = srw.at(k0 + 32 * j, 32);
    const __m512i vlo = _mm512_set1_epi32(f.emin + e + 127);
    // QDQ: sr_code_value_bits, a normal code's fields placed in binade lo - 1 + (code >> mbits); a
    // subnormal code c as (2^(lo-1) (1 + c 2^-mbits) - 2^(lo-1)) 2
    [[maybe_unused]] const __m512i vlo1 = _mm512_set1_epi32(int(std::uint32_t(f.emin + e + 126) << 23));
    for (int h = 0; h < 2; ++h) {
      const __m512i mag = sr_mags16_avx512<ET>(a[h], vlo, _mm512_loadu_si512(w + 16 * h));
      if constexpr (QDQ) {
        const __m512i v = _mm512_add_epi32(vlo1, _mm512_slli_epi32(mag, 23 - f.mbits));
        const __m512 sub = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(v), _mm512_castsi512_ps(vlo1)), _mm512_set1_ps(2.0f));
        const __m512i val = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << f.mbits)), v, _mm512_castps_si512(sub));
        if constexpr (DT == DType::f32) {
          _mm512_storeu_si512(d + 16 * h, _mm512_or_si512(val, _mm512_and_si512(xb[h], _mm512_set1_epi32(int(0x80000000u)))));
        } else {  // the value has at most 4 significant bits: bf16 is its high half
          const __m512i o = _mm512_or_si512(_mm512_srli_epi32(val, 16), _mm512_and_si512(_mm512_srli_epi32(xb[h], 16), _mm512_set1_epi32(0x8000)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16 * h), _mm512_cvtepi32_epi16(o));
        }
      } else {
        const __m512i code = _mm512_or_si512(mag, _mm512_slli_epi32(_mm512_srli_epi32(xb[h], 31), f.bits - 1));
        if constexpr (f.bits == 4)  // element 2i in the low nibble: each 64-bit lane's two codes to one byte
          _mm_storel_epi64(reinterpret_cast<__m128i*>(d + 8 * h), _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
        else
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * h), _mm512_cvtepi32_epi8(code));
      }
    }
    if constexpr (!QDQ) sb[j] = static_cast<std::uint8_t>(e + kE8M0Bias);
  }
  return nb;
}
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace mxq::cpu
