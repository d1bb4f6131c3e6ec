// The fast CPU path.
//
// Work is split into tiles of (one row, up to kTileBlocks blocks) and spread over OpenMP threads;
// every tile is independent, so results do not depend on the thread count. Inside a block the MX
// round-to-nearest-even path is branch-free fp32/int32 code that the compiler vectorises (an AVX2
// clone is selected at run time where the CPU has it):
//   a = |x| * 2^-e                       exact, or an underflow far below the element grid
//   r = (a + C) - C, C = 1.5 * 2^(q+23)  RNE onto the grid of quantum 2^q (q from a's binade)
//   r = min(r, max_elem)                 saturation
// Stochastic rounding, NVFP4 and blocks holding NaN/Inf element codes use the shared scalar codec.
#include "cpu/fast.hpp"

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(MXQ_HAVE_OPENMP)
#include <omp.h>
#endif

namespace mxq::cpu {
namespace {

using namespace mxq::core;

constexpr std::int64_t kTileBlocks = 64;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MXQ_CLONES
#endif
#define MXQ_INLINE [[gnu::always_inline]] inline

template <class F>
void parallel_tiles(std::int64_t rows, std::int64_t nblocks, F&& f) {
  const std::int64_t per_row = (nblocks + kTileBlocks - 1) / kTileBlocks;
  const std::int64_t n = rows * per_row;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (n > 1)
#endif
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t r = t / per_row, b0 = (t % per_row) * kTileBlocks;
    f(r, b0, std::min(nblocks, b0 + kTileBlocks));
  }
}

// ---- loads and stores ----------------------------------------------------------------------------------
// G is the group size when known at compile time (0: use g). DT is the input dtype.
template <DType DT, int G>
MXQ_INLINE void load_block(const Tensor& x, std::int64_t r, std::int64_t k0, std::int64_t K, int g_rt, float* xf) {
  const int g = G ? G : g_rt;
  const std::int64_t n = std::min<std::int64_t>(g, K - k0);
  const std::int64_t base = r * x.stride() + k0;
  if constexpr (DT == DType::bf16) {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = u2f(std::uint32_t(s[i]) << 16);
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? u2f(std::uint32_t(s[i]) << 16) : 0.0f;
  } else if constexpr (DT == DType::f32) {
    const float* s = static_cast<const float*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = s[i];
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? s[i] : 0.0f;
  } else {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    for (int i = 0; i < g; ++i) xf[i] = i < n ? f16_to_f32(s[i]) : 0.0f;
  }
}

// Max of |x| as bits: >= 0x7F800000 means the block holds a NaN or Inf.
template <int G = 0>
MXQ_INLINE std::uint32_t amax_bits(const float* xf, int g_rt) {
  const int g = G ? G : g_rt;
  std::uint32_t m = 0;
  for (int i = 0; i < g; ++i) m = std::max(m, f2u(xf[i]) & 0x7FFFFFFFu);
  return m;
}

template <DType OUT>
MXQ_INLINE void store_out(void* row, std::int64_t k0, std::int64_t n, const std::uint32_t* bits) {
  if constexpr (OUT == DType::f32) {
    std::memcpy(static_cast<std::uint32_t*>(row) + k0, bits, n * 4);
  } else {
    std::uint16_t* d = static_cast<std::uint16_t*>(row) + k0;
    for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<std::uint16_t>(bits[i]);
  }
}

MXQ_INLINE void* row_ptr(const Tensor& t, std::int64_t r) {
  return static_cast<char*>(t.data) + r * t.stride() * dtype_size(t.dtype);
}

// ---- the MX block scale -----------------------------------------------------------------------------------
// Returns the scale exponent, or 128 for a non-finite block. Applies the abs_max pre-multiplier.
template <int G>
MXQ_INLINE int mx_block_exp(const Problem& p, float* xf) {
  const std::uint32_t am = amax_bits<G>(xf, p.g);
  if (am >= 0x7F800000u) return 128;
  int e = -127;
  if (am != 0) {
    const float q = p.opt.rule == ScaleRule::quest ? quest_arg(xf, p.g) : 0.0f;
    e = mx_scale_exp(p.opt.rule, u2f(am), q, p.elem);
  }
  if (p.opt.rule == ScaleRule::qutlass_absmax)
    for (int i = 0; i < p.g; ++i) xf[i] = 3.0f * xf[i];
  return e;
}

// ---- per-tile workers ---------------------------------------------------------------------------------------
struct Outs {
  std::uint8_t* codes_row;
  std::uint8_t* scales;
  std::int64_t scale_stride;
  std::uint8_t* mask_row;
};

// Scalar-codec block quantizer (stochastic rounding, NVFP4): exactly the reference's arithmetic.
MXQ_INLINE void quantize_block_scalar(const Problem& p, std::int64_t r, std::int64_t b, float* xf, std::uint32_t* codes,
                                      std::uint8_t& scale_byte, std::uint32_t* keep) {
  const int g = p.g;
  const std::uint32_t am = amax_bits<0>(xf, g);
  if (am >= 0x7F800000u) {
    scale_byte = p.nvfp4() ? kE4M3NaN : kE8M0NaN;
    for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
    return;
  }
  const std::int64_t j0 = p.opt.offset + r * p.K + b * g;
  if (p.nvfp4()) {
    const std::uint32_t sc = nvfp4_block_scale_code(u2f(am), p.S);
    const float m = nvfp4_multiplier(sc, p.S);
    scale_byte = static_cast<std::uint8_t>(sc);
    for (int i = 0; i < g; ++i) {
      const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, j0 + i) : 0u;
      codes[i] = nvfp4_encode(f2u(xf[i]), m, p.stochastic, rnd);
      keep[i] = std::fabs(xf[i] * m) < 6.0f;
    }
    return;
  }
  const int e = mx_block_exp<0>(p, xf);
  scale_byte = static_cast<std::uint8_t>(e + kE8M0Bias);
  const float inv = pow2f(-e), maxv = u2f(max_value_bits(p.elem));
  for (int i = 0; i < g; ++i) {
    const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, j0 + i) : 0u;
    codes[i] = encode_scaled(f2u(xf[i]), e, p.elem, p.stochastic, rnd);
    keep[i] = std::fabs(xf[i]) * inv < maxv;
  }
}

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

