#pragma once
// Quantize and QDQ of NVFP4 chunks (eight blocks of 16 E2M1 elements, 128 elements, E4M3 block scales
// under the tensor encode scale S) on the fast CPU path: the counterpart of
// src/cuda/quantize/nvfp4_chunk.cuh. A function that serves both operations takes QDQ as a template
// parameter: the scale and element codes are shared, and only the end differs (QDQ stores the
// dequantized outputs, quantize the packed codes and scale bytes).
#include "cpu/common/elements.hpp"
#include "cpu/common/fp4_lookup.hpp"
#include "cpu/common/nvfp4_scale.hpp"
#include "cpu/common/reductions.hpp"
#include "cpu/common/vector_io.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// Eight full NVFP4 blocks (128 elements, bf16/fp32, straight from the source), the portable form:
// the staged path's arithmetic (amax, nvfp4_block_scale_code, the table's multiplier, the element code
// by nvfp4_code_rne_bf; QDQ: nvfp4_decode) a step at a time across the eight blocks, so that each step
// vectorises (the scale's division among them). SR: stochastic rounding with the 128 comparison words
// rnd (the staged path's nvfp4_encode_sr in the integer form). QDQ: the 128 outputs to d, NaN for a
// block not finite. Quantize: the 64 packed code bytes to d (zero codes for a block not finite) and
// the eight scale bytes to sb (the NaN code there).
template <DType DT, bool QDQ, bool SR = false>
MXQ_INLINE void nvfp4_blocks8(const Storage<DT>* s, float S, const NvTables& nv, BlockDst<DT, QDQ>* d, std::uint8_t* sb,
                              const std::uint32_t* rnd = nullptr) {
  alignas(64) std::uint32_t codes[128], sc[8], ok[8];
  alignas(64) float m[8], sv[8];
  nvfp4_scale_codes8<DT>(s, S, sc, ok);
  for (int j = 0; j < 8; ++j) {
    m[j] = nv.m[sc[j]];
    if constexpr (QDQ) sv[j] = nv.sval[sc[j]];
    else sb[j] = static_cast<std::uint8_t>(bsel(ok[j] != 0, sc[j], kE4M3NaN));
  }
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t raw = std::uint32_t(s[16 * j + i]), xb = DT == DType::f32 ? raw : raw << 16;
      const std::uint32_t code =
          SR ? sr_code_unscaled<ElemType::e2m1>(nvfp4_product_bits_bf(xb, m[j]), 0, rnd[16 * j + i]) | ((xb >> 31) << 3)
             : nvfp4_code_rne_bf(xb, m[j]);
      if constexpr (QDQ) {
        const float v = div_rn(mul_rn(e2m1_value_bf(code & 7u), sv[j]), S);
        const std::uint32_t o = to_dtype_bits_nonnan_bf<DT>(u2f(f2u(v) | ((code >> 3) << 31)));
        d[16 * j + i] = static_cast<Storage<DT>>(bsel(ok[j] != 0, o, nan_bits(DT)));
      } else {
        codes[16 * j + i] = code & ok[j];
      }
    }
  if constexpr (!QDQ) {
    alignas(16) std::uint8_t pk[64];
    for (int i = 0; i < 64; ++i) pk[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xFu) | ((codes[2 * i + 1] & 0xFu) << 4));
    std::memcpy(d, pk, 64);
  }
}

