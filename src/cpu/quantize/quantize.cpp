// quantize on the fast CPU path: every format and rounding branch-free per element (fast_common.hpp).
#include <bit>

#include "core/format_traits.hpp"
#include "cpu/fast_common.hpp"

namespace mxq::cpu {
namespace {

struct Outs {
  std::uint8_t* codes_row;
  std::uint8_t* scales;
  std::int64_t scale_stride;
  std::uint8_t* mask_row;
};

// Packed codes of one block: two FP4 codes per byte (element 2i in the low nibble), else one per byte.
template <ElemType ET, int G>
MXQ_INLINE void store_codes(std::uint8_t* row, std::int64_t k0, std::int64_t n, const std::uint32_t* codes) {
  if constexpr (Elem<ET>::spec.bits == 4) {
    std::uint8_t* d = row + k0 / 2;
    if (G != 0 && n == G) {
      // each pair of 32-bit codes read as one little-endian 64-bit word c0 | c1 << 32 and packed to
      // c0 | c1 << 4 into a local array, then one copy (measured: 3.0 -> 3.3 GB/s single-thread for
      // the MXFP4 quantize of bf16 against narrowing to bytes first and storing through d)
      alignas(16) std::uint8_t pk[G / 2];
      for (int i = 0; i < G / 2; ++i) pk[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xFu) | ((codes[2 * i + 1] & 0xFu) << 4));
      std::memcpy(d, pk, G / 2);
    } else {
      // an odd n's last high nibble is 0 (the padding element's code, written out: GCC 12 could not
      // see that every path fills codes up to the block size)
      for (std::int64_t i = 0; i < (n + 1) / 2; ++i)
        d[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xF) | ((2 * i + 1 < n ? codes[2 * i + 1] & 0xF : 0u) << 4));
    }
  } else {
    std::uint8_t* d = row + k0;
    if (G != 0 && n == G) {
      for (int i = 0; i < G; ++i) d[i] = static_cast<std::uint8_t>(codes[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<std::uint8_t>(codes[i]);
    }
  }
}

MXQ_INLINE void store_mask(std::uint8_t* row, std::int64_t k0, std::int64_t n, const std::uint32_t* keep) {
  // k0 is a multiple of g >= 2; bits are ORed in because small groups share a byte.
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t k = k0 + i;
    if (keep[i]) row[k / 8] |= static_cast<std::uint8_t>(1u << (k % 8));
  }
}

// The fp32 bits of |x| and the sign bit of a bf16/fp32 storage word.
template <DType DT>
MXQ_INLINE std::uint32_t abs_bits_of(Storage<DT> v) {
  if constexpr (DT == DType::f32) return v & 0x7FFFFFFFu;
  else return std::uint32_t(v & 0x7FFFu) << 16;
}

// Codes and scale of one full block of an amax rule (floor, ceil, even, rceil) or quest, RNE, straight
// from bf16/fp32 storage (no staging): the arithmetic of mx_block_codes on the same fp32 values (quest:
// its statistics given, or computed here). Returns false, writing nothing, where the scale lies
// outside MxFastRange (the caller stages the block).
template <ElemType ET, DType DT, int G>
MXQ_INLINE bool quantize_block_direct(ScaleRule rule, const Storage<DT>* s, std::uint32_t* codes, std::uint8_t& sb,
                                      std::uint32_t* keep, const float* quest = nullptr) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignShift = DT == DType::f32 ? 31 : 15;
  std::uint32_t am = 0;
  for (int i = 0; i < G; ++i) am = std::max(am, abs_bits_of<DT>(s[i]));
  if (am >= 0x7F800000u) {
    sb = kE8M0NaN;
    for (int i = 0; i < G; ++i) codes[i] = 0;
    if (keep)
      for (int i = 0; i < G; ++i) keep[i] = 0;
    return true;
  }
  const float qa = rule == ScaleRule::quest && am ? (quest ? *quest : quest_arg_direct<DT, G>(s)) : 0.0f;
  const int e = am ? mx_scale_exp(rule, u2f(am), qa, f) : -127;
  if (!MxFastRange<ET>::contains(e)) return false;
  sb = static_cast<std::uint8_t>(e + kE8M0Bias);
  const MxBinades bn = mx_binades<ET>(e);
  for (int i = 0; i < G; ++i) codes[i] = mx_code_rne_fast<ET>(abs_bits_of<DT>(s[i]), std::uint32_t(s[i]) >> kSignShift, bn);
  if (keep) {  // the clip mask: |x| * 2^-e < the largest element value, as the staged path
    const float inv = pow2f(-e), maxv = u2f(max_value_bits(f));
    for (int i = 0; i < G; ++i) keep[i] = u2f(abs_bits_of<DT>(s[i])) * inv < maxv;
  }
  return true;
}

