// The CUDA backend.
//
// Work decomposition: a row of K elements is cut into chunks of C contiguous elements (C = 8, or 2
// for group sizes 2 and 4); one thread owns one chunk, and the T = g / C threads of a group are
// adjacent lanes of one warp, so block reductions (amax, the quest sums) are xor-shuffles inside the
// group. The shuffle tree combines chunk sums of adjacent halves, which is exactly pairwise_sum's
// order (fp32 addition is commutative, so both lanes of a pair compute the same bits).
//
// Per element the kernels run the same arithmetic as the CPU backends: the branch-free helpers of
// core/fastmath.hpp for round-to-nearest-even, the scalar codec (core/codec.hpp) for stochastic
// rounding and special cases. Loads and stores are 16-byte vectors where the views are aligned; any
// stride, any K and unaligned views take a per-element path.
//
// Nothing here allocates or synchronises except tensor_amax (it returns a host value).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"
#include "core/validate.hpp"
#include "cuda/backend.hpp"

namespace mxq::cuda {

using namespace mxq::core;

namespace {
using i64 = std::int64_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kThreads = 256;

// n / d for n < 2^31 and 1 <= d < 2^31 with one multiply-high (round-up method).
struct FastDiv {
  u32 d = 1, mul = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(u32 dv) : d(dv) {
    while ((u64(1) << shift) < dv) ++shift;
    mul = u32(((u64(1) << 32) * ((u64(1) << shift) - dv)) / dv + 1);
  }
  __device__ __forceinline__ u32 div(u32 n) const { return (__umulhi(n, mul) + n) >> shift; }
};

// Everything a kernel needs, by value (kernel parameter space).
struct Params {
  const std::uint8_t* x = nullptr;
  i64 x_stride = 0;  // bytes
  std::uint8_t* y = nullptr;
  i64 y_stride = 0;  // bytes
  std::uint8_t* codes = nullptr;
  i64 codes_stride = 0;
  std::uint8_t* scales = nullptr;
  i64 scales_stride = 0;  // linear layout
  std::uint8_t* mask = nullptr;
  i64 mask_stride = 0;
  i64 rows = 0, K = 0, cpr = 0, total = 0;  // chunks per row, chunks in all
  i64 scale_cols_padded = 0;
  FastDiv cpr_div;
  bool small = true;  // total < 2^31: 32-bit index arithmetic
  int g = 32, T = 4, log2T = 2;
  ScaleRule rule = ScaleRule::floor;
  bool stochastic = false, nvfp4 = false, swizzled = false;
  bool x_vec = false, y_vec = false, codes_vec = false;
  u64 seed = 0, offset = 0;
  float S = 1.0f;
  const u32* amax = nullptr;  // NVFP4: S comes from this tensor amax (fp32 bits) when set
};

template <DType DT>
using Storage = std::conditional_t<DT == DType::f32, u32, std::uint16_t>;

template <DType DT>
__device__ __forceinline__ u32 to_f32_bits(Storage<DT> v) {
  if constexpr (DT == DType::f32) return v;
  else if constexpr (DT == DType::bf16) return u32(v) << 16;
  else return f2u(__half2float(__ushort_as_half(v)));  // exact
}

// Bytes moved by one C-element vector access of a DT view, and the alignment it needs.
template <DType DT, int C>
constexpr int vec_bytes() {
  return C * int(sizeof(Storage<DT>));
}
template <DType DT, int C>
constexpr int vec_align() {
  return vec_bytes<DT, C>() < 16 ? vec_bytes<DT, C>() : 16;
}

// Vector global accesses of W 32-bit words (W = 1, 2 or a multiple of 4) with streaming cache hints.
// NOTE: values move through plain register words; a local array whose address is taken would be
// placed in local memory (a stack frame) and cost a round trip per access.
template <int W>
__device__ __forceinline__ void load_words(const void* src, u32 (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 v = __ldcs(static_cast<const uint4*>(src) + q);
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = __ldcs(static_cast<const uint2*>(src));
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = __ldcs(static_cast<const unsigned int*>(src));
  }
}
template <int W>
__device__ __forceinline__ void store_words(void* dst, const u32 (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) __stcs(static_cast<uint4*>(dst) + q, make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]));
  } else if constexpr (W == 2) {
    __stcs(static_cast<uint2*>(dst), make_uint2(w[0], w[1]));
  } else {
    __stcs(static_cast<unsigned int*>(dst), w[0]);
  }
}

