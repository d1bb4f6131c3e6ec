// qdq on the fast CPU path: full blocks of the amax rules straight from x to y (two passes), the rest staged.
#include "cpu/fast_common.hpp"

namespace mxq::cpu {
namespace {

// The fp32 value / |bits| in fp32 bit positions of a dtype's storage word (core::Storage).
template <DType DT>
MXQ_INLINE std::uint32_t abs_f32_bits(Storage<DT> v) {
  if constexpr (DT == DType::f32) return v & 0x7FFFFFFFu;
  else return std::uint32_t(v & 0x7FFFu) << 16;  // bf16
}
template <DType DT>
MXQ_INLINE float to_f32(Storage<DT> v) {
  if constexpr (DT == DType::f32) return u2f(v);
  else return bf16_to_f32(v);
}

// QDQ of one full block of G elements, straight from x to y (quest: its statistics given, or computed here).
template <ElemType ET, DType DT, int G>
MXQ_INLINE void qdq_block_direct(const Problem& p, const void* src, void* dst, const float* quest = nullptr) {
  const Storage<DT>* s = static_cast<const Storage<DT>*>(src);
  Storage<DT>* d = static_cast<Storage<DT>*>(dst);
  std::uint32_t am = 0;
  for (int i = 0; i < G; ++i) am = std::max(am, abs_f32_bits<DT>(s[i]));
  if (am >= 0x7F800000u) {
    for (int i = 0; i < G; ++i) d[i] = static_cast<Storage<DT>>(nan_bits(DT));
    return;
  }
  const float qa = p.opt.rule == ScaleRule::quest && am ? (quest ? *quest : quest_arg_direct<DT, G>(s)) : 0.0f;
  const int e = am ? mx_scale_exp(p.opt.rule, u2f(am), qa, Elem<ET>::spec) : -127;
  constexpr FloatSpec f = Elem<ET>::spec;
  // NOTE: in the common range of e, round in the unscaled domain: C' = 1.5 * 2^(q + e + 23) is a
  // normal float whose ulp is the grid's quantum 2^(q+e), so (|x| + C') - C' is the dequantized
  // value itself, exactly; it has at most 8 significant bits and lies in bf16/fp32's normal range,
  // so the output conversion is a truncation. Outside that range the scaled path below is used.
  if (MxFastRange<ET>::contains(e)) {
    const std::uint32_t lo = std::uint32_t(f.emin + e + 127) << 23, hi = std::uint32_t(f.emax + 1 + e + 127) << 23;
    constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
    const float maxv = u2f(max_value_bits(f)) * pow2f(e);
    for (int i = 0; i < G; ++i) {
      const std::uint32_t xb = abs_f32_bits<DT>(s[i]);
      const float C = u2f(std::min(std::max(xb & 0x7F800000u, lo), hi) + kC);
      const float rm = std::min((u2f(xb) + C) - C, maxv);
      std::uint32_t sign = std::uint32_t(s[i]) >> (DT == DType::f32 ? 31 : 15);
      if constexpr (f.twos_complement) sign &= rm != 0.0f;  // INT8 has no -0
      if constexpr (DT == DType::f32)
        d[i] = f2u(rm) | (sign << 31);
      else
        d[i] = static_cast<Storage<DT>>((f2u(rm) >> 16) | (sign << 15));
    }
    return;
  }
  const float inv = pow2f(-e), scale = pow2f(e);
  for (int i = 0; i < G; ++i) {
    const float xv = to_f32<DT>(s[i]);
    const float rm = rne_mag<ET>(xv, inv);
    std::uint32_t sign = f2u(xv) >> 31;
    if constexpr (Elem<ET>::spec.twos_complement) sign &= rm != 0.0f;  // INT8 has no -0
    d[i] = static_cast<Storage<DT>>(out_mag_bits<DT>(rm * scale) | (sign << (DT == DType::f32 ? 31 : 15)));
  }
}

// QDQ of eight full NVFP4 blocks (128 elements, bf16/fp32, straight from x to y), RNE: the staged
// path's arithmetic below (amax, scale code, the element code, nvfp4_decode) a step at a time across
// the eight blocks, so that each step vectorises. SR: stochastic rounding with the 128 comparison
// words rnd (the staged path's integer form of nvfp4_encode_sr).
template <DType DT, bool SR = false>
MXQ_INLINE void nvfp4_qdq_blocks8(const Storage<DT>* s, float S, const NvTables& nv, Storage<DT>* y,
                                  const std::uint32_t* rnd = nullptr) {
  alignas(64) std::uint32_t sc[8], ok[8];
  alignas(64) float m[8], sv[8];
  nvfp4_scale_codes8<DT>(s, S, sc, ok);  // a block not finite: NaN everywhere
  for (int j = 0; j < 8; ++j) {
    m[j] = nv.m[sc[j]];
    sv[j] = nv.sval[sc[j]];
  }
  constexpr std::uint32_t kNaN = nan_bits(DT);
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t raw = std::uint32_t(s[16 * j + i]), xb = DT == DType::f32 ? raw : raw << 16;
      const std::uint32_t code =
          SR ? sr_code_unscaled<ElemType::e2m1>(nvfp4_product_bits_bf(xb, m[j]), 0, rnd[16 * j + i]) | ((xb >> 31) << 3)
             : nvfp4_code_rne_bf(xb, m[j]);
      const float v = div_rn(mul_rn(e2m1_value_bf(code & 7u), sv[j]), S);
      const std::uint32_t o = to_dtype_bits_nonnan_bf<DT>(u2f(f2u(v) | ((code >> 3) << 31)));
      y[16 * j + i] = static_cast<Storage<DT>>(bsel(ok[j] != 0, o, kNaN));
    }
}

#if defined(MXQ_CPU_AVX2)
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

// nvfp4_qdq_blocks8 for n consecutive chunks of eight blocks, where the CPU has AVX2: the scale and
// element codes from nvfp4_chunk_in_order_avx2, the outputs by nvfp4_qdq_store_chunk_avx2.
template <DType DT, bool QUEST>
__attribute__((target("avx2"))) void nvfp4_qdq_chunks_avx2(const Storage<DT>* s, std::int64_t n, float S, const NvTables& nv,
                                                          Storage<DT>* y) {
  Nvfp4Chunk cc[2];
  alignas(32) float buf[kTileBlocks];
  const float* qa = nvfp4_quest_stats<DT, QUEST>(s, n, buf);
  for (std::int64_t ch = 0; ch < n; ++ch, y += 128)
    nvfp4_qdq_store_chunk_avx2<DT>(nvfp4_chunk_in_order_avx2<DT, QUEST>(s, ch, n, S, nv.m, cc, qa), S, nv, y);
}

// One chunk rounded stochastically with its 128 comparison words rnd (nvfp4_qdq_blocks8<DT, true>).
template <DType DT>
__attribute__((target("avx2"))) void nvfp4_qdq_chunk_sr_avx2(const Storage<DT>* s, float S, const NvTables& nv, const std::uint32_t* rnd,
                                                            Storage<DT>* y) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, nv.m, c);
  nvfp4_chunk_codes_sr_avx2<DT>(s, c, rnd);
  nvfp4_qdq_store_chunk_avx2<DT>(c, S, nv, y);
}
template <DType DT>
__attribute__((target("avx512f"))) void nvfp4_qdq_chunk_sr_avx512(const Storage<DT>* s, float S, const NvTables& nv,
                                                                 const std::uint32_t* rnd, Storage<DT>* y) {
  Nvfp4Chunk c;
  nvfp4_chunk_scales_avx2<DT, false>(s, S, nv.m, c);
  nvfp4_chunk_codes_sr_avx512<DT>(s, c, rnd);
  nvfp4_qdq_store_chunk_avx2<DT>(c, S, nv, y);
}
#endif

