// The CPU reference. Deliberately plain: one block at a time, one element at a time.
#include "cpu/reference/reference.hpp"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace mxq::ref {
namespace {

using namespace mxq::core;

std::uint8_t* byte_ptr(const Tensor& t, std::int64_t r, std::int64_t c) {
  return static_cast<std::uint8_t*>(t.data) + r * t.stride() + c;
}

void put_code(const Problem& p, const Tensor& codes, std::int64_t r, std::int64_t k, std::uint32_t code) {
  if (p.fp4) {
    std::uint8_t* b = byte_ptr(codes, r, k / 2);
    if (k % 2 == 0)
      *b = static_cast<std::uint8_t>((*b & 0xF0) | (code & 0xF));
    else
      *b = static_cast<std::uint8_t>((*b & 0x0F) | ((code & 0xF) << 4));
  } else {
    *byte_ptr(codes, r, k) = static_cast<std::uint8_t>(code);
  }
}

std::uint32_t get_code(const Problem& p, const Tensor& codes, std::int64_t r, std::int64_t k) {
  if (p.fp4) {
    const std::uint8_t b = *byte_ptr(codes, r, k / 2);
    return k % 2 == 0 ? (b & 0xF) : (b >> 4);
  }
  return *byte_ptr(codes, r, k);
}

// nvfp4_e5m3 (docs/numerics.md, "NVFP4 with UE5M3 scales"): per block, amax as torch computes it (a NaN
// anywhere makes it NaN), s = UE5M3_RNE_sat(amax / 6), each element E2M1_RNE_sat(x / s) (+0 when s is 0;
// a NaN element, which no code can hold, code 0). The mask is zeroed by quantize.
void quantize_e5m3(const Problem& p, const Tensor& x, const QuantizedOut& out) {
  const int g = p.g;
  std::vector<float> v(g);
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t b = 0; b < p.nblocks; ++b) {
      float amax = 0.0f;
      bool nan = false;
      for (int i = 0; i < g; ++i) {
        const std::int64_t k = b * g + i;
        v[i] = k < p.K ? load_f32(x, r, k) : 0.0f;
        if (std::isnan(v[i])) nan = true;
        else amax = std::fmax(amax, std::fabs(v[i]));
      }
      const std::uint32_t sc = ue5m3_block_scale_code(nan ? std::nanf("") : amax);
      const float s = ue5m3_decode(sc);
      for (int i = 0; i < g && b * g + i < p.K; ++i) {
        const std::int64_t k = b * g + i;
        put_code(p, out.codes, r, k, std::isnan(v[i]) ? 0u : nvfp4_e5m3_encode(f2u(v[i]), sc));
        // not clipped: |x / s| < 6, or a zero scale (whose elements all quantize to 0); never NaN or Inf
        if (out.clip_mask.data && std::isfinite(v[i]) && (s == 0.0f || std::fabs(v[i] / s) < 6.0f))
          *byte_ptr(out.clip_mask, r, k / 8) |= 1u << (k % 8);
      }
      static_cast<std::uint8_t*>(out.scales.data)[p.scale_offset(r, b, out.scales.stride())] = static_cast<std::uint8_t>(sc);
    }
  }
}

// code x scale in fp32 (exact), then to y's dtype: fp16 overflows to Inf (the plugin's cast), bf16 is exact.
std::uint32_t e5m3_out(std::uint32_t code, std::uint32_t sc, DType t) {
  const float v = nvfp4_e5m3_decode(code, sc);
  if (t == DType::f16) return f32_to_f16_rn(f2u(v));
  if (t == DType::bf16) return f32_to_bf16_sat(f2u(v));
  return f2u(v);
}

}  // namespace

float tensor_amax(const Tensor& x) {
  float amax = 0.0f;
  bool nan = false;
  for (std::int64_t r = 0; r < x.rows; ++r)
    for (std::int64_t c = 0; c < x.cols; ++c) {
      const float v = load_f32(x, r, c);
      if (std::isnan(v)) nan = true;
      else if (std::fabs(v) > amax) amax = std::fabs(v);
    }
  return nan ? std::nanf("") : amax;
}