template <DType DT, int C>
__device__ __forceinline__ void load_chunk(const Params& p, i64 row, i64 k0, bool full, u32 (&xb)[C]) {
  using S = Storage<DT>;
  const S* src = reinterpret_cast<const S*>(p.x + row * p.x_stride) + k0;
  if (full && p.x_vec) {
    constexpr int W = vec_bytes<DT, C>() / 4;
    u32 w[W];
    load_words<W>(src, w);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if constexpr (sizeof(S) == 4) xb[i] = w[i];
      else xb[i] = to_f32_bits<DT>(static_cast<S>((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu));
    }
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) xb[i] = to_f32_bits<DT>(k0 + i < p.K ? src[i] : S(0));
  }
}

template <DType DT, int C>
__device__ __forceinline__ void store_chunk(const Params& p, i64 row, i64 k0, bool full, const u32 (&ob)[C]) {
  using S = Storage<DT>;
  S* dst = reinterpret_cast<S*>(p.y + row * p.y_stride) + k0;
  if (full && p.y_vec) {
    constexpr int W = vec_bytes<DT, C>() / 4;
    u32 w[W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
      if constexpr (sizeof(S) == 4) w[j] = ob[j];
      else w[j] = (ob[2 * j] & 0xFFFFu) | (ob[2 * j + 1] << 16);
    }
    store_words<W>(dst, w);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (k0 + i < p.K) dst[i] = static_cast<S>(ob[i]);
  }
}

// Chunk coordinates of the calling thread.
struct Coord {
  i64 row, k0, block;
  int lane_in_group;
  bool active, full;
};
template <int C>
__device__ __forceinline__ Coord coord(const Params& p, i64 i) {
  Coord c;
  c.active = i < p.total;
  i64 ch;
  if (p.small) {
    const u32 ii = c.active ? u32(i) : 0u;
    const u32 r = p.cpr_div.div(ii);
    c.row = r;
    ch = ii - r * u32(p.cpr);
  } else {
    c.row = c.active ? i / p.cpr : 0;
    ch = c.active ? i - c.row * p.cpr : 0;
  }
  c.k0 = ch * C;
  c.block = ch >> p.log2T;
  c.lane_in_group = int(ch & (p.T - 1));
  c.full = c.k0 + C <= p.K;
  return c;
}

__device__ __forceinline__ i64 scale_index(const Params& p, i64 row, i64 b) {
  return p.swizzled ? swizzled_offset(row, b, p.scale_cols_padded) : row * p.scales_stride + b;
}

// Pairwise sum of a thread's C values (the leaves of pairwise_sum's tree).
template <int C>
__device__ __forceinline__ float chunk_pairwise(const float (&v)[C]) {
  float b[C];
#pragma unroll
  for (int i = 0; i < C; ++i) b[i] = v[i];
#pragma unroll
  for (int w = C; w > 1; w >>= 1)
#pragma unroll
    for (int i = 0; i < w / 2; ++i) b[i] = add_rn(b[2 * i], b[2 * i + 1]);
  return b[0];
}
__device__ __forceinline__ float group_sum(const Params& p, float s) {
  for (int st = 1; st < p.T; st <<= 1) s = add_rn(s, __shfl_xor_sync(kFull, s, st));
  return s;
}
__device__ __forceinline__ u32 group_max(const Params& p, u32 m) {
  for (int st = 1; st < p.T; st <<= 1) m = umax(m, __shfl_xor_sync(kFull, m, st));
  return m;
}

// The quest argument of the calling thread's group (quest_arg's arithmetic, distributed).
template <int C>
__device__ __forceinline__ float group_quest_arg(const Params& p, const u32 (&xb)[C]) {
  float xs[C], d2[C];
#pragma unroll
  for (int i = 0; i < C; ++i) xs[i] = u2f(xb[i]);
  const float mean = div_rn(group_sum(p, chunk_pairwise<C>(xs)), float(p.g));
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float d = sub_rn(xs[i], mean);
    d2[i] = mul_rn(d, d);
  }
  const float var = div_rn(group_sum(p, chunk_pairwise<C>(d2)), float(p.g));
  return add_rn(div_rn(mul_rn(sqrt_rn(var), 2.92247856f), 6.0f), 1e-8f);
}

// Stochastic-rounding words of the C elements starting at logical index j0 (sr_bits for each).
template <int C>
__device__ __forceinline__ void sr_words(u64 seed, u64 j0, u32 (&rnd)[C]) {
  if ((j0 & 3) == 0 && C % 4 == 0) {
#pragma unroll
    for (int n = 0; n < C / 4; ++n) {
      const u64 c = (j0 >> 2) + n;
      const U32x4 r = philox4x32_10(U32x4{{u32(c), u32(c >> 32), 0u, 0u}}, u32(seed), u32(seed >> 32));
#pragma unroll
      for (int w = 0; w < 4; ++w) rnd[4 * n + w] = r.v[w];
    }
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) rnd[i] = sr_bits(seed, j0 + i);
  }
}