#if defined(MXQ_CPU_AVX2)
// ---- chunks in AVX2 / AVX-512F registers ------------------------------------------------------------------
// Eight full NVFP4 blocks (128 elements of bf16/fp32 storage), RNE, in AVX2 registers: the arithmetic
// of nvfp4_scale_codes8 and nvfp4_code_rne_bf (the same IEEE operations, one lane per block or per
// element, so the same bits). Out: sc, the eight scale codes (0 where a block is not finite); ok, all
// ones where the block is finite; codes[2 j], codes[2 j + 1], the sign-magnitude codes of block j's
// elements 0..7 and 8..15 (garbage where the block is not finite: callers mask with ok).
// QUEST: the rule quest's scale codes instead (nvfp4_quest_scale_code_fast of quest_arg, S = 1 in the
// tables); a block whose statistic is NaN is not finite either.
struct Nvfp4Chunk {
  __m256i sc, ok, codes[16];
  alignas(32) float m8[8];  // the blocks' multipliers
};
// The element codes of nvfp4_chunk_codes_avx2 (nvfp4_code_rne_bf(x, m): the readoff of min(|x| m, 6),
// the sign at bit 3), block j's multiplier c.m8[j]. ZERO: some multiplier is infinite (S / s overflows:
// a tensor scale near FLT_MAX), where a zero element must stay 0 (nvfp4_product: 0 * Inf would be NaN,
// then 6); with finite multipliers the product of a zero is 0 anyway, and the test is left out.
template <DType DT, bool ZERO>
__attribute__((target("avx2"))) inline void nvfp4_elements_avx2(const Storage<DT>* s, Nvfp4Chunk& c) {
  constexpr std::uint32_t lo = 127u << 23, kC = rne_const_bits<1>();
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF), vlo = _mm256_set1_epi32(int(lo)), vkC = _mm256_set1_epi32(int(kC)),
                vexp = _mm256_set1_epi32(0x7F800000), vsub = _mm256_set1_epi32(int(lo >> 22)), eight = _mm256_set1_epi32(8);
  const __m256 six = _mm256_set1_ps(6.0f);
  for (int j = 0; j < 8; ++j) {
    const __m256 m = _mm256_set1_ps(c.m8[j]);
    for (int h = 0; h < 2; ++h) {
      const __m256i xb = load8_bits_avx2<DT>(s + 16 * j + 8 * h);
      const __m256i xm = _mm256_and_si256(xb, magmask);
      __m256 prod = _mm256_mul_ps(_mm256_castsi256_ps(xm), m);
      if constexpr (ZERO) prod = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(xm, _mm256_setzero_si256())), prod);
      const __m256 a = _mm256_min_ps(prod, six);
      const __m256i be = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), vexp), vlo);
      const __m256i cb = _mm256_add_epi32(be, vkC);
      const __m256i t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(cb)));
      const __m256i mag = _mm256_sub_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(be, 22)), _mm256_add_epi32(cb, vsub));
      c.codes[2 * j + h] = _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(xb, 28), eight));
    }
  }
}

// quest's statistics (G = 16) of n chunks of eight blocks with AVX-512F, chunk ch's to qa[8 ch ..
// 8 ch + 7]: one call for a tile's chunks, whose AVX2 code then reads them (the AVX-512 form called once
// per chunk from inside that code measured slower than the inlined AVX2 form; the same bits either way).
template <DType DT>
__attribute__((target("avx512f"))) inline void nvfp4_quest_stats_avx512(const Storage<DT>* s, std::int64_t n, float* qa) {
  for (std::int64_t ch = 0; ch < n; ++ch) _mm256_storeu_ps(qa + 8 * ch, quest_args8_avx512<DT, 16>(s + 128 * ch));
}
// For the chunk loops: QUEST's statistics of a tile's n <= kTileBlocks / 8 chunks into buf where the CPU
// has AVX-512F (buf returned), else nullptr (the chunk code computes them with AVX2).
template <DType DT, bool QUEST>
inline const float* nvfp4_quest_stats(const Storage<DT>* s, std::int64_t n, float (&buf)[kTileBlocks]) {
  if constexpr (QUEST) {
    if (cpu_has_avx512() && n <= kTileBlocks / 8) {
      nvfp4_quest_stats_avx512<DT>(s, n, buf);
      return buf;
    }
  }
  return nullptr;
}

