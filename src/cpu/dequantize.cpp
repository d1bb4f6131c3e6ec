// dequantize on the fast CPU path: codes through a decode table, special blocks by the scalar codec.
#include "cpu/fast_common.hpp"

namespace mxq::cpu {
namespace {

// Element decode table: exact fp32 value of every code, and whether the code is NaN/Inf.
struct DecodeLut {
  float v[256];
  bool special[256];
};
DecodeLut make_lut(const FloatSpec& f) {
  DecodeLut l{};
  const int n = f.bits == 4 ? 16 : (f.bits == 6 ? 64 : 256);
  for (int c = 0; c < n; ++c) {
    std::uint32_t s = 0, m = 0;
    int pe = 0;
    l.special[c] = !decode_parts(std::uint32_t(c), f, s, m, pe);
    l.v[c] = l.special[c] ? 0.0f : decode_f32(std::uint32_t(c), f);
  }
  for (int c = n; c < 256; ++c) l.special[c] = true;  // stray high bits of a 6-bit code
  return l;
}

template <ElemType ET, DType DT>
MXQ_CLONES void dequantize_tile(const Problem& p, const QuantizedIn& q, const Tensor& y, const DecodeLut& lut,
                                std::int64_t r, std::int64_t b0, std::int64_t b1) {
  alignas(64) std::uint32_t codes[256], out[256];
  const std::uint8_t* crow = static_cast<const std::uint8_t*>(q.codes.data) + r * q.codes.stride();
  const std::uint8_t* scales = static_cast<const std::uint8_t*>(q.scales.data);
  void* yrow = row_ptr(y, r);
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    if (p.fp4) {
      for (std::int64_t i = 0; i < n; ++i) codes[i] = (crow[(k0 + i) / 2] >> (4 * ((k0 + i) & 1))) & 0xF;
    } else {
      for (std::int64_t i = 0; i < n; ++i) codes[i] = crow[k0 + i];
    }
    const std::uint8_t sb = scales[p.scale_offset(r, b, q.scales.stride())];
    bool special = false;
    for (std::int64_t i = 0; i < n; ++i) special |= lut.special[codes[i]];
    if (p.nvfp4()) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = f32_to_dtype_bits(nvfp4_decode(codes[i], sb, p.S), DT);
    } else if (sb == kE8M0NaN || special) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = mx_dequant_bits(codes[i], sb, p.elem, DT);
    } else {
      const float scale = pow2f(int(sb) - kE8M0Bias);
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = lut.v[codes[i]] * scale;
        out[i] = out_mag_bits<DT>(std::fabs(v)) | ((f2u(v) >> 31) << (DT == DType::f32 ? 31 : 15));
      }
    }
    store_out<DT>(yrow, k0, n, out);
  }
}

}  // namespace

void dequantize(const Problem& p, const QuantizedIn& q, const Tensor& y) {
  const DecodeLut lut = make_lut(p.elem);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(y.dtype, [&](auto dt) {
      parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
        dequantize_tile<decltype(et)::value, decltype(dt)::value>(p, q, y, lut, r, b0, b1);
      });
    });
  });
}

}  // namespace mxq::cpu
