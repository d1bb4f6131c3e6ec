// dequantize on the fast CPU path: codes decoded branch-free, blocks with NaN/Inf codes by the scalar codec.
#include <bit>
#include <vector>

#include "cpu/common/elements.hpp"
#include "cpu/common/fp4_lookup.hpp"
#include "cpu/common/nvfp4_scale.hpp"
#include "cpu/quantize/e5m3.hpp"
#include "cpu/common/vector_io.hpp"

namespace mxq::cpu {
namespace {

// Whether a block's codes hold a NaN/Inf code (E4M3 S.1111.111, E5M2 S.11111.xx), or, for the 6-bit
// formats, stray high bits: those blocks take the scalar codec.
template <ElemType ET>
MXQ_INLINE bool any_special(const std::uint32_t* codes, int n) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.bits == 4 || f.twos_complement) {
    return false;
  } else {
    // 8-bit: a magnitude past the largest finite one; 6-bit: any bit above the code's six
    constexpr std::uint32_t mmask = f.bits == 8 ? 0x7Fu : 0xFFu, limit = f.bits == 8 ? f.maxcode : 0x3Fu;
    std::uint32_t bad = 0;
    for (int i = 0; i < n; ++i) bad |= std::uint32_t((codes[i] & mmask) > limit);
    return bad != 0;
  }
}

// any_special over n code bytes at once: the largest magnitude against the limit (one max per byte).
template <ElemType ET>
MXQ_INLINE bool any_special_bytes(const std::uint8_t* c, std::int64_t n) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.bits == 4 || f.twos_complement) {
    return false;
  } else {
    constexpr std::uint8_t mmask = f.bits == 8 ? 0x7F : 0xFF, limit = f.bits == 8 ? std::uint8_t(f.maxcode) : 0x3F;
    std::uint8_t m = 0;
    for (std::int64_t i = 0; i < n; ++i) m = std::max<std::uint8_t>(m, c[i] & mmask);
    return m > limit;
  }
}

// The exact fp32 value of a finite element code (decode_f32), branch-free: a normal code's bits
// placed in an fp32 with the exponent rebiased; a subnormal's integer mantissa times its quantum;
// INT8 its integer times 2^-6.
template <ElemType ET>
MXQ_INLINE float decode_value(std::uint32_t code) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) {
    return float(std::int32_t(std::int8_t(std::uint8_t(code)))) * 0.015625f;
  } else {
    constexpr std::uint32_t smask = (1u << (f.bits - 1)) - 1u;
    constexpr float quantum = std::bit_cast<float>(std::uint32_t(f.emin - f.mbits + 127) << 23);  // 2^(emin - mbits)
    const std::uint32_t mag = code & smask;
    const std::uint32_t normal = (mag << (23 - f.mbits)) + (std::uint32_t(f.emin - 1 + 127) << 23);
    const std::uint32_t sub = f2u(float(std::int32_t(mag)) * quantum);
    return u2f(bsel(mag < (1u << f.mbits), sub, normal) | (((code >> (f.bits - 1)) & 1u) << 31));
  }
}

// The output bits (DT's, hi16 form) of a finite MX code under scale 2^e: the element value x 2^e, exact
// (the values have at most 8 significant bits and stay above 2^-149) or +Inf past FLT_MAX, which
// out_mag_bits saturates.
template <ElemType ET, DType DT>
MXQ_INLINE std::uint32_t finite_code_bits(std::uint32_t code, float scale) {
  const float v = decode_value<ET>(code) * scale;
  return out_mag_bits<DT>(fabs_bits(v)) | ((f2u(v) >> 31) << (DT == DType::f32 ? 31 : 15));
}

// Whether every finite code of ET times 2^e is exactly a normal fp32 (or zero): the largest value's
// exponent emax + e at most 127, the smallest subnormal's emin - mbits + e at least -126 (INT8: its
// integer times 2^(e - 6), at most 7 bits).
template <ElemType ET>
constexpr bool decode_exact(int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) return e - 6 >= -126 && e - 6 + 7 <= 127;
  else return e + f.emax <= 127 && e + f.emin - f.mbits >= -126;
}
// decode_value(code) * 2^e as fp32 bits where decode_exact(e): a normal code's bits with the exponent
// rebiased by e; a subnormal code's integer mantissa times 2^(emin - mbits + e); INT8 its integer times
// 2^(e - 6).
template <ElemType ET>
MXQ_INLINE std::uint32_t scaled_code_bits(std::uint32_t code, int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) {
    return f2u(float(std::int32_t(std::int8_t(std::uint8_t(code)))) * u2f(std::uint32_t(e - 6 + 127) << 23));
  } else {
    constexpr std::uint32_t smask = (1u << (f.bits - 1)) - 1u;
    const std::uint32_t mag = code & smask;
    const std::uint32_t normal = (mag << (23 - f.mbits)) + (std::uint32_t(f.emin - 1 + 127 + e) << 23);
    const std::uint32_t sub = f2u(float(std::int32_t(mag)) * u2f(std::uint32_t(f.emin - f.mbits + e + 127) << 23));
    return bsel(mag < (1u << f.mbits), sub, normal) | (((code >> (f.bits - 1)) & 1u) << 31);
  }
}