// In two steps: the scale codes, ok and multipliers (nvfp4_chunk_scales_avx2), then the element codes
// (nvfp4_chunk_codes_avx2): a caller can take the next chunk's scales, a long chain of dependent
// operations (quest: two divisions and a square root), before this chunk's elements.
// QUEST: the eight statistics from qa where given (nvfp4_quest_stats_avx512), else computed here.
template <DType DT, bool QUEST = false>
__attribute__((target("avx2"))) inline void nvfp4_chunk_scales_avx2(const Storage<DT>* s, float S, const float* mtab, Nvfp4Chunk& c,
                                                                    const float* qa = nullptr) {
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i am;  // the blocks' amax bits, one lane per block
  if constexpr (DT == DType::bf16) {
    // one block per register (16 bf16), magnitudes compared as 16-bit integers; the eight horizontal
    // maxima folded together: halves across registers, then within 64 and 32 bits
    __m256i v[8];
    const __m256i m16 = _mm256_set1_epi16(0x7FFF);
    for (int j = 0; j < 8; ++j) v[j] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j)), m16);
    __m256i a[4];
    for (int j = 0; j < 4; ++j)  // lane 0: block 2j's halves' max; lane 1: block 2j + 1's
      a[j] = _mm256_max_epu16(_mm256_permute2x128_si256(v[2 * j], v[2 * j + 1], 0x20),
                              _mm256_permute2x128_si256(v[2 * j], v[2 * j + 1], 0x31));
    __m256i b[2];
    for (int j = 0; j < 2; ++j) {  // 64-bit lanes: blocks 4j, 4j + 2, 4j + 1, 4j + 3
      __m256i t = _mm256_max_epu16(_mm256_unpacklo_epi64(a[2 * j], a[2 * j + 1]), _mm256_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
      t = _mm256_max_epu16(t, _mm256_srli_epi64(t, 32));
      t = _mm256_max_epu16(t, _mm256_srli_epi64(t, 16));
      b[j] = _mm256_and_si256(t, _mm256_set1_epi64x(0xFFFF));
    }
    // 32-bit lanes: blocks 0, 4, 2, 6, 1, 5, 3, 7 -> 0..7, as fp32 bits
    const __m256i mixed = _mm256_or_si256(b[0], _mm256_slli_epi64(b[1], 32));
    am = _mm256_slli_epi32(_mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)), 16);
  } else {
    alignas(32) std::uint32_t a8[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i lo = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j)), magmask);
      const __m256i hi = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j + 8)), magmask);
      __m256i t = _mm256_max_epu32(lo, hi);
      t = _mm256_max_epu32(t, _mm256_permute2x128_si256(t, t, 0x01));
      t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0x4E));
      t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0xB1));
      a8[j] = std::uint32_t(_mm256_cvtsi256_si32(t));
    }
    am = _mm256_load_si256(reinterpret_cast<const __m256i*>(a8));
  }
  // scale codes: e4m3_code_rne_sat(amax * S / 6) (quest: of its statistic), read off the rounding
  {
    __m256 y;
    if constexpr (QUEST)
      y = qa ? _mm256_loadu_ps(qa) : quest_args8_avx2_form<DT, 16>(s);
    else
      y = _mm256_div_ps(_mm256_mul_ps(_mm256_castsi256_ps(am), _mm256_set1_ps(S)), _mm256_set1_ps(6.0f));
    const __m256 a = _mm256_min_ps(y, _mm256_set1_ps(448.0f));  // NaN y (a block not finite): 448
    constexpr std::uint32_t lo = 121u << 23, kC = rne_const_bits<3>();
    const __m256i be = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000)), _mm256_set1_epi32(int(lo)));
    const __m256i cb = _mm256_add_epi32(be, _mm256_set1_epi32(int(kC)));
    const __m256i t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(cb)));
    const __m256i code = _mm256_sub_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(be, 20)), _mm256_add_epi32(cb, _mm256_set1_epi32(int(lo >> 20))));
    c.ok = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), am);
    if constexpr (QUEST) c.ok = _mm256_and_si256(c.ok, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q)));
    c.sc = _mm256_and_si256(code, c.ok);
  }
  _mm256_store_ps(c.m8, _mm256_i32gather_ps(mtab, c.sc, 4));
}
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_chunk_codes_avx2(const Storage<DT>* s, Nvfp4Chunk& c) {
  // some block's multiplier infinite: zero elements need their test (nvfp4_elements_avx2)
  const __m256 minf = _mm256_cmp_ps(_mm256_load_ps(c.m8), _mm256_set1_ps(INFINITY), _CMP_EQ_OQ);
  if (_mm256_movemask_ps(minf) != 0)
    nvfp4_elements_avx2<DT, true>(s, c);
  else
    nvfp4_elements_avx2<DT, false>(s, c);
}