// Eight full MX blocks of 32 (an amax rule, no clip mask) straight from bf16/fp32 storage: the
// arithmetic of quantize_block_direct a step at a time across the eight blocks (the rule's exponent
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
  for (int i = 0; i < 256; ++i) xb[i] = abs_bits_of<DT>(s[i]);
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

#if defined(MXQ_CPU_AVX2)
// Stochastic quantize of up to nb consecutive full MX blocks of 32 (an amax rule, not INT8, bf16/fp32)
// with AVX-512F, straight from the source: the staged path's arithmetic (the rule's exponent from the
// block amax, sign_code of sr_code_unscaled via sr_mags16_avx512) sixteen lanes at a time, the words
// of the row's elements k0 + 32 j from srw; codes to d (packed as store_codes), scale bytes to sb.
// Returns the blocks done: it stops, writing nothing of it, at a block that is zero, not finite or
// scaled outside MxFastRange (the caller takes that one and the rest by the other paths).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <ElemType ET, DType DT>
__attribute__((target("avx512f"))) std::int64_t mx_sr_quantize_blocks_avx512(ScaleRule rule, const Storage<DT>* s, std::int64_t nb,
                                                                           SrWindow& srw, std::int64_t k0, std::uint8_t* d,
                                                                           std::uint8_t* sb) {
  constexpr FloatSpec f = Elem<ET>::spec;
  static_assert(!f.twos_complement);
  constexpr int cpb = f.bits == 4 ? 16 : 32;  // code bytes per block
  for (std::int64_t j = 0; j < nb; ++j, s += 32, d += cpb) {
    prefetch_ahead(s, 32);
    __m512i xb[2], a[2];
    int e;
    if (!mx_sr_block_avx512<ET, DT>(rule, s, xb, a, e)) return j;
    const std::uint32_t* w = srw.at(k0 + 32 * j, 32);
    const __m512i vlo = _mm512_set1_epi32(f.emin + e + 127);
    for (int h = 0; h < 2; ++h) {
      const __m512i mag = sr_mags16_avx512<ET>(a[h], vlo, _mm512_loadu_si512(w + 16 * h));
      const __m512i code = _mm512_or_si512(mag, _mm512_slli_epi32(_mm512_srli_epi32(xb[h], 31), f.bits - 1));
      if constexpr (f.bits == 4)  // element 2i in the low nibble: each 64-bit lane's two codes to one byte
        _mm_storel_epi64(reinterpret_cast<__m128i*>(d + 8 * h), _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * h), _mm512_cvtepi32_epi8(code));
    }
    sb[j] = static_cast<std::uint8_t>(e + kE8M0Bias);
  }
  return nb;
}
#pragma GCC diagnostic pop
#endif

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