// NVFP4: the output bits of every (scale byte, E2M1 magnitude) pair, nvfp4_decode's arithmetic
// ((E2M1 value * s) / S, each operation rounded once, then to DT) done once per pair instead of once
// per element. A negative code is the same computation on -value: RN is symmetric, so the result is
// the pair's with its sign flipped (zeros and infinities too), an XOR of DT's sign bit.
template <DType DT>
std::vector<std::uint32_t> nvfp4_decode_table(const NvTables& nv, float S) {
  std::vector<std::uint32_t> t(256 * 8);
  for (int sb = 0; sb < 256; ++sb)
    for (std::uint32_t mag = 0; mag < 8; ++mag)
      t[std::size_t(sb) * 8 + mag] = to_dtype_bits_nonnan_bf<DT>(div_rn(mul_rn(e2m1_value_bf(mag), nv.sval[sb]), S));
  return t;
}

// MXFP4: the output bits of every (scale byte, E2M1 magnitude) pair, the per-element arithmetic of
// dequantize_tile below (the value times 2^e, out_mag_bits) done once per pair; the sign as for NVFP4.
// The NaN scale byte's entries are unused (its blocks are NaN).
template <DType DT>
std::vector<std::uint32_t> mxfp4_decode_table() {
  std::vector<std::uint32_t> t(256 * 8);
  for (int sb = 0; sb < 256; ++sb) {
    const float scale = pow2f(sb - kE8M0Bias);
    for (std::uint32_t mag = 0; mag < 8; ++mag)
      t[std::size_t(sb) * 8 + mag] = out_mag_bits<DT>(fabs_bits(decode_value<ElemType::e2m1>(mag) * scale));
  }
  return t;
}

// NVFP4's full blocks of 16: each element's output bits picked from its scale byte's eight table
// entries by a lane shuffle (GCC's generic vectors: one permute of eight 32-bit lanes on AVX2 and
// above) instead of a load per element; the NaN scale gives NaN everywhere, as below.
typedef std::uint32_t v8u __attribute__((vector_size(32)));
template <DType DT>
MXQ_INLINE void nvfp4_dequant_block16(const std::uint8_t* c, std::uint8_t sb, const std::uint32_t* nvt, std::uint32_t* out) {
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  v8u t;
  std::memcpy(&t, nvt + std::size_t(sb) * 8, sizeof t);
  // element i of a little-endian 32-bit word of codes is its nibble i
  static_assert(std::endian::native == std::endian::little, "the NVFP4 codes are read as little-endian words");
  std::uint32_t w0, w1;
  std::memcpy(&w0, c, 4);
  std::memcpy(&w1, c + 4, 4);
  const v8u sh = {0, 4, 8, 12, 16, 20, 24, 28}, fifteen = {15, 15, 15, 15, 15, 15, 15, 15};
  const v8u lo = ((v8u{} + w0) >> sh) & fifteen, hi = ((v8u{} + w1) >> sh) & fifteen;
  const v8u seven = {7, 7, 7, 7, 7, 7, 7, 7};
  v8u a = __builtin_shuffle(t, lo & seven) ^ (((lo >> 3) & 1u) << kSignBit);
  v8u b = __builtin_shuffle(t, hi & seven) ^ (((hi >> 3) & 1u) << kSignBit);
  const std::uint32_t nanm = 0u - std::uint32_t((sb & 0x7F) == kE4M3NaN);
  const v8u nan = {nan_bits(DT), nan_bits(DT), nan_bits(DT), nan_bits(DT), nan_bits(DT), nan_bits(DT), nan_bits(DT), nan_bits(DT)};
  a = (a & ~nanm) | (nan & nanm);
  b = (b & ~nanm) | (nan & nanm);
  std::memcpy(out, &a, sizeof a);
  std::memcpy(out + 8, &b, sizeof b);
}