// The element codes of a chunk rounded stochastically (the staged path's integer form of
// nvfp4_encode_sr: sr_code_unscaled<e2m1>(|x| m, 0, rnd) with the sign at bit 3; |x| = 0 stays 0 where
// m is infinite, as nvfp4_product), block j's multiplier c.m8[j], the chunk's 128 comparison words
// rnd; eight lanes per step, every shift count as sr_code_unscaled's (variable shifts of 32 or more
// give 0, which its clamps stand for). Garbage where a block is not finite (callers mask with ok).
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_chunk_codes_sr_avx2(const Storage<DT>* s, Nvfp4Chunk& c, const std::uint32_t* rnd) {
  constexpr FloatSpec f = Elem<ElemType::e2m1>::spec;
  constexpr int lo = f.emin + 127;  // e = 0
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF), vlo = _mm256_set1_epi32(lo), zero = _mm256_setzero_si256(),
                eight = _mm256_set1_epi32(8);
  for (int j = 0; j < 8; ++j) {
    const __m256 m = _mm256_set1_ps(c.m8[j]);
    for (int h = 0; h < 2; ++h) {
      const __m256i xb = load8_bits_avx2<DT>(s + 16 * j + 8 * h);
      const __m256i xm = _mm256_and_si256(xb, magmask);
      const __m256i xz = _mm256_cmpeq_epi32(xm, zero);
      const __m256i p = _mm256_andnot_si256(xz, _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(xm), m)));  // |x| m, 0 stays 0
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rnd + 16 * j + 8 * h));
      c.codes[2 * j + h] = _mm256_or_si256(sr_mags8_avx2<ElemType::e2m1>(p, vlo, w), _mm256_and_si256(_mm256_srli_epi32(xb, 28), eight));
    }
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// nvfp4_chunk_codes_sr_avx2 with AVX-512F, one block (sixteen lanes) per step: the same operations.
template <DType DT>
__attribute__((target("avx512f"))) inline void nvfp4_chunk_codes_sr_avx512(const Storage<DT>* s, Nvfp4Chunk& c, const std::uint32_t* rnd) {
  constexpr FloatSpec f = Elem<ElemType::e2m1>::spec;
  const __m512i vlo = _mm512_set1_epi32(f.emin + 127);
  for (int j = 0; j < 8; ++j) {
    const __m512i xb = load16_bits_avx512<DT>(s + 16 * j);
    const __m512i xm = _mm512_and_si512(xb, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 nz = _mm512_test_epi32_mask(xm, xm);  // |x| m, 0 stays 0 (m may be infinite)
    const __m512i a = _mm512_maskz_mov_epi32(nz, _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(xm), _mm512_set1_ps(c.m8[j]))));
    const __m512i mag = sr_mags16_avx512<ElemType::e2m1>(a, vlo, _mm512_loadu_si512(rnd + 16 * j));
    const __m512i code = _mm512_or_si512(mag, _mm512_and_si512(_mm512_srli_epi32(xb, 28), _mm512_set1_epi32(8)));
    c.codes[2 * j] = _mm512_castsi512_si256(code);
    c.codes[2 * j + 1] = _mm512_extracti64x4_epi64(code, 1);
  }
}
#pragma GCC diagnostic pop