// ---- quantize and qdq ---------------------------------------------------------------------------------
template <ElemType ET, DType DT, int C, bool QDQ>
__device__ __forceinline__ void process_chunk(const Params& p, const Coord& c, u32 (&xb)[C]) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  u32 am = 0;
#pragma unroll
  for (int i = 0; i < C; ++i) am = umax(am, xb[i] & 0x7FFFFFFFu);
  am = group_max(p, am);
  const bool nonfinite = am >= 0x7F800000u;

  u32 codes[C];      // element codes (quantize, and qdq with the scalar codec)
  u32 out[C];        // qdq output bits
  u32 keep = 0;      // clip-mask bits, element i at bit i
  std::uint8_t sb;   // scale byte
  u32 rnd[C];
  if (p.stochastic) sr_words<C>(p.seed, p.offset + u64(c.row) * u64(p.K) + u64(c.k0), rnd);

  if (ET == ElemType::e2m1 && p.nvfp4) {
    // ---- NVFP4: E4M3 block scale under the tensor encode scale S
    const float S = p.amax ? nvfp4_encode_scale(u2f(*p.amax)) : p.S;
    // nvfp4_block_scale_code and nvfp4_multiplier, branch-free: the E4M3 value of the block scale is
    // RNE(amax * S / 6) on E4M3's grid (saturating; amax * S / 6 is finite or +Inf, never NaN).
    const float sval = nonfinite ? 0.0f : rne_mag<ElemType::e4m3>(div_rn(mul_rn(u2f(am), S), 6.0f), 1.0f);
    const u32 sc = nonfinite ? u32(kE4M3NaN) : code_of<ElemType::e4m3>(sval, 0u);
    const float m = sval == 0.0f ? 0.0f : div_rn(S, sval);
    sb = static_cast<std::uint8_t>(sc);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const u32 code = p.stochastic ? nvfp4_encode_sr(xb[i], m, rnd[i]) : nvfp4_encode_rne(xb[i], m);
      codes[i] = nonfinite ? 0u : code;
      if (!QDQ && p.mask) keep |= u32(!nonfinite && fabs_bits(mul_rn(u2f(xb[i]), m)) < 6.0f) << i;
      if (QDQ) {
        const float ev = u2f(f2u(e2m1_value(code & 7u)) | ((code >> 3) << 31));
        out[i] = nonfinite ? nan_bits(DT) : to_dtype_bits_nonnan<DT>(div_rn(mul_rn(ev, sval), S));
      }
    }
  } else {
    // ---- MX: E8M0 block scale 2^e
    float quest = 0.0f;
    if (p.rule == ScaleRule::quest) quest = group_quest_arg<C>(p, xb);
    int e = -127;
    if (am != 0 && !nonfinite) e = mx_scale_exp(p.rule, u2f(am), quest, f);
    sb = nonfinite ? kE8M0NaN : static_cast<std::uint8_t>(e + kE8M0Bias);
    if (p.rule == ScaleRule::qutlass_absmax) {
#pragma unroll
      for (int i = 0; i < C; ++i) xb[i] = f2u(mul_rn(3.0f, u2f(xb[i])));
    }
    const float inv = pow2f(-e), scale = pow2f(e);
    if (p.stochastic) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        codes[i] = nonfinite ? 0u : encode_scaled_sr<ET>(xb[i], e, rnd[i]);
        if (QDQ) out[i] = nonfinite ? nan_bits(DT) : mx_dequant_finite<ET, DT>(codes[i], scale);
      }
    } else if (QDQ) {
      // NOTE: as the CPU path, round in the unscaled domain where the result is a normal float with at
      // most 8 significant bits (then bf16/fp32 output is a plain truncation); elsewhere scale, round,
      // scale back and convert.
      constexpr int kELo = -126 - (f.emin - f.mbits);
      constexpr int kEHi = 254 - (f.emax + 1 + 127 + 23 - f.mbits);
      if (DT != DType::f16 && e >= kELo && e <= kEHi) {
        const u32 lo = u32(f.emin + e + 127) << 23, hi = u32(f.emax + 1 + e + 127) << 23;
        constexpr u32 kC = (u32(23 - f.mbits) << 23) | 0x400000u;
        const float maxv = mul_rn(u2f(max_value_bits(f)), scale);
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const u32 xa = xb[i] & 0x7FFFFFFFu;
          const float Cc = u2f(umin(umax(xa & 0x7F800000u, lo), hi) + kC);
          const float rm = fminf_nn(sub_rn(add_rn(u2f(xa), Cc), Cc), maxv);
          u32 sign = xb[i] >> 31;
          if (f.twos_complement) sign &= u32(rm != 0.0f);  // INT8 has no -0
          out[i] = (DT == DType::f32 ? f2u(rm) : (f2u(rm) >> 16)) | (sign << kSignBit);
        }
      } else {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float rm = rne_mag<ET>(u2f(xb[i]), inv);
          u32 sign = xb[i] >> 31;
          if (f.twos_complement) sign &= u32(rm != 0.0f);
          out[i] = out_mag_bits<DT>(mul_rn(rm, scale)) | (sign << kSignBit);
        }
      }
      if (nonfinite) {
#pragma unroll
        for (int i = 0; i < C; ++i) out[i] = nan_bits(DT);
      }
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) codes[i] = nonfinite ? 0u : code_of<ET>(rne_mag<ET>(u2f(xb[i]), inv), xb[i] >> 31);
    }
    if (!QDQ && p.mask) {  // the clip mask is optional: no compares when it is not wanted
      const float limit = mul_rn(u2f(max_value_bits(f)), scale);  // exact, or +Inf past FLT_MAX
#pragma unroll
      for (int i = 0; i < C; ++i) keep |= u32(!nonfinite && fabs_bits(u2f(xb[i])) < limit) << i;
    }
  }
  // Clip-mask byte of this chunk's elements; with C = 2 four adjacent lanes share a byte and OR their
  // bits together (rows hold a multiple of 4 chunks, so the four lanes are aligned and in one row).
  const i64 valid = p.K - c.k0 < C ? p.K - c.k0 : C;  // <= 0: the chunk is padding past K
  u32 mbyte = 0;
  if (!QDQ && p.mask) {
    mbyte = valid <= 0 ? 0u : (keep & (valid >= C ? 0xFFu : ((1u << valid) - 1u))) << (c.k0 % 8);
    if constexpr (C == 2) {
      mbyte |= __shfl_xor_sync(kFull, mbyte, 1);
      mbyte |= __shfl_xor_sync(kFull, mbyte, 2);
    }
  }
  if (!c.active) return;  // every shuffle is behind us

  if constexpr (QDQ) {
    store_chunk<DT, C>(p, c.row, c.k0, c.full, out);
  } else {
    if (valid <= 0) return;  // padding chunks own no bytes (lane 0 of a group is never padding)
    if (c.lane_in_group == 0) p.scales[scale_index(p, c.row, c.block)] = sb;
    std::uint8_t* crow = p.codes + c.row * p.codes_stride;
    // Codes packed into 32-bit words: FP4 two per byte (low nibble first), others one per byte.
    constexpr int kBits = f.bits == 4 ? 4 : 8;
    constexpr int NB = C * kBits / 8;  // bytes of this chunk
    u32 w[(NB + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < C; ++i) w[i * kBits / 32] |= (codes[i] & ((1u << kBits) - 1u)) << ((i * kBits) % 32);
    std::uint8_t* d = crow + c.k0 * kBits / 8;
    if (c.full && p.codes_vec) {
      if constexpr (NB >= 4) store_words<NB / 4>(d, w);
      else if constexpr (NB == 2) *reinterpret_cast<std::uint16_t*>(d) = static_cast<std::uint16_t>(w[0]);
      else *d = static_cast<std::uint8_t>(w[0]);
    } else {
      const i64 nbytes = (valid * kBits + 7) / 8;
#pragma unroll
      for (int j = 0; j < NB; ++j)
        if (j < nbytes) d[j] = static_cast<std::uint8_t>(w[j / 4] >> (8 * (j % 4)));
    }
    if (p.mask && c.k0 % 8 == 0) p.mask[c.row * p.mask_stride + c.k0 / 8] = static_cast<std::uint8_t>(mbyte);
  }
}

