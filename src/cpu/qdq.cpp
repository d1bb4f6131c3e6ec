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

// QDQ of one full block of G elements, straight from x to y.
template <ElemType ET, DType DT, int G>
MXQ_INLINE void qdq_block_direct(const Problem& p, const void* src, void* dst) {
  const Storage<DT>* s = static_cast<const Storage<DT>*>(src);
  Storage<DT>* d = static_cast<Storage<DT>*>(dst);
  std::uint32_t am = 0;
  for (int i = 0; i < G; ++i) am = std::max(am, abs_f32_bits<DT>(s[i]));
  if (am >= 0x7F800000u) {
    for (int i = 0; i < G; ++i) d[i] = static_cast<Storage<DT>>(nan_bits(DT));
    return;
  }
  const int e = am ? mx_scale_exp(p.opt.rule, u2f(am), 0.0f, Elem<ET>::spec) : -127;
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

template <ElemType ET, DType DT, int G>
MXQ_CLONES void qdq_tile(const Problem& p, const Tensor& x, const Tensor& y, std::int64_t r, std::int64_t b0,
                         std::int64_t b1) {
  alignas(64) float xf[256];
  alignas(64) std::uint32_t out[256], codes[256], keep[256];
  void* yrow = row_ptr(y, r);
  const bool vec = !p.stochastic && !p.nvfp4();
  // Full blocks of the amax rules in bf16/f32 run in two passes over the source (amax, then
  // round-and-store straight into y); everything else goes through the xf staging buffer.
  const bool direct = vec && G != 0 && DT != DType::f16 && p.opt.rule != ScaleRule::quest &&
                      p.opt.rule != ScaleRule::qutlass_absmax;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    if constexpr (G != 0 && DT != DType::f16) {
      if (direct && n == G) {
        qdq_block_direct<ET, DT, G>(p, static_cast<const char*>(x.data) + (r * x.stride() + k0) * dtype_size(DT),
                                    static_cast<char*>(yrow) + k0 * dtype_size(DT));
        continue;
      }
    }
    load_block<DT, G>(x, r, k0, p.K, p.g, xf);
    if (vec) {
      const int g = G ? G : p.g;
      const int e = mx_block_exp<G>(p, xf);
      if (e == 128) {
        for (int i = 0; i < g; ++i) out[i] = nan_bits(DT);
      } else {
        const float inv = pow2f(-e), scale = pow2f(e);
        for (int i = 0; i < g; ++i) {
          const float r = rne_mag<ET>(xf[i], inv);
          const float v = r * scale;  // exact, or +Inf past FLT_MAX
          std::uint32_t sign = f2u(xf[i]) >> 31;
          if constexpr (Elem<ET>::spec.twos_complement) sign &= r != 0.0f;  // INT8 has no -0
          out[i] = out_mag_bits<DT>(v) | (sign << (DT == DType::f32 ? 31 : 15));
        }
      }
    } else {
      std::uint8_t sb;
      quantize_block_scalar(p, r, b, xf, codes, sb, keep);
      for (int i = 0; i < n; ++i)
        out[i] = p.nvfp4() ? f32_to_dtype_bits(nvfp4_decode(codes[i], sb, p.S), DT) : mx_dequant_bits(codes[i], sb, p.elem, DT);
    }
    store_out<DT>(yrow, k0, n, out);
  }
}

}  // namespace

void qdq(const Problem& p, const Tensor& x, const Tensor& y) {
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_group(p.g, [&](auto gc) {
        parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
          qdq_tile<decltype(et)::value, decltype(dt)::value, decltype(gc)::value>(p, x, y, r, b0, b1);
        });
      });
    });
  });
}

}  // namespace mxq::cpu