#if defined(MXQ_CPU_AVX2)
// Stochastic QDQ of up to nb consecutive full MX blocks of 32 (an amax rule, not INT8, bf16/fp32) with
// AVX-512F, straight from x to y: the staged path's arithmetic (the rule's exponent from the block
// amax, sr_code_unscaled, sr_code_value_bits, the sign) sixteen lanes at a time, the words of the
// row's elements k0 + 32 j from srw. Returns the blocks done: it stops, writing nothing of it, at a
// block that is zero, not finite or scaled outside MxFastRange (the caller stages that one).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <ElemType ET, DType DT>
__attribute__((target("avx512f"))) std::int64_t mx_sr_qdq_blocks_avx512(ScaleRule rule, const Storage<DT>* s, std::int64_t nb,
                                                                      SrWindow& srw, std::int64_t k0, Storage<DT>* y) {
  constexpr FloatSpec f = Elem<ET>::spec;
  static_assert(!f.twos_complement);
  for (std::int64_t j = 0; j < nb; ++j, s += 32, y += 32) {
    prefetch_ahead(s, 32);
    __m512i xb[2], a[2];
    int e;
    if (!mx_sr_block_avx512<ET, DT>(rule, s, xb, a, e)) return j;
    const std::uint32_t* w = srw.at(k0 + 32 * j, 32);
    const __m512i vlo = _mm512_set1_epi32(f.emin + e + 127);
    // sr_code_value_bits: a normal code's fields placed in binade lo - 1 + (code >> mbits); a subnormal
    // code c as (2^(lo-1) (1 + c 2^-mbits) - 2^(lo-1)) 2
    const std::uint32_t lo1 = std::uint32_t(f.emin + e + 126) << 23;
    const __m512i vlo1 = _mm512_set1_epi32(int(lo1));
    for (int h = 0; h < 2; ++h) {
      const __m512i mag = sr_mags16_avx512<ET>(a[h], vlo, _mm512_loadu_si512(w + 16 * h));
      const __m512i v = _mm512_add_epi32(vlo1, _mm512_slli_epi32(mag, 23 - f.mbits));
      const __m512 sub = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(v), _mm512_castsi512_ps(vlo1)), _mm512_set1_ps(2.0f));
      const __m512i val = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << f.mbits)), v, _mm512_castps_si512(sub));
      if constexpr (DT == DType::f32) {
        _mm512_storeu_si512(y + 16 * h, _mm512_or_si512(val, _mm512_and_si512(xb[h], _mm512_set1_epi32(int(0x80000000u)))));
      } else {  // the value has at most 4 significant bits: bf16 is its high half
        const __m512i o = _mm512_or_si512(_mm512_srli_epi32(val, 16), _mm512_and_si512(_mm512_srli_epi32(xb[h], 16), _mm512_set1_epi32(0x8000)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16 * h), _mm512_cvtepi32_epi16(o));
      }
    }
  }
  return nb;
}
#pragma GCC diagnostic pop
#endif