// NOTE: one chunk per thread. Loading four chunks per thread before processing them (tried on the
// H200, 2026-12-02) raised registers, halved achieved occupancy and made every case slower.
template <ElemType ET, DType DT, int C, bool QDQ>
__global__ void __launch_bounds__(kThreads) block_kernel(const Params p) {
  const Coord c = coord<C>(p, i64(blockIdx.x) * kThreads + threadIdx.x);
  u32 xb[C];
  if (c.active) {
    load_chunk<DT, C>(p, c.row, c.k0, c.full, xb);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) xb[i] = 0;
  }
  process_chunk<ET, DT, C, QDQ>(p, c, xb);
}

// ---- dequantize -------------------------------------------------------------------------------------------
template <ElemType ET, int C>
__device__ __forceinline__ void load_codes(const Params& p, const Coord& c, u32 (&codes)[C], std::uint8_t& sb) {
  constexpr FloatSpec f = Elem<ET>::spec;
  sb = p.scales[scale_index(p, c.row, c.block)];
  const std::uint8_t* crow = p.codes + c.row * p.codes_stride;
  const i64 valid = p.K - c.k0 < C ? p.K - c.k0 : C;
  constexpr int kBits = f.bits == 4 ? 4 : 8;
  constexpr int NB = C * kBits / 8;
  u32 w[(NB + 3) / 4] = {};
  const std::uint8_t* s = crow + c.k0 * kBits / 8;
  if (c.full && p.codes_vec) {
    if constexpr (NB >= 4) load_words<NB / 4>(s, w);
    else if constexpr (NB == 2) w[0] = *reinterpret_cast<const std::uint16_t*>(s);
    else w[0] = *s;
  } else {
    const i64 nbytes = (valid * kBits + 7) / 8;
#pragma unroll
    for (int j = 0; j < NB; ++j)
      if (j < nbytes) w[j / 4] |= u32(s[j]) << (8 * (j % 4));
  }
#pragma unroll
  for (int i = 0; i < C; ++i) codes[i] = (w[i * kBits / 32] >> ((i * kBits) % 32)) & ((1u << kBits) - 1u);
}