// Chunk ch of n consecutive chunks from s, taken in order ch = 0, 1, ..., n - 1: its scales and element
// codes, with the next chunk's scales computed before this one's elements, so that the scales' chain
// of dependent operations (quest: two divisions and a square root) overlaps the elements' work.
// c: the two chunks in flight (the caller's, kept across the calls).
template <DType DT, bool QUEST>
__attribute__((target("avx2"))) inline Nvfp4Chunk& nvfp4_chunk_in_order_avx2(const Storage<DT>* s, std::int64_t ch,
                                                                              std::int64_t n, float S, const float* mtab,
                                                                              Nvfp4Chunk (&c)[2], const float* qa = nullptr) {
  if (ch == 0) nvfp4_chunk_scales_avx2<DT, QUEST>(s, S, mtab, c[0], qa);
  prefetch_ahead(s + 128 * ch, 128);
  if (ch + 1 < n) nvfp4_chunk_scales_avx2<DT, QUEST>(s + 128 * (ch + 1), S, mtab, c[(ch + 1) & 1], qa ? qa + 8 * (ch + 1) : nullptr);
  Nvfp4Chunk& cur = c[ch & 1];
  nvfp4_chunk_codes_avx2<DT>(s + 128 * ch, cur);
  return cur;
}

// The packed FP4 bytes of one chunk's 128 codes (element 2i low nibble, 2i + 1 high), zero codes where
// a block is not finite, to d (64 bytes); its eight scale bytes (the NaN code where not finite) to sb.
__attribute__((target("avx2"))) inline void nvfp4_pack_chunk_avx2(const Nvfp4Chunk& c, std::uint8_t* d, std::uint8_t* sb) {
  alignas(32) std::uint32_t ok[8], sc[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ok), c.ok);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc), c.sc);
  for (int j = 0; j < 8; ++j) sb[j] = static_cast<std::uint8_t>(bsel(ok[j] != 0, sc[j], kE4M3NaN));
  const __m256i pair = _mm256_set1_epi32(1 | (16 << 16));  // (lo, hi) 16-bit -> lo + 16 hi
  for (int q = 0; q < 2; ++q) {  // four blocks: 32 bytes
    __m256i P[4];
    for (int k = 0; k < 4; ++k) {
      const int j = 4 * q + k;
      const __m256i keep = _mm256_set1_epi32(ok[j] ? -1 : 0);
      const __m256i e16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(c.codes[2 * j], keep),
                                                                       _mm256_and_si256(c.codes[2 * j + 1], keep)), 0xD8);
      P[k] = _mm256_madd_epi16(e16, pair);  // 32-bit lanes: the block's eight bytes in order
    }
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(P[0], P[1]), _mm256_packus_epi32(P[2], P[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 32 * q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

// The outputs of one chunk (its scale and element codes in c) to y: each block's eight possible
// outputs (nvfp4_decode of magnitudes 0..7 under its scale, converted to DT) computed once, then every
// element's picked by its code (nvfp4_store16_avx2) instead of a division per element.
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_qdq_store_chunk_avx2(const Nvfp4Chunk& c, float S, const NvTables& nv, Storage<DT>* y) {
  // the eight E2M1 magnitudes, and the output dtype's largest finite and Inf bits (out_mag_bits saturates)
  const __m256 e2m1 = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 vS = _mm256_set1_ps(S);
  alignas(32) float sv[8];
  alignas(32) std::uint32_t ok[8];
  _mm256_store_ps(sv, _mm256_i32gather_ps(nv.sval, c.sc, 4));
  _mm256_store_si256(reinterpret_cast<__m256i*>(ok), c.ok);
  for (int j = 0; j < 8; ++j) {
    // the block's eight outputs: to_dtype_bits_nonnan_bf(div_rn(mul_rn(e2m1 value, s), S)), all >= 0
    const __m256i v = _mm256_castps_si256(_mm256_div_ps(_mm256_mul_ps(e2m1, _mm256_set1_ps(sv[j])), vS));
    __m256i t;
    if constexpr (DT == DType::f32) {
      t = v;
    } else {
      const __m256i inf = _mm256_set1_epi32(0x7F800000);
      const __m256i r = _mm256_min_epi32(  // bf16: RNE, saturated at the largest finite (out_mag_bits)
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(0x7FFF)),
                                             _mm256_and_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(1))), 16),
          _mm256_set1_epi32(0x7F7F));
      t = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F80), _mm256_cmpeq_epi32(v, inf));
    }
    nvfp4_store16_avx2<DT>(t, c.codes[2 * j], c.codes[2 * j + 1], ok[j] != 0, y + 16 * j);
  }
}