// The fp32 value / |bits| in fp32 bit positions of a dtype's storage word (core::Storage).
template <DType DT>
MXQ_INLINE std::uint32_t abs_f32_bits(Storage<DT> v) {
  if constexpr (DT == DType::f32) return v & 0x7FFFFFFFu;
  else return std::uint32_t(v & 0x7FFFu) << 16;  // bf16
}
template <DType DT>
MXQ_INLINE float to_f32(Storage<DT> v) {
  if constexpr (DT == DType::f32) return u2f(v);
  else return u2f(std::uint32_t(v) << 16);
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

// ---- dispatch: runtime enums -> template parameters ------------------------------------------------------------

// Group size 32 (every MX format's default) is compiled with a constant trip count; others run the
// same code with a runtime count.
template <class F>
void dispatch_group(int g, F&& f) {
  if (g == 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 0>{});
}

}  // namespace

int max_threads() {
#if defined(MXQ_HAVE_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

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

void swizzle_scales(const Tensor& linear, const Tensor& swizzled) {
  std::uint8_t* d = static_cast<std::uint8_t*>(swizzled.data);
  const std::uint8_t* s = static_cast<const std::uint8_t*>(linear.data);
  const std::int64_t R = swizzled.rows, C = swizzled.cols;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (R > 512)
#endif
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c)
      d[swizzled_offset(r, c, C)] = (r < linear.rows && c < linear.cols) ? s[r * linear.stride() + c] : 0;
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear) {
  const std::uint8_t* s = static_cast<const std::uint8_t*>(swizzled.data);
  std::uint8_t* d = static_cast<std::uint8_t*>(linear.data);
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (linear.rows > 512)
#endif
  for (std::int64_t r = 0; r < linear.rows; ++r)
    for (std::int64_t c = 0; c < linear.cols; ++c) d[r * linear.stride() + c] = s[swizzled_offset(r, c, swizzled.cols)];
}

float tensor_amax(const Tensor& x) {
  std::uint32_t m = 0;
  const std::int64_t K = x.cols;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) reduction(max : m)
#endif
  for (std::int64_t r = 0; r < x.rows; ++r) {
    alignas(64) float xf[256];
    for (std::int64_t k0 = 0; k0 < K; k0 += 256) {
      if (x.dtype == DType::bf16) load_block<DType::bf16, 256>(x, r, k0, K, 256, xf);
      else if (x.dtype == DType::f32) load_block<DType::f32, 256>(x, r, k0, K, 256, xf);
      else load_block<DType::f16, 256>(x, r, k0, K, 256, xf);
      m = std::max(m, amax_bits<256>(xf, 256));
    }
  }
  // NaN bits compare above +Inf bits, so a NaN anywhere gives NaN, else an Inf gives Inf.
  return u2f(m);
}

}  // namespace mxq::cpu