#if defined(MXQ_CPU_AVX2)
// The same per block with AVX2 (nvfp4_store16_avx2), for nb consecutive runs of 16 elements of a row
// (an NVFP4 block each; MXFP4: half or all of one, its scale byte repeated): codes c, scale bytes sb[]
// (one per run), outputs y; MX: MXFP4's table and NaN scale byte (0xFF), else NVFP4's (S.1111.111).
// Called only where the CPU has AVX2.
template <DType DT, bool MX>
__attribute__((target("avx2"))) void fp4_dequant_blocks_avx2(const std::uint8_t* c, const std::uint8_t* sb, int nb,
                                                            const std::uint32_t* nvt, Storage<DT>* y) {
  const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), f15 = _mm256_set1_epi32(15);
  for (int j = 0; j < nb; ++j) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nvt + std::size_t(sb[j]) * 8));
    std::uint32_t w0, w1;
    std::memcpy(&w0, c + 8 * j, 4);
    std::memcpy(&w1, c + 8 * j + 4, 4);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(w0)), sh), f15);
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(w1)), sh), f15);
    nvfp4_store16_avx2<DT>(t, lo, hi, MX ? sb[j] != kE8M0NaN : (sb[j] & 0x7F) != kE4M3NaN, y + 16 * j);
  }
}
#endif