template <ElemType ET, DType DT, int C>
__device__ __forceinline__ void dequant_chunk(const Params& p, const Coord& c, const u32 (&codes)[C], std::uint8_t sb) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  u32 out[C];
  if (ET == ElemType::e2m1 && p.nvfp4) {
    const bool nan_scale = (sb & 0x7F) == kE4M3NaN;
    const float sval = decode_f32(sb, spec_e4m3());
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const float ev = u2f(f2u(e2m1_value(codes[i] & 7u)) | ((codes[i] >> 3) << 31));
      out[i] = nan_scale ? nan_bits(DT) : to_dtype_bits_nonnan<DT>(div_rn(mul_rn(ev, sval), p.S));
    }
  } else {
    const float scale = pow2f(int(sb) - kE8M0Bias);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      u32 sign = 0, n = 0;
      int pe = 0;
      if (sb == kE8M0NaN || !decode_parts(codes[i], f, sign, n, pe)) {
        out[i] = mx_dequant_bits(codes[i], sb, f, DT);
      } else {
        const float v = mul_rn(mul_rn(float(n), pow2f(pe)), scale);  // exact, or +Inf past FLT_MAX
        out[i] = out_mag_bits<DT>(v) | (sign << kSignBit);
      }
    }
  }
  store_chunk<DT, C>(p, c.row, c.k0, c.full, out);
}

template <ElemType ET, DType DT, int C>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const Params p) {
  const Coord c = coord<C>(p, i64(blockIdx.x) * kThreads + threadIdx.x);
  if (!c.active || c.k0 >= p.K) return;
  u32 codes[C];
  std::uint8_t sb;
  load_codes<ET, C>(p, c, codes, sb);
  dequant_chunk<ET, DT, C>(p, c, codes, sb);
}

// ---- tensor amax, scale layouts, small helpers ------------------------------------------------------------
// max |x| as fp32 bits over the view, ORed into *acc with atomicMax (acc zeroed first). NaN bits
// compare above +Inf, so a NaN anywhere gives NaN.
template <DType DT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const Params p, u32* acc) {
  constexpr int C = 8;
  u32 m = 0;
  const i64 stride = i64(gridDim.x) * kThreads;
  for (i64 i = i64(blockIdx.x) * kThreads + threadIdx.x; i < p.total; i += stride) {
    const i64 row = i / p.cpr, k0 = (i - row * p.cpr) * C;
    u32 xb[C];
    load_chunk<DT, C>(p, row, k0, k0 + C <= p.K, xb);
#pragma unroll
    for (int j = 0; j < C; ++j) m = umax(m, xb[j] & 0x7FFFFFFFu);
  }
  for (int st = 16; st > 0; st >>= 1) m = umax(m, __shfl_xor_sync(kFull, m, st));
  __shared__ u32 warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = umax(m, warp_max[w]);
    atomicMax(acc, m);
  }
}