void quantize(const Problem& p, const Tensor& x, const QuantizedOut& out) {
  const int g = p.g;
  const std::uint32_t max_bits = max_value_bits(p.elem);
  const bool write_mask = out.clip_mask.data != nullptr;

  // Zero the outputs first: FP4 nibbles of a padded K, swizzle padding and mask padding bits are 0.
  for (std::int64_t r = 0; r < out.codes.rows; ++r) std::memset(byte_ptr(out.codes, r, 0), 0, out.codes.cols);
  if (p.opt.scale_layout == ScaleLayout::swizzled)
    std::memset(out.scales.data, 0, p.scale_rows_padded * p.scale_cols_padded);
  if (write_mask)
    for (std::int64_t r = 0; r < out.clip_mask.rows; ++r)
      std::memset(byte_ptr(out.clip_mask, r, 0), 0, out.clip_mask.cols);

  if (p.e5m3()) return quantize_e5m3(p, x, out);
  std::vector<float> v(g);
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t b = 0; b < p.nblocks; ++b) {
      // Gather the block, zero-padded past K.
      bool finite = true;
      float amax = 0.0f;
      for (int i = 0; i < g; ++i) {
        const std::int64_t k = b * g + i;
        v[i] = k < p.K ? load_f32(x, r, k) : 0.0f;
        if (!std::isfinite(v[i])) finite = false;
        else amax = std::fmax(amax, std::fabs(v[i]));
      }

      std::uint8_t scale_byte;
      if (!finite) {
        // Non-finite block: NaN scale, zero codes, mask 0 (already zero).
        scale_byte = p.nvfp4() ? kE4M3NaN : kE8M0NaN;
      } else if (p.nvfp4()) {
        const std::uint32_t sc = p.nvfp4_quest() ? nvfp4_quest_scale_code(quest_arg(v.data(), g))
                                                 : nvfp4_block_scale_code(amax, p.S);
        const float m = nvfp4_multiplier(sc, p.S);
        scale_byte = static_cast<std::uint8_t>(sc);
        for (int i = 0; i < g && sc != kE4M3NaN; ++i) {  // a NaN quest statistic: as a non-finite block
          const std::int64_t k = b * g + i;
          if (k >= p.K) break;
          const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, p.opt.offset + r * p.K + k, p.sr_bits) : 0u;
          put_code(p, out.codes, r, k, nvfp4_encode(f2u(v[i]), m, p.stochastic, rnd));
          if (write_mask && std::fabs(v[i] * m) < 6.0f) *byte_ptr(out.clip_mask, r, k / 8) |= 1u << (k % 8);
        }
      } else {
        int e = -127;  // amax == 0: the smallest scale, all codes zero
        if (amax > 0.0f) {
          const float q = p.opt.rule == ScaleRule::quest ? quest_arg(v.data(), g) : 0.0f;
          e = mx_scale_exp(p.opt.rule, amax, q, p.elem);
        }
        scale_byte = static_cast<std::uint8_t>(e + kE8M0Bias);
        const double limit = std::ldexp(static_cast<double>(u2f(max_bits)), e);
        for (int i = 0; i < g; ++i) {
          const std::int64_t k = b * g + i;
          if (k >= p.K) break;
          // QuTLASS abs_max quantizes 3 * x (an fp32 multiplication) against the amax scale.
          const float xin = p.opt.rule == ScaleRule::qutlass_absmax ? 3.0f * v[i] : v[i];
          const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, p.opt.offset + r * p.K + k, p.sr_bits) : 0u;
          put_code(p, out.codes, r, k, encode_scaled(f2u(xin), e, p.elem, p.stochastic, rnd));
          if (write_mask && std::fabs(static_cast<double>(xin)) < limit)
            *byte_ptr(out.clip_mask, r, k / 8) |= 1u << (k % 8);
        }
      }
      static_cast<std::uint8_t*>(out.scales.data)[p.scale_offset(r, b, out.scales.stride())] = scale_byte;
    }
  }
}

void dequantize(const Problem& p, const QuantizedIn& q, const Tensor& y) {
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t k = 0; k < p.K; ++k) {
      const std::uint32_t code = get_code(p, q.codes, r, k);
      const std::uint8_t sb = static_cast<const std::uint8_t*>(q.scales.data)[p.scale_offset(r, k / p.g, q.scales.stride())];
      std::uint32_t bits;
      if (p.e5m3()) {
        bits = e5m3_out(code, sb, y.dtype);
      } else if (p.nvfp4()) {
        bits = f32_to_dtype_bits(nvfp4_decode(code, sb, p.S), y.dtype);
      } else {
        bits = mx_dequant_bits(code, sb, p.elem, y.dtype);
      }
      store_bits(y, r, k, bits);
    }
  }
}

void qdq(const Problem& p, const Tensor& x, const Tensor& y) {
  // Literally quantize, then dequantize.
  const std::int64_t cc = code_cols(p.opt.format, p.K);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(p.rows * cc));
  Problem lin = p;
  lin.opt.scale_layout = ScaleLayout::linear;
  std::vector<std::uint8_t> scales(static_cast<std::size_t>(p.rows * p.nblocks));
  QuantizedOut out;
  out.codes = Tensor::of(codes.data(), DType::u8, p.rows, cc);
  out.scales = Tensor::of(scales.data(), DType::u8, p.rows, p.nblocks);
  quantize(lin, x, out);
  // nvfp4_e5m3: a NaN input stays NaN (quantize cannot hold it; the plugin's QDQ keeps it). Noted before
  // dequantize writes y, which may be x itself.
  std::vector<std::pair<std::int64_t, std::int64_t>> nans;
  if (p.e5m3())
    for (std::int64_t r = 0; r < p.rows; ++r)
      for (std::int64_t k = 0; k < p.K; ++k)
        if (std::isnan(load_f32(x, r, k))) nans.emplace_back(r, k);
  dequantize(lin, QuantizedIn{out.codes, out.scales}, y);
  for (const auto& [r, k] : nans) store_bits(y, r, k, nan_bits(y.dtype));
}

void swizzle_scales(const Tensor& linear, const Tensor& swizzled) {
  std::memset(swizzled.data, 0, swizzled.rows * swizzled.cols);
  for (std::int64_t r = 0; r < linear.rows; ++r)
    for (std::int64_t c = 0; c < linear.cols; ++c)
      static_cast<std::uint8_t*>(swizzled.data)[swizzled_offset(r, c, swizzled.cols)] = *byte_ptr(linear, r, c);
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear) {
  for (std::int64_t r = 0; r < linear.rows; ++r)
    for (std::int64_t c = 0; c < linear.cols; ++c)
      *byte_ptr(linear, r, c) = static_cast<const std::uint8_t*>(swizzled.data)[swizzled_offset(r, c, swizzled.cols)];
}

}  // namespace mxq::ref