// Eight full NVFP4 blocks (128 elements from bf16/fp32 storage, no staging), RNE: the arithmetic of
// the staged path below (amax, nvfp4_block_scale_code, the table's multiplier, nvfp4_code_rne_bf) a
// step at a time across the eight blocks, so that each step vectorises (the scale's division among
// them). d: the 64 packed code bytes; sb: the eight scale bytes. SR: stochastic rounding with the 128
// comparison words rnd (the staged path's nvfp4_encode_sr in the integer form).
template <DType DT, bool SR = false>
MXQ_INLINE void nvfp4_blocks8(const Storage<DT>* s, float S, const float* mtab, std::uint8_t* d, std::uint8_t* sb,
                              const std::uint32_t* rnd = nullptr) {
  alignas(64) std::uint32_t codes[128], sc[8], ok[8];
  alignas(64) float m[8];
  nvfp4_scale_codes8<DT>(s, S, sc, ok);
  for (int j = 0; j < 8; ++j) {  // a block not finite: the NaN scale, zero codes
    m[j] = mtab[sc[j]];
    sb[j] = static_cast<std::uint8_t>(bsel(ok[j] != 0, sc[j], kE4M3NaN));
  }
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t raw = std::uint32_t(s[16 * j + i]), xb = DT == DType::f32 ? raw : raw << 16;
      if constexpr (SR)
        codes[16 * j + i] =
            (sr_code_unscaled<ElemType::e2m1>(nvfp4_product_bits_bf(xb, m[j]), 0, rnd[16 * j + i]) | ((xb >> 31) << 3)) & ok[j];
      else
        codes[16 * j + i] = nvfp4_code_rne_bf(xb, m[j]) & ok[j];
    }
  alignas(16) std::uint8_t pk[64];
  for (int i = 0; i < 64; ++i) pk[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xFu) | ((codes[2 * i + 1] & 0xFu) << 4));
  std::memcpy(d, pk, 64);
}

#if defined(MXQ_CPU_AVX2)
// nvfp4_blocks8 for n consecutive chunks of eight blocks, where the CPU has AVX2 (Nvfp4Chunk's steps:
// the same operations, one vector lane per block or element; QUEST: the rule quest's scales, which
// only this path and the staged one compute). sb: the 8 n scale bytes.
template <DType DT, bool QUEST>
__attribute__((target("avx2"))) void nvfp4_quantize_chunks_avx2(const Storage<DT>* s, std::int64_t n, float S, const float* mtab,
                                                               std::uint8_t* d, std::uint8_t* sb) {
  Nvfp4Chunk c[2];
  alignas(32) float buf[kTileBlocks];
  const float* qa = nvfp4_quest_stats<DT, QUEST>(s, n, buf);
  for (std::int64_t ch = 0; ch < n; ++ch)
    nvfp4_pack_chunk_avx2(nvfp4_chunk_in_order_avx2<DT, QUEST>(s, ch, n, S, mtab, c, qa), d + 64 * ch, sb + 8 * ch);
}
// One chunk rounded stochastically with its 128 comparison words rnd (nvfp4_blocks8<DT, true>).
template <DType DT>
__attribute__((target("avx2"))) void nvfp4_quantize_chunk_sr_avx2(const Storage<DT>* s, float S, const float* mtab,
                                                                 const std::uint32_t* rnd, std::uint8_t* d, std::uint8_t* sb) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, mtab, c);
  nvfp4_chunk_codes_sr_avx2<DT>(s, c, rnd);
  nvfp4_pack_chunk_avx2(c, d, sb);
}
template <DType DT>
__attribute__((target("avx512f"))) void nvfp4_quantize_chunk_sr_avx512(const Storage<DT>* s, float S, const float* mtab,
                                                                      const std::uint32_t* rnd, std::uint8_t* d, std::uint8_t* sb) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, mtab, c);
  nvfp4_chunk_codes_sr_avx512<DT>(s, c, rnd);
  nvfp4_pack_chunk_avx2(c, d, sb);
}
#endif

