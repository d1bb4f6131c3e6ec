// quantize on the fast CPU path: the MX round-to-nearest-even blocks branch-free, the rest by the scalar codec.
#include "cpu/fast_common.hpp"

namespace mxq::cpu {
namespace {

struct Outs {
  std::uint8_t* codes_row;
  std::uint8_t* scales;
  std::int64_t scale_stride;
  std::uint8_t* mask_row;
};

template <ElemType ET, int G>
MXQ_INLINE void quantize_block_rne(const Problem& p, float* xf, std::uint32_t* codes, std::uint8_t& scale_byte,
                                   std::uint32_t* keep) {
  const int g = G ? G : p.g;
  const int e = mx_block_exp<G>(p, xf);
  if (e == 128) {
    scale_byte = kE8M0NaN;
    for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
    return;
  }
  scale_byte = static_cast<std::uint8_t>(e + kE8M0Bias);
  const float inv = pow2f(-e), maxv = u2f(max_value_bits(Elem<ET>::spec));
  for (int i = 0; i < g; ++i) {
    const float r = rne_mag<ET>(xf[i], inv);
    codes[i] = code_of<ET>(r, f2u(xf[i]) >> 31);
    keep[i] = std::fabs(xf[i]) * inv < maxv;
  }
}

MXQ_INLINE void store_codes(const Problem& p, std::uint8_t* row, std::int64_t k0, std::int64_t n, const std::uint32_t* codes) {
  if (p.fp4) {
    std::uint8_t* d = row + k0 / 2;
    for (std::int64_t i = 0; i < (n + 1) / 2; ++i)
      d[i] = static_cast<std::uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
  } else {
    for (std::int64_t i = 0; i < n; ++i) row[k0 + i] = static_cast<std::uint8_t>(codes[i]);
  }
}

MXQ_INLINE void store_mask(std::uint8_t* row, std::int64_t k0, std::int64_t n, const std::uint32_t* keep) {
  // k0 is a multiple of g >= 2; bits are ORed in because small groups share a byte.
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t k = k0 + i;
    if (keep[i]) row[k / 8] |= static_cast<std::uint8_t>(1u << (k % 8));
  }
}

template <ElemType ET, DType DT, int G>
MXQ_CLONES void quantize_tile(const Problem& p, const Tensor& x, const Outs& o, std::int64_t r, std::int64_t b0,
                              std::int64_t b1) {
  alignas(64) float xf[256];
  alignas(64) std::uint32_t codes[256], keep[256];
  const bool vec = !p.stochastic && !p.nvfp4();
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    load_block<DT, G>(x, r, k0, p.K, p.g, xf);
    std::uint8_t sb;
    if (vec)
      quantize_block_rne<ET, G>(p, xf, codes, sb, keep);
    else
      quantize_block_scalar(p, r, b, xf, codes, sb, keep);
    o.scales[p.scale_offset(r, b, o.scale_stride)] = sb;
    store_codes(p, o.codes_row, k0, n, codes);
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
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_group(p.g, [&](auto gc) {
        parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
          Outs o{static_cast<std::uint8_t*>(out.codes.data) + r * out.codes.stride(),
                 static_cast<std::uint8_t*>(out.scales.data), out.scales.stride(),
                 out.clip_mask.data ? static_cast<std::uint8_t*>(out.clip_mask.data) + r * out.clip_mask.stride() : nullptr};
          quantize_tile<decltype(et)::value, decltype(dt)::value, decltype(gc)::value>(p, x, o, r, b0, b1);
        });
      });
    });
  });
}

}  // namespace mxq::cpu
