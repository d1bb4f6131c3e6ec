// qdq on the fast CPU path: full blocks of the amax rules straight from x to y (two passes), the rest
// staged. The block and chunk code is quantize's (mx_blocks.hpp, nvfp4_chunk.hpp, QDQ = true).
#include "cpu/quantize/mx_blocks.hpp"
#include "cpu/quantize/e5m3.hpp"
#include "cpu/quantize/nvfp4_chunk.hpp"

namespace mxq::cpu {
namespace {

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
          nvfp4_chunks_avx2<DT, true, true>(xrow + b * 16, n, p.S, *nv, yb, nullptr);
        else
          nvfp4_chunks_avx2<DT, false, true>(xrow + b * 16, n, p.S, *nv, yb, nullptr);
        b += 8 * n;
      }
#endif
      for (; !quest && b + 8 <= b1 && (b + 8) * 16 <= p.K; b += 8) {
        prefetch_ahead(xrow + b * 16, 128);
        nvfp4_blocks8<DT, true>(xrow + b * 16, p.S, *nv, static_cast<Storage<DT>*>(yrow) + b * 16, nullptr);
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
          nvfp4_chunk_sr_avx512<DT, true>(xrow + b * 16, p.S, *nv, srw.at(b * 16, 128), yb, nullptr);
          continue;
        }
        if (cpu_has_avx2()) {
          nvfp4_chunk_sr_avx2<DT, true>(xrow + b * 16, p.S, *nv, srw.at(b * 16, 128), yb, nullptr);
          continue;
        }
#endif
        nvfp4_blocks8<DT, true, true>(xrow + b * 16, p.S, *nv, yb, nullptr, srw.at(b * 16, 128));
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
          mx_block_direct<ET, DT, G, true>(rule, xrow + (b + j) * 32, {.y = static_cast<Storage<DT>*>(yrow) + (b + j) * 32}, qa + j);
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
            mx_sr_blocks_avx512<ET, DT, true>(rule, static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0, bfull - b, srw, k0,
                                              static_cast<Storage<DT>*>(yrow) + k0, nullptr);
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
        mx_block_direct<ET, DT, G, true>(rule, static_cast<const Storage<DT>*>(x.data) + r * x.stride() + k0,
                                         {.y = static_cast<Storage<DT>*>(yrow) + k0});
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
  if (p.e5m3()) return qdq_e5m3(p, x, y);
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
