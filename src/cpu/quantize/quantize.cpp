// quantize on the fast CPU path: the tiles of a problem, each block by the paths that take it (the
// block and chunk code shared with QDQ: mx_blocks.hpp, nvfp4_chunk.hpp), the rest staged to fp32.
#include <bit>

#include "core/format_traits.hpp"
#include "cpu/quantize/mx_blocks.hpp"
#include "cpu/quantize/e5m3.hpp"
#include "cpu/quantize/nvfp4_chunk.hpp"

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
          nvfp4_chunks_avx2<DT, true, false>(row + b * 16, n, p.S, *nv, o.codes_row + b * 8, sb);
        else
          nvfp4_chunks_avx2<DT, false, false>(row + b * 16, n, p.S, *nv, o.codes_row + b * 8, sb);
        store_scales(p, o.scales, o.scale_stride, r, b, sb, 8 * n);
        b += 8 * n;
      }
#endif
      for (; !quest && b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        std::uint8_t sb8[8];
        prefetch_ahead(row + b * 16, 128);
        nvfp4_blocks8<DT, false>(row + b * 16, p.S, *nv, o.codes_row + b * 8, sb8);
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
          nvfp4_chunk_sr_avx512<DT, false>(row + b * 16, p.S, *nv, srw.at(b * 16, 128), o.codes_row + b * 8, sb8);
        else if (cpu_has_avx2())
          nvfp4_chunk_sr_avx2<DT, false>(row + b * 16, p.S, *nv, srw.at(b * 16, 128), o.codes_row + b * 8, sb8);
        else
#endif
          nvfp4_blocks8<DT, false, true>(row + b * 16, p.S, *nv, o.codes_row + b * 8, sb8, srw.at(b * 16, 128));
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
            mx_sr_blocks_avx512<ET, DT, false>(rule, static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0, bfull - b, srw, k0,
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
        if (mx_block_direct<ET, DT, G, false>(rule, src, {.codes = codes, .sb = &sb, .keep = o.mask_row ? keep : nullptr}, qa)) {
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
  if (p.e5m3()) return quantize_e5m3(p, x, out);
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