__global__ void encode_scale_kernel(float* ts) { *ts = nvfp4_encode_scale(*ts); }
__global__ void fill_kernel(float* ts, float v) { *ts = v; }

__global__ void swizzle_kernel(const std::uint8_t* lin, i64 lstride, i64 R, i64 Cl, std::uint8_t* sw, i64 Cp, i64 n) {
  const i64 o = i64(blockIdx.x) * kThreads + threadIdx.x;
  if (o >= n) return;
  const i64 tile = o >> 9, w = o & 511, tiles_per_row = Cp / 4;
  const i64 r = (tile / tiles_per_row) * 128 + ((w >> 2) & 3) * 32 + (w >> 4);
  const i64 col = (tile % tiles_per_row) * 4 + (w & 3);
  sw[o] = (r < R && col < Cl) ? lin[r * lstride + col] : std::uint8_t(0);
}

__global__ void unswizzle_kernel(const std::uint8_t* sw, i64 Cp, std::uint8_t* lin, i64 lstride, i64 R, i64 Cl) {
  const i64 o = i64(blockIdx.x) * kThreads + threadIdx.x;
  if (o >= R * Cl) return;
  const i64 r = o / Cl, col = o % Cl;
  lin[r * lstride + col] = sw[swizzled_offset(r, col, Cp)];
}

// ---- host side ---------------------------------------------------------------------------------------------
[[noreturn]] void device_fail(const char* fn, const std::string& what, cudaError_t e) {
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  fail(Error::Code::device_error, fn, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
void check(cudaError_t e, const char* fn, const std::string& what) {
  if (e != cudaSuccess) device_fail(fn, what, e);
}
void check_launch(const char* fn, const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) device_fail(fn, std::string("launching ") + kernel, e);
}

// The view's memory must be device (or managed) memory of the current device: a host pointer marked
// Device::cuda would fault inside the kernel, so it is refused here.
void check_device_ptr(const char* fn, const char* arg, const void* ptr) {
  if (ptr == nullptr) return;
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) device_fail(fn, std::string("argument '") + arg + "': cudaPointerGetAttributes", e);
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    fail(Error::Code::invalid_argument, fn,
         std::string("argument '") + arg + "' is marked Device::cuda but points to " +
             (a.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory") +
             "; the CUDA backend needs device memory (mxq never copies between host and device)");
  int cur = 0;
  check(cudaGetDevice(&cur), fn, "cudaGetDevice");
  if (a.device != cur)
    fail(Error::Code::invalid_argument, fn,
         std::string("argument '") + arg + "' is on CUDA device " + std::to_string(a.device) +
             " but the current device is " + std::to_string(cur) + "; call cudaSetDevice first");
}

bool aligned(const void* ptr, i64 stride_bytes, int a) {
  return reinterpret_cast<std::uintptr_t>(ptr) % a == 0 && stride_bytes % a == 0;
}

i64 launch_blocks(const char* fn, i64 threads) {
  const i64 b = (threads + kThreads - 1) / kThreads;
  if (b > 0x7FFFFFFF)
    fail(Error::Code::unsupported, fn, "tensor too large for one launch (" + std::to_string(threads) + " chunks)");
  return b;
}

// SMs of the current device (the amax reduction sizes its grid by it).
int sm_count(const char* fn) {
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn, "cudaDeviceGetAttribute");
  return sms;
}

// Geometry common to every chunked kernel.
Params base_params(const Problem& p, int C) {
  Params k;
  k.rows = p.rows;
  k.K = p.K;
  k.g = p.g;
  k.T = p.g / C;
  k.log2T = 0;
  while ((1 << k.log2T) < k.T) ++k.log2T;
  k.cpr = p.nblocks * k.T;
  if (C == 2) k.cpr = (k.cpr + 3) / 4 * 4;  // clip-mask bytes: 4 lanes per byte, aligned in the warp
  k.total = k.rows * k.cpr;
  k.small = k.total < (i64(1) << 31);
  if (k.small) k.cpr_div = FastDiv(u32(k.cpr));
  k.scale_cols_padded = p.scale_cols_padded;
  k.rule = p.opt.rule;
  k.stochastic = p.stochastic;
  k.nvfp4 = p.nvfp4();
  k.swizzled = p.opt.scale_layout == ScaleLayout::swizzled;
  k.seed = p.opt.seed;
  k.offset = p.opt.offset;
  k.S = p.S;
  return k;
}

template <class F>
void dispatch_chunk(int g, F&& f) {
  if (g >= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 2>{});
}

cudaStream_t stream_of(const Problem& p) { return static_cast<cudaStream_t>(p.opt.stream); }