template <ElemType ET, DType DT, int G>
MXQ_CLONES void qdq_tile(const Problem& p, const Tensor& x, const Tensor& y, const NvTables* nv, std::int64_t r,
                         std::int64_t b0, std::int64_t b1) {
  alignas(64) float xf[256];
  alignas(64) std::uint32_t out[256], rnd[256];
  SrWindow srw(p, r);  // stochastic rounding's words
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  void* yrow = row_ptr(y, r);
  const bool sr = p.stochastic, nv4 = p.nvfp4();
  const ScaleRule rule = p.opt.rule;
  // Full blocks of the amax rules in bf16/f32 run in two passes over the source (amax, then
  // round-and-store straight into y); everything else goes through the xf staging buffer.
  const bool direct = !sr && !nv4 && G != 0 && DT != DType::f16 && rule != ScaleRule::qutlass_absmax;
  const int g = G ? G : p.g;
  std::int64_t b = b0;
  if constexpr (ET == ElemType::e2m1 && G == 16 && DT != DType::f16) {
    if (nv4 && !sr) {  // NVFP4's full blocks, eight at a time
      const Storage<DT>* xrow =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      const bool quest = rule == ScaleRule::quest;
#if defined(MXQ_CPU_AVX2)
      if (cpu_has_avx2()) {
        const std::int64_t n = std::max<std::int64_t>(0, (std::min(b1, p.K / 16) - b) / 8);
        Storage<DT>* yb = static_cast<Storage<DT>*>(yrow) + b * 16;
        if (quest)
          nvfp4_qdq_chunks_avx2<DT, true>(xrow + b * 16, n, p.S, *nv, yb);
        else
          nvfp4_qdq_chunks_avx2<DT, false>(xrow + b * 16, n, p.S, *nv, yb);
        b += 8 * n;
      }
#endif
      for (; !quest && b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        prefetch_ahead(xrow + b * 16, 128);
        nvfp4_qdq_blocks8<DT>(xrow + b * 16, p.S, *nv, static_cast<Storage<DT>*>(yrow) + b * 16);
      }
    }
    if (nv4 && sr && rule != ScaleRule::quest) {  // stochastic rounding: eight at a time too
      const Storage<DT>* xrow =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      for (; b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        prefetch_ahead(xrow + b * 16, 128);
        Storage<DT>* yb = static_cast<Storage<DT>*>(yrow) + b * 16;
#if defined(MXQ_CPU_AVX2)
        if (cpu_has_avx512()) {
          nvfp4_qdq_chunk_sr_avx512<DT>(xrow + b * 16, p.S, *nv, srw.at(b * 16, 128), yb);
          continue;
        }
        if (cpu_has_avx2()) {
          nvfp4_qdq_chunk_sr_avx2<DT>(xrow + b * 16, p.S, *nv, srw.at(b * 16, 128), yb);
          continue;
        }
#endif
        nvfp4_qdq_blocks8<DT, true>(xrow + b * 16, p.S, *nv, yb, srw.at(b * 16, 128));
      }
    }
  }
#if defined(MXQ_CPU_AVX2)
  if constexpr (G == 32 && DT != DType::f16) {
    if (direct && rule == ScaleRule::quest && cpu_has_avx2()) {  // quest's block statistics eight blocks at a time
      const Storage<DT>* xrow =
          reinterpret_cast<const Storage<DT>*>(static_cast<const char*>(x.data) + r * x.stride() * dtype_size(DT));
      for (; b + 8 <= b1 && (b + 8) * 32 <= p.K; b += 8) {
        prefetch_ahead(xrow + b * 32, 256);
        alignas(32) float qa[8];
        quest_args8_avx2<DT>(xrow + b * 32, qa);
        for (int j = 0; j < 8; ++j)
          qdq_block_direct<ET, DT, G>(p, xrow + (b + j) * 32, static_cast<Storage<DT>*>(yrow) + (b + j) * 32, qa + j);
      }
    }
  }
#endif
#if defined(MXQ_CPU_AVX2)
  // stochastic rounding of the MX amax rules' full blocks with AVX-512F (not INT8), the rest staged
  bool sr512 = false;
  if constexpr (G == 32 && DT != DType::f16 && !f.twos_complement)
    sr512 = sr && !nv4 && rule != ScaleRule::quest && rule != ScaleRule::qutlass_absmax && cpu_has_avx512();
  const std::int64_t bfull = std::min<std::int64_t>(b1, p.K / 32);  // (sr512: G = 32)
#endif
  for (; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
#if defined(MXQ_CPU_AVX2)
    if constexpr (G == 32 && DT != DType::f16 && !f.twos_complement) {
      if (sr512 && b < bfull) {
        const std::int64_t done =
            mx_sr_qdq_blocks_avx512<ET, DT>(rule, static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0, bfull - b, srw, k0,
                                            static_cast<Storage<DT>*>(yrow) + k0);
        if (done > 0) {
          b += done - 1;
          continue;
        }
      }
    }
#endif
    if constexpr (G != 0 && DT != DType::f16) {
      if (direct && n == G) {
        prefetch_ahead(static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0, G);
        qdq_block_direct<ET, DT, G>(p, static_cast<const char*>(x.data) + (r * x.stride() + k0) * dtype_size(DT),
                                    static_cast<char*>(yrow) + k0 * dtype_size(DT));
        continue;
      }
    }
    load_block<DT, G>(x, r, k0, p.K, p.g, xf);
    const std::uint32_t am = amax_bits<G>(xf, p.g);
    if (am >= 0x7F800000u) {
      for (int i = 0; i < g; ++i) out[i] = nan_bits(DT);
      store_out<DT>(yrow, k0, n, out);
      continue;
    }
    if (sr) std::memcpy(rnd, srw.at(k0, g), sizeof(std::uint32_t) * std::size_t(g));  // a local copy: no aliasing
    if (nv4) {
      // The element code (readoff / stochastic), then nvfp4_decode: (E2M1 value * s) / S, signed.
      const std::uint32_t sc = rule == ScaleRule::quest ? nvfp4_quest_scale_code_fast(quest_arg<G>(xf, g))
                                                        : e4m3_code_rne_sat(div_rn(mul_rn(u2f(am), p.S), 6.0f));
      if (sc == kE4M3NaN) {  // a NaN quest statistic: as a non-finite block
        for (int i = 0; i < g; ++i) out[i] = nan_bits(DT);
        store_out<DT>(yrow, k0, n, out);
        continue;
      }
      const float m = nv->m[sc], sval = nv->sval[sc], S = p.S;
      std::uint32_t* codes = out;  // the codes, then the outputs in their place
      if (sr)
        for (int i = 0; i < g; ++i)  // nvfp4_encode_sr in the integer form (fastmath_test)
          codes[i] = sr_code_unscaled<ElemType::e2m1>(nvfp4_product_bits_bf(f2u(xf[i]), m), 0, rnd[i]) | ((f2u(xf[i]) >> 31) << 3);
      else
        for (int i = 0; i < g; ++i) codes[i] = nvfp4_code_rne_bf(f2u(xf[i]), m);
      for (int i = 0; i < g; ++i) {
        const float v = div_rn(mul_rn(e2m1_value_bf(codes[i] & 7u), sval), S);
        out[i] = to_dtype_bits_nonnan_bf<DT>(u2f(f2u(v) | ((codes[i] >> 3) << 31)));
      }
    } else {
      int e = -127;
      if (am != 0) e = mx_scale_exp(rule, u2f(am), rule == ScaleRule::quest ? quest_arg<G>(xf, g) : 0.0f, f);
      if (rule == ScaleRule::qutlass_absmax)
        for (int i = 0; i < g; ++i) xf[i] = 3.0f * xf[i];
      const float inv = pow2f(-e), scale = pow2f(e);
      if (!sr) {
        for (int i = 0; i < g; ++i) {
          const float rm = rne_mag<ET>(xf[i], inv);
          const float v = rm * scale;  // exact, or +Inf past FLT_MAX
          std::uint32_t sign = f2u(xf[i]) >> 31;
          if constexpr (f.twos_complement) sign &= rm != 0.0f;  // INT8 has no -0
          out[i] = out_mag_bits<DT>(v) | (sign << kSignBit);
        }
      } else if (!f.twos_complement && DT != DType::f16 && MxFastRange<ET>::contains(e)) {
        // sr_code_unscaled and the code's value (fastmath_test): the dequantized value itself, at most
        // 4 significant bits and normal, so the bf16 output is its high half.
        for (int i = 0; i < g; ++i) {
          const std::uint32_t xb = f2u(xf[i]);
          const std::uint32_t v = sr_code_value_bits<ET>(sr_code_unscaled<ET>(xb, e, rnd[i]), e);
          out[i] = DT == DType::f32 ? (v | (xb & 0x80000000u)) : ((v >> 16) | ((xb >> 31) << 15));
        }
      } else {
        for (int i = 0; i < g; ++i) out[i] = mx_dequant_finite<ET, DT>(encode_scaled_sr<ET>(f2u(xf[i]), e, rnd[i]), scale);
      }
    }
    store_out<DT>(yrow, k0, n, out);
  }
}

}  // namespace

void qdq(const Problem& p, const Tensor& x, const Tensor& y) {
  NvTables nv{};
  if (p.nvfp4()) nv = make_nv_tables(p.S);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_group<decltype(et)::value>(p.g, [&](auto gc) {
        parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
          qdq_tile<decltype(et)::value, decltype(dt)::value, decltype(gc)::value>(p, x, y, &nv, r, b0, b1);
        });
      });
    });
  });
}

}  // namespace mxq::cpu