template <ElemType ET, DType DT, int G>
MXQ_CLONES void dequantize_tile(const Problem& p, const QuantizedIn& q, const Tensor& y, const std::uint32_t* nvt,
                                std::int64_t r, std::int64_t b0, std::int64_t b1) {
  alignas(64) std::uint32_t codes[256], out[256];
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  const std::uint8_t* crow = static_cast<const std::uint8_t*>(q.codes.data) + r * q.codes.stride();
  const std::uint8_t* scales = static_cast<const std::uint8_t*>(q.scales.data);
  void* yrow = row_ptr(y, r);
  const bool nv4 = p.nvfp4();
  const int g = G ? G : p.g;
  std::int64_t b = b0;
#if defined(MXQ_CPU_AVX2)
  if constexpr (ET == ElemType::e2m1 && (G == 16 || G == 32)) {
    if (cpu_has_avx2()) {  // the tile's full blocks in one call
      constexpr int R = G / 16;  // runs of 16 elements per block
      const std::int64_t full = std::min(b1, p.K / G);
      if (full > b) {
        alignas(64) std::uint8_t sb[kTileBlocks * R];
        // the scale bytes by runs (four columns of a swizzled tile), as store_scales writes them
        // NOTE: written out, not a helper beside store_scales: calling one here made GCC compile this
        // template's MXFP8 instantiation 1.8x slower (measured 2026-12-04, GCC, an AMD EPYC core).
        for (std::int64_t j = b; j < full;) {
          const std::int64_t k = (j % 4 == 0 && j + 4 <= full) ? 4 : 1;
          std::memcpy(sb + (j - b), scales + p.scale_offset(r, j, q.scales.stride()), std::size_t(k));
          j += k;
        }
        if constexpr (R == 2)  // each MXFP4 block's byte for both of its runs
          for (std::int64_t j = full - b - 1; j >= 0; --j) sb[2 * j + 1] = sb[2 * j] = sb[j];
        Storage<DT>* yb = static_cast<Storage<DT>*>(yrow) + b * G;
        if (nv4)
          fp4_dequant_blocks_avx2<DT, false>(crow + b * G / 2, sb, int(full - b) * R, nvt, yb);
        else
          fp4_dequant_blocks_avx2<DT, true>(crow + b * G / 2, sb, int(full - b) * R, nvt, yb);
        b = full;
      }
    }
  }
#endif
  if constexpr (f.bits != 4 && G != 0) {
    // One code per byte (FP8, FP6, INT8), full blocks: when no code of the tile's full blocks is a
    // NaN/Inf code (one byte-wise scan of the run instead of a reduction per block), each block
    // decodes straight from its bytes: no staging copy, no per-block test.
    const std::int64_t full = std::min(b1, p.K / G);
    if (full > b && !any_special_bytes<ET>(crow + b * G, (full - b) * G)) {
      Storage<DT>* yb = static_cast<Storage<DT>*>(yrow);
      for (; b < full; ++b) {
        const std::uint8_t* c = crow + b * G;
        const std::uint8_t sb = scales[p.scale_offset(r, b, q.scales.stride())];
        if (sb == kE8M0NaN) {
          for (int i = 0; i < G; ++i) yb[b * G + i] = static_cast<Storage<DT>>(nan_bits(DT));
          continue;
        }
        const int e = int(sb) - kE8M0Bias;
        if (DT != DType::f16 && decode_exact<ET>(e)) {
          // Every value x 2^e is a normal fp32 with at most 8 significant bits (or zero): its bits are
          // the code's with the exponent rebiased by e (a subnormal code's mantissa times its quantum
          // 2^(emin - mbits + e), a normal fp32), and bf16 takes their top half exactly.
          for (int i = 0; i < G; ++i) {
            const std::uint32_t bits = scaled_code_bits<ET>(c[i], e);
            yb[b * G + i] = static_cast<Storage<DT>>(DT == DType::f32 ? bits : bits >> 16);
          }
          continue;
        }
        const float scale = pow2f(e);
        for (int i = 0; i < G; ++i) yb[b * G + i] = static_cast<Storage<DT>>(finite_code_bits<ET, DT>(c[i], scale));
      }
    }
  }
  for (; b < b1; ++b) {
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    if constexpr (ET == ElemType::e2m1 && G == 16) {
      if (nv4 && n == 16) {
        nvfp4_dequant_block16<DT>(crow + k0 / 2, scales[p.scale_offset(r, b, q.scales.stride())], nvt, out);
        store_out<DT>(yrow, k0, n, out);
        continue;
      }
    }
    // the block's codes, zeros past the end of a row
    if constexpr (f.bits == 4) {
      const std::uint8_t* c = crow + k0 / 2;
      if (G != 0 && n == G) {
        // spread each byte's nibbles into a little-endian byte pair, then widen: lane-wise loops
        alignas(64) std::uint16_t c16[G / 2];
        alignas(64) std::uint8_t c8[G];
        for (int i = 0; i < G / 2; ++i) c16[i] = static_cast<std::uint16_t>((c[i] & 0xFu) | (std::uint32_t(c[i] & 0xF0u) << 4));
        std::memcpy(c8, c16, G);
        for (int i = 0; i < G; ++i) codes[i] = c8[i];
      } else {
        for (int i = 0; i < g; ++i) codes[i] = i < n ? (c[i / 2] >> (4 * (i & 1))) & 0xFu : 0u;
      }
    } else {
      const std::uint8_t* c = crow + k0;
      if (G != 0 && n == G) {
        for (int i = 0; i < G; ++i) codes[i] = c[i];
      } else {
        for (int i = 0; i < g; ++i) codes[i] = i < n ? c[i] : 0u;
      }
    }
    const std::uint8_t sb = scales[p.scale_offset(r, b, q.scales.stride())];
    if (nv4) {
      if ((sb & 0x7F) == kE4M3NaN) {
        for (int i = 0; i < g; ++i) out[i] = nan_bits(DT);
      } else {
        // nvfp4_decode through the table of this scale byte's eight magnitudes
        const std::uint32_t* t = nvt + std::size_t(sb) * 8;
        for (int i = 0; i < g; ++i) out[i] = t[codes[i] & 7u] ^ (((codes[i] >> 3) & 1u) << kSignBit);
      }
    } else if (sb == kE8M0NaN) {
      for (int i = 0; i < g; ++i) out[i] = nan_bits(DT);
    } else if (any_special<ET>(codes, g)) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = mx_dequant_bits(codes[i], sb, f, DT);
    } else {
      const float scale = pow2f(int(sb) - kE8M0Bias);
      for (int i = 0; i < g; ++i) out[i] = finite_code_bits<ET, DT>(codes[i], scale);
    }
    store_out<DT>(yrow, k0, n, out);
  }
}

}  // namespace

void dequantize(const Problem& p, const QuantizedIn& q, const Tensor& y) {
  if (p.e5m3()) return dequantize_e5m3(p, q, y);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(y.dtype, [&](auto dt) {
      std::vector<std::uint32_t> nvt;  // NVFP4's and MXFP4's output table (the fast paths above)
      if (p.nvfp4()) nvt = nvfp4_decode_table<decltype(dt)::value>(make_nv_tables(p.S), p.S);
#if defined(MXQ_CPU_AVX2)
      else if (p.info.elem == ElemType::e2m1 && cpu_has_avx2()) nvt = mxfp4_decode_table<decltype(dt)::value>();
#endif
      dispatch_group<decltype(et)::value>(p.g, [&](auto gc) {
        parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
          dequantize_tile<decltype(et)::value, decltype(dt)::value, decltype(gc)::value>(p, q, y, nvt.data(), r, b0, b1);
        });
      });
    });
  });
}

}  // namespace mxq::cpu