// Reduce the tensor amax of x into *acc (4 bytes of device memory), stream-ordered.
void enqueue_amax(const char* fn, const Tensor& x, u32* acc, cudaStream_t s) {
  check(cudaMemsetAsync(acc, 0, sizeof(u32), s), fn, "zeroing the amax accumulator");
  if (x.rows == 0 || x.cols == 0) return;
  Params k;
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  k.K = x.cols;
  k.rows = x.rows;
  k.cpr = (x.cols + 7) / 8;
  k.total = k.rows * k.cpr;
  const i64 blocks = std::min<i64>(launch_blocks(fn, k.total), i64(sm_count(fn)) * 8);
  dispatch_dtype(x.dtype, [&](auto dt) {
    constexpr DType DT = decltype(dt)::value;
    k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, 8>());
    amax_kernel<DT><<<unsigned(blocks), kThreads, 0, s>>>(k, acc);
  });
  check_launch(fn, "amax_kernel");
}

}  // namespace

bool available(std::string* why_not) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why_not) *why_not = std::string("no usable CUDA driver/device: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    if (why_not) *why_not = "no CUDA device present";
    return false;
  }
  return true;
}

void quantize(const char* fn, const Problem& p0, const Tensor& x, const QuantizedOut& out) {
  Problem p = p0;
  const cudaStream_t s = stream_of(p);
  check_device_ptr(fn, "x", x.data);
  check_device_ptr(fn, "codes", out.codes.data);
  check_device_ptr(fn, "scales", out.scales.data);
  check_device_ptr(fn, "clip_mask", out.clip_mask.data);
  check_device_ptr(fn, "tensor_scale", out.tensor_scale);
  if (p.opt.workspace) check_device_ptr(fn, "workspace", p.opt.workspace);
  u32* acc = nullptr;
  if (p.nvfp4() && !p.opt.tensor_scale) {
    acc = reinterpret_cast<u32*>(out.tensor_scale ? out.tensor_scale : static_cast<float*>(p.opt.workspace));
    if (!acc)
      fail(Error::Code::invalid_argument, fn,
           "nvfp4 without option 'tensor_scale' on the CUDA backend needs 'tensor_scale' (output, device memory) or "
           "option 'workspace' (4 bytes of device memory) to reduce the tensor amax in");
    if (reinterpret_cast<std::uintptr_t>(acc) % 4)
      fail(Error::Code::invalid_argument, fn, "the tensor amax accumulator ('tensor_scale' or 'workspace') must be 4-byte aligned");
    enqueue_amax(fn, x, acc, s);
  }
  if (x.rows == 0 || x.cols == 0) {
    if (out.tensor_scale) {
      if (acc) encode_scale_kernel<<<1, 1, 0, s>>>(out.tensor_scale);
      else fill_kernel<<<1, 1, 0, s>>>(out.tensor_scale, p.S);
      check_launch(fn, "tensor scale");
    }
    return;
  }
  const int C = p.g >= 8 ? 8 : 2;
  Params k = base_params(p, C);
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  k.codes = static_cast<std::uint8_t*>(out.codes.data);
  k.codes_stride = out.codes.stride();
  k.scales = static_cast<std::uint8_t*>(out.scales.data);
  k.scales_stride = out.scales.stride();
  k.mask = static_cast<std::uint8_t*>(out.clip_mask.data);
  k.mask_stride = out.clip_mask.stride();
  k.amax = acc;
  const int code_bytes = p.fp4 ? C / 2 : C;
  k.codes_vec = aligned(k.codes, k.codes_stride, code_bytes);
  if (k.swizzled && (p.scale_rows_padded != p.rows || p.scale_cols_padded != p.nblocks))
    check(cudaMemsetAsync(k.scales, 0, p.scale_rows_padded * p.scale_cols_padded, s), fn, "zeroing swizzle padding");
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_chunk(p.g, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
        constexpr DType DT = decltype(dt)::value;
        constexpr int CC = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, CC>());
        block_kernel<ET, DT, CC, false><<<unsigned(launch_blocks(fn, k.total)), kThreads, 0, s>>>(k);
      });
    });
  });
  check_launch(fn, "quantize kernel");
  if (out.tensor_scale) {
    if (acc) encode_scale_kernel<<<1, 1, 0, s>>>(out.tensor_scale);  // amax -> S, after the kernel read it
    else fill_kernel<<<1, 1, 0, s>>>(out.tensor_scale, p.S);
    check_launch(fn, "tensor scale");
  }
}

