// quantize on the fast CPU path: every format and rounding branch-free per element (fast_common.hpp).
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
      // narrow to bytes, then pack each little-endian byte pair c0 | c1 << 8 into c0 | c1 << 4: plain
      // lane-wise loops that vectorise (a stride-2 gather of the 32-bit codes does not)
      alignas(64) std::uint8_t c8[G];
      alignas(64) std::uint16_t c16[G / 2];
      for (int i = 0; i < G; ++i) c8[i] = static_cast<std::uint8_t>(codes[i] & 0xF);
      std::memcpy(c16, c8, G);
      for (int i = 0; i < G / 2; ++i) d[i] = static_cast<std::uint8_t>((c16[i] | (c16[i] >> 4)) & 0xFF);
    } else {
      for (std::int64_t i = 0; i < (n + 1) / 2; ++i)
        d[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
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
// branch-free helpers (mx_block_codes; NVFP4: nvfp4_encode_rne_readoff, or nvfp4_encode_sr), the
// stochastic comparison words one Philox call per counter (sr_words). Bit-exact with the scalar codec.
template <ElemType ET, DType DT, int G>
MXQ_CLONES void quantize_tile(const Problem& p, const Tensor& x, const Outs& o, const NvTables* nv, std::int64_t r,
                              std::int64_t b0, std::int64_t b1) {
  alignas(64) float xf[256];
  alignas(64) std::uint32_t codes[256], keep[256], rnd[256];
  constexpr FloatSpec f = Elem<ET>::spec;
  const int g = G ? G : p.g;
  const bool nv4 = p.nvfp4(), sr = p.stochastic;
  const ScaleRule rule = p.opt.rule;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    load_block<DT, G>(x, r, k0, p.K, p.g, xf);
    const std::uint32_t am = amax_bits<G>(xf, p.g);
    std::uint8_t sb;
    if (am >= 0x7F800000u) {  // a NaN or Inf: the NaN scale, zero codes
      sb = nv4 ? kE4M3NaN : kE8M0NaN;
      for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
    } else {
      if (sr) sr_words(p.opt.seed, std::uint64_t(p.opt.offset + r * p.K + k0), g, p.sr_bits, rnd);
      if (nv4) {
        // nvfp4_block_scale_code (e4m3_code_rne_sat: fastmath_test) and the table's multiplier
        const std::uint32_t sc = e4m3_code_rne_sat(div_rn(mul_rn(u2f(am), p.S), 6.0f));
        const float m = nv->m[sc];
        sb = static_cast<std::uint8_t>(sc);
        if (sr)
          for (int i = 0; i < g; ++i) codes[i] = nvfp4_encode_sr(f2u(xf[i]), m, rnd[i]);
        else
          for (int i = 0; i < g; ++i) codes[i] = nvfp4_code_rne_bf(f2u(xf[i]), m);
        if (o.mask_row)
          for (int i = 0; i < g; ++i) keep[i] = std::fabs(xf[i] * m) < 6.0f;
      } else {
        int e = -127;
        if (am != 0) e = mx_scale_exp(rule, u2f(am), rule == ScaleRule::quest ? quest_arg(xf, g) : 0.0f, f);
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