// The end of a chunk whose scale and element codes are in c: QDQ its 128 outputs to d
// (nvfp4_qdq_store_chunk_avx2); quantize its 64 packed code bytes to d and its eight scale bytes to sb
// (nvfp4_pack_chunk_avx2).
template <DType DT, bool QDQ>
MXQ_INLINE __attribute__((target("avx2"))) void nvfp4_chunk_store_avx2(const Nvfp4Chunk& c, float S, const NvTables& nv,
                                                                       BlockDst<DT, QDQ>* d, std::uint8_t* sb) {
  if constexpr (QDQ) nvfp4_qdq_store_chunk_avx2<DT>(c, S, nv, d);
  else nvfp4_pack_chunk_avx2(c, d, sb);
}

// nvfp4_blocks8 for n consecutive chunks, RNE, where the CPU has AVX2 (Nvfp4Chunk's steps: the same
// operations, one vector lane per block or element; QUEST: the rule quest's scales, which only this
// path and the staged one compute). Quantize: sb takes the 8 n scale bytes.
template <DType DT, bool QUEST, bool QDQ>
__attribute__((target("avx2"))) void nvfp4_chunks_avx2(const Storage<DT>* s, std::int64_t n, float S, const NvTables& nv,
                                                      BlockDst<DT, QDQ>* d, std::uint8_t* sb) {
  constexpr int kStep = QDQ ? 128 : 64;  // d's elements per chunk: outputs, or code bytes
  Nvfp4Chunk c[2];
  alignas(32) float buf[kTileBlocks];
  const float* qa = nvfp4_quest_stats<DT, QUEST>(s, n, buf);
  for (std::int64_t ch = 0; ch < n; ++ch, d += kStep) {
    nvfp4_chunk_store_avx2<DT, QDQ>(nvfp4_chunk_in_order_avx2<DT, QUEST>(s, ch, n, S, nv.m, c, qa), S, nv, d, sb);
    if constexpr (!QDQ) sb += 8;
  }
}

// One chunk rounded stochastically with its 128 comparison words rnd (nvfp4_blocks8<DT, QDQ, true>),
// the element codes in AVX2 or AVX-512F lanes.
template <DType DT, bool QDQ>
__attribute__((target("avx2"))) void nvfp4_chunk_sr_avx2(const Storage<DT>* s, float S, const NvTables& nv, const std::uint32_t* rnd,
                                                        BlockDst<DT, QDQ>* d, std::uint8_t* sb) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, nv.m, c);
  nvfp4_chunk_codes_sr_avx2<DT>(s, c, rnd);
  nvfp4_chunk_store_avx2<DT, QDQ>(c, S, nv, d, sb);
}
template <DType DT, bool QDQ>
__attribute__((target("avx512f"))) void nvfp4_chunk_sr_avx512(const Storage<DT>* s, float S, const NvTables& nv,
                                                             const std::uint32_t* rnd, BlockDst<DT, QDQ>* d, std::uint8_t* sb) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, nv.m, c);
  nvfp4_chunk_codes_sr_avx512<DT>(s, c, rnd);
  nvfp4_chunk_store_avx2<DT, QDQ>(c, S, nv, d, sb);
}
#endif

}  // namespace
}  // namespace mxq::cpu