void qdq(const char* fn, const Problem& p, const Tensor& x, const Tensor& y) {
  const cudaStream_t s = stream_of(p);
  check_device_ptr(fn, "x", x.data);
  check_device_ptr(fn, "y", y.data);
  u32* acc = nullptr;
  if (p.nvfp4() && !p.opt.tensor_scale) {
    acc = static_cast<u32*>(p.opt.workspace);
    if (!acc)
      fail(Error::Code::invalid_argument, fn,
           "nvfp4 without option 'tensor_scale' on the CUDA backend needs option 'workspace' (4 bytes of device "
           "memory) to reduce the tensor amax in");
    check_device_ptr(fn, "workspace", acc);
    if (reinterpret_cast<std::uintptr_t>(acc) % 4)
      fail(Error::Code::invalid_argument, fn, "option 'workspace' must be 4-byte aligned");
    enqueue_amax(fn, x, acc, s);
  }
  if (x.rows == 0 || x.cols == 0) return;
  const int C = p.g >= 8 ? 8 : 2;
  Params k = base_params(p, C);
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.amax = acc;
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      dispatch_chunk(p.g, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
        constexpr DType DT = decltype(dt)::value;
        constexpr int CC = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, CC>());
        k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, CC>());
        block_kernel<ET, DT, CC, true><<<unsigned(launch_blocks(fn, k.total)), kThreads, 0, s>>>(k);
      });
    });
  });
  check_launch(fn, "qdq kernel");
}

void dequantize(const char* fn, const Problem& p, const QuantizedIn& q, const Tensor& y) {
  const cudaStream_t s = stream_of(p);
  check_device_ptr(fn, "codes", q.codes.data);
  check_device_ptr(fn, "scales", q.scales.data);
  check_device_ptr(fn, "y", y.data);
  if (y.rows == 0 || y.cols == 0) return;
  const int C = p.g >= 8 ? 8 : 2;
  Params k = base_params(p, C);
  k.codes = static_cast<std::uint8_t*>(q.codes.data);
  k.codes_stride = q.codes.stride();
  k.scales = static_cast<std::uint8_t*>(q.scales.data);
  k.scales_stride = q.scales.stride();
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.codes_vec = aligned(k.codes, k.codes_stride, p.fp4 ? C / 2 : C);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(y.dtype, [&](auto dt) {
      dispatch_chunk(p.g, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
        constexpr DType DT = decltype(dt)::value;
        constexpr int CC = decltype(cc)::value;
        k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, CC>());
        dequant_kernel<ET, DT, CC><<<unsigned(launch_blocks(fn, k.total)), kThreads, 0, s>>>(k);
      });
    });
  });
  check_launch(fn, "dequantize kernel");
}

void swizzle_scales(const Tensor& linear, const Tensor& swizzled, void* stream) {
  const char* fn = "swizzle_scales";
  check_device_ptr(fn, "linear", linear.data);
  check_device_ptr(fn, "swizzled", swizzled.data);
  const i64 n = swizzled.rows * swizzled.cols;
  if (n == 0) return;
  swizzle_kernel<<<unsigned(launch_blocks(fn, n)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint8_t*>(linear.data), linear.stride(), linear.rows, linear.cols,
      static_cast<std::uint8_t*>(swizzled.data), swizzled.cols, n);
  check_launch(fn, "swizzle_kernel");
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, void* stream) {
  const char* fn = "unswizzle_scales";
  check_device_ptr(fn, "swizzled", swizzled.data);
  check_device_ptr(fn, "linear", linear.data);
  const i64 n = linear.rows * linear.cols;
  if (n == 0) return;
  unswizzle_kernel<<<unsigned(launch_blocks(fn, n)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint8_t*>(swizzled.data), swizzled.cols, static_cast<std::uint8_t*>(linear.data),
      linear.stride(), linear.rows, linear.cols);
  check_launch(fn, "unswizzle_kernel");
}

float tensor_amax(const Tensor& x, void* stream) {
  const char* fn = "tensor_amax";
  check_device_ptr(fn, "x", x.data);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  void* buf = nullptr;
  check(cudaMallocAsync(&buf, sizeof(u32), s), fn, "cudaMallocAsync");
  u32 bits = 0;
  cudaError_t e = cudaSuccess;
  try {
    enqueue_amax(fn, x, static_cast<u32*>(buf), s);
    e = cudaMemcpyAsync(&bits, buf, sizeof(u32), cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  } catch (...) {
    cudaFreeAsync(buf, s);
    throw;
  }
  cudaFreeAsync(buf, s);
  check(e, fn, "reading the amax back");
  return u2f(bits);
}

}  // namespace mxq::cuda