// One tile: every block staged to fp32 (load_block), its scale from the amax, its codes by the
// branch-free helpers (mx_block_codes; NVFP4: nvfp4_code_rne_bf, or sr_code_unscaled), the
// stochastic comparison words one Philox call per counter (sr_words). Bit-exact with the scalar codec.
template <ElemType ET, DType DT, int G>
MXQ_CLONES void quantize_tile(const Problem& p, const Tensor& x, const Outs& o, const NvTables* nv, std::int64_t r,
                              std::int64_t b0, std::int64_t b1) {
  alignas(64) float xf[256];
  alignas(64) std::uint32_t codes[256], keep[256], rnd[256];
  SrWindow srw(p, r);  // stochastic rounding's words
  constexpr FloatSpec f = Elem<ET>::spec;
  const int g = G ? G : p.g;
  const bool nv4 = p.nvfp4(), sr = p.stochastic;
  const ScaleRule rule = p.opt.rule;
  // full blocks of the amax rules: straight from the source (bf16/fp32); eight at a time with
  // stochastic rounding too (not INT8)
  const bool direct = !nv4 && !sr && G != 0 && DT != DType::f16 && rule != ScaleRule::qutlass_absmax;
  const bool direct8 = !nv4 && (!sr || !f.twos_complement) && G != 0 && DT != DType::f16 && rule != ScaleRule::qutlass_absmax;
  std::int64_t b = b0;
  // stochastic rounding of the MX amax rules' full blocks with AVX-512F (not INT8), block runs taken in
  // the loop below, the rest staged
  bool sr512 = false;
#if defined(MXQ_CPU_AVX2)
  if constexpr (G == 32 && DT != DType::f16 && !f.twos_complement)
    sr512 = sr && direct8 && !o.mask_row && rule != ScaleRule::quest && cpu_has_avx512();
#endif
  if constexpr (G == 32 && DT != DType::f16) {
    // MX full blocks, eight at a time where all eight are plain (quest: where its statistics are
    // computed eight blocks at a time)
    bool quest8 = false;
#if defined(MXQ_CPU_AVX2)
    quest8 = rule == ScaleRule::quest && cpu_has_avx2();
#endif
    if (direct8 && !o.mask_row && (rule != ScaleRule::quest || quest8) && !sr512) {
      const core::AmaxRule k = core::amax_rule(rule, f);
      const Storage<DT>* row =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      constexpr int cpb = f.bits == 4 ? 16 : 32;  // code bytes per block
      // quest: the next eight blocks' statistics before this eight's codes (a chain of divisions and a
      // square root that the codes would otherwise wait for)
      alignas(32) float qa[2][8];
      auto fits = [&](std::int64_t bb) { return bb + 8 <= b1 && (bb + 8) * 32 <= p.K; };
#if defined(MXQ_CPU_AVX2)
      if (quest8 && fits(b)) quest_args8_avx2<DT>(row + b * 32, qa[0]);
#endif
      for (int cur = 0; fits(b); b += 8, cur ^= 1) {
        std::uint8_t sb8[8];
#if defined(MXQ_CPU_AVX2)
        if (quest8 && fits(b + 8)) quest_args8_avx2<DT>(row + (b + 8) * 32, qa[cur ^ 1]);
#endif
        prefetch_ahead(row + b * 32, 256);
        const std::uint32_t* w = sr ? srw.at(b * 32, 256) : nullptr;
        const bool done = mx_blocks8_any<ET, DT>(k, row + b * 32, o.codes_row + b * cpb, sb8, quest8 ? qa[cur] : nullptr, w);
        if (!done) break;
        store_scales(p, o.scales, o.scale_stride, r, b, sb8, 8);
      }
    }
  }
  if constexpr (ET == ElemType::e2m1 && G == 16 && DT != DType::f16) {
    if (nv4 && !sr && !o.mask_row) {  // NVFP4's full blocks, eight at a time, from the source
      const Storage<DT>* row =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      const bool quest = rule == ScaleRule::quest;
#if defined(MXQ_CPU_AVX2)
      if (cpu_has_avx2()) {
        const std::int64_t n = std::max<std::int64_t>(0, (std::min(b1, p.K / 16) - b) / 8);
        alignas(64) std::uint8_t sb[kTileBlocks];
        if (quest)
          nvfp4_quantize_chunks_avx2<DT, true>(row + b * 16, n, p.S, nv->m, o.codes_row + b * 8, sb);
        else
          nvfp4_quantize_chunks_avx2<DT, false>(row + b * 16, n, p.S, nv->m, o.codes_row + b * 8, sb);
        store_scales(p, o.scales, o.scale_stride, r, b, sb, 8 * n);
        b += 8 * n;
      }
#endif
      for (; !quest && b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        std::uint8_t sb8[8];
        prefetch_ahead(row + b * 16, 128);
        nvfp4_blocks8<DT>(row + b * 16, p.S, nv->m, o.codes_row + b * 8, sb8);
        store_scales(p, o.scales, o.scale_stride, r, b, sb8, 8);
      }
    }
    if (nv4 && sr && !o.mask_row && rule != ScaleRule::quest) {  // stochastic rounding: eight at a time too
      const Storage<DT>* row =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      for (; b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        std::uint8_t sb8[8];
        prefetch_ahead(row + b * 16, 128);
#if defined(MXQ_CPU_AVX2)
        if (cpu_has_avx512())
          nvfp4_quantize_chunk_sr_avx512<DT>(row + b * 16, p.S, nv->m, srw.at(b * 16, 128), o.codes_row + b * 8, sb8);
        else if (cpu_has_avx2())
          nvfp4_quantize_chunk_sr_avx2<DT>(row + b * 16, p.S, nv->m, srw.at(b * 16, 128), o.codes_row + b * 8, sb8);
        else
#endif
          nvfp4_blocks8<DT, true>(row + b * 16, p.S, nv->m, o.codes_row + b * 8, sb8, srw.at(b * 16, 128));
        store_scales(p, o.scales, o.scale_stride, r, b, sb8, 8);
      }
    }
  }
  alignas(32) float qa8[8];  // quest: the statistics of blocks qa_b .. qa_b + 7, eight at a time (AVX2)
  std::int64_t qa_b = -8;
  for (; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
#if defined(MXQ_CPU_AVX2)
    if constexpr (G == 32 && DT != DType::f16 && !f.twos_complement) {
      const std::int64_t bfull = std::min<std::int64_t>(b1, p.K / 32);
      if (sr512 && b < bfull) {
        constexpr int cpb = f.bits == 4 ? 16 : 32;
        std::uint8_t sbuf[kTileBlocks];
        const std::int64_t done =
            mx_sr_quantize_blocks_avx512<ET, DT>(rule, static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0, bfull - b, srw, k0,
                                                 o.codes_row + b * cpb, sbuf);
        if (done > 0) {
          store_scales(p, o.scales, o.scale_stride, r, b, sbuf, done);
          b += done - 1;
          continue;
        }
      }
    }
#endif
    std::uint8_t sb;
    if constexpr (G != 0 && DT != DType::f16) {
      if (direct && n == G) {
        const Storage<DT>* src =
            reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + (r * x.stride() + k0) * dtype_size(DT));
        const float* qa = nullptr;
#if defined(MXQ_CPU_AVX2)
        if constexpr (G == 32) {
          if (rule == ScaleRule::quest && cpu_has_avx2()) {
            if (b >= qa_b + 8 && b + 8 <= b1 && (b + 8) * 32 <= p.K) {
              quest_args8_avx2<DT>(src, qa8);
              qa_b = b;
            }
            if (b < qa_b + 8) qa = qa8 + (b - qa_b);
          }
        }
#endif
        if (quantize_block_direct<ET, DT, G>(rule, src, codes, sb, o.mask_row ? keep : nullptr, qa)) {
          o.scales[p.scale_offset(r, b, o.scale_stride)] = sb;
          store_codes<ET, G>(o.codes_row, k0, n, codes);
          if (o.mask_row) store_mask(o.mask_row, k0, n, keep);
          continue;
        }
      }
    }
    load_block<DT, G>(x, r, k0, p.K, p.g, xf);
    const std::uint32_t am = amax_bits<G>(xf, p.g);
    if (am >= 0x7F800000u) {  // a NaN or Inf: the NaN scale, zero codes
      sb = nv4 ? kE4M3NaN : kE8M0NaN;
      for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
    } else {
      if (sr) std::memcpy(rnd, srw.at(k0, g), sizeof(std::uint32_t) * std::size_t(g));  // a local copy: no aliasing
      if (nv4) {
        // nvfp4_block_scale_code (e4m3_code_rne_sat: fastmath_test) and the table's multiplier
        const std::uint32_t sc = rule == ScaleRule::quest ? nvfp4_quest_scale_code_fast(quest_arg<G>(xf, g))
                                                          : e4m3_code_rne_sat(div_rn(mul_rn(u2f(am), p.S), 6.0f));
        const float m = nv->m[sc];
        sb = static_cast<std::uint8_t>(sc);
        if (sc == kE4M3NaN) {  // a NaN quest statistic: as a non-finite block
          for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
        } else {
          if (sr)
            for (int i = 0; i < g; ++i)  // nvfp4_encode_sr in the integer form (fastmath_test)
              codes[i] = sr_code_unscaled<ElemType::e2m1>(nvfp4_product_bits_bf(f2u(xf[i]), m), 0, rnd[i]) | ((f2u(xf[i]) >> 31) << 3);
          else
            for (int i = 0; i < g; ++i) codes[i] = nvfp4_code_rne_bf(f2u(xf[i]), m);
          if (o.mask_row)
            for (int i = 0; i < g; ++i) keep[i] = std::fabs(xf[i] * m) < 6.0f;
        }
      } else {
        int e = -127;
        if (am != 0) e = mx_scale_exp(rule, u2f(am), rule == ScaleRule::quest ? quest_arg<G>(xf, g) : 0.0f, f);
        if (rule == ScaleRule::qutlass_absmax)
          for (int i = 0; i < g; ++i) xf[i] = 3.0f * xf[i];
        sb = static_cast<std::uint8_t>(e + kE8M0Bias);
        mx_block_codes<ET, G>(g, xf, e, sr, rnd, codes);
        if (o.mask_row) {
          const float inv = pow2f(-e), maxv = u2f(max_value_bits(f));
          for (int i = 0; i < g; ++i) keep[i] = std::fabs(xf[i]) * inv < maxv;
        }
      }
    }
    o.scales[p.scale_offset(r, b, o.scale_stride)] = sb;
    store_codes<ET, G>(o.codes_row, k0, n, codes);
    if (o.mask_row) store_mask(o.mask_row, k0, n, keep);
  }
}

}  // namespace

void quantize(const Problem& p, const Tensor& x, const QuantizedOut& out) {
  if (p.opt.scale_layout == ScaleLayout::swizzled)
    std::memset(out.scales.data, 0, p.scale_rows_padded * p.scale_cols_padded);
  if (out.clip_mask.data)
    for (std::int64_t r = 0; r < p.rows; ++r)
      std::memset(static_cast<std::uint8_t*>(out.clip_mask.data) + r * out.clip_mask.stride(), 0, out.clip_mask.cols);
  NvTables nv{};
  if (p.nvfp4()) nv = make_nv_tables(p.S);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_group<decltype(et)::value>(p.g, [&](auto gc) {
        parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
          Outs o{static_cast<std::uint8_t*>(out.codes.data) + r * out.codes.stride(),
                 static_cast<std::uint8_t*>(out.scales.data), out.scales.stride(),
                 out.clip_mask.data ? static_cast<std::uint8_t*>(out.clip_mask.data) + r * out.clip_mask.stride() : nullptr};
          quantize_tile<decltype(et)::value, decltype(dt)::value, decltype(gc)::value>(p, x, o, &nv, r, b0, b1);
        });
      });
    });
  });
}

}  // namespace mxq::cpu
