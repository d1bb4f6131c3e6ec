// The CUDA backend.
//
// Work decomposition: a row of K elements is cut into chunks of C contiguous elements (C = 16, 8, or 2
// for group sizes 2 and 4); one thread owns one chunk at a time, and the T = g / C threads of a group
// are adjacent lanes of one warp, so block reductions (amax, the quest sums) are xor-shuffles inside
// the group. The shuffle tree combines chunk sums of adjacent halves, which is exactly pairwise_sum's
// order (fp32 addition is commutative, so both lanes of a pair compute the same bits).
//
// Quantize and QDQ run a grid of at most one wave of resident blocks that strides over the chunks;
// each thread keeps its next chunks in flight through a per-thread cp.async ring in shared memory,
// so memory parallelism does not cost registers. Dense tensors (every group complete, row-contiguous
// views) run "flat": the tensor is one long row, a chunk's address is base + i * bytes, and 2-byte
// dtypes take 16 elements per thread to spread the per-chunk work (scale rule, shuffles, addresses)
// over more elements.
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
#include <atomic>
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
  // Flat: a dense tensor (K a multiple of g, every view row-contiguous) is run as one row of rows * K
  // elements, so chunk i sits at element 8 * i (or 16 * i) with no division; row_blocks (blocks per
  // real row) recovers the (row, column) of a scale where the layout needs it.
  bool flat = false;
  i64 row_blocks = 0;
  FastDiv row_blocks_div;
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

// 32-bit words holding the packed codes of a C-element chunk (FP4 two per byte, others one per byte).
template <ElemType ET, int C>
constexpr int code_words() {
  return (C * (Elem<ET>::spec.bits == 4 ? 4 : 8) / 8 + 3) / 4;
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

// Asynchronous global -> shared copies (cp.async, sm_80+): the staging ring of block_kernel. A copy of
// N bytes reads src_bytes <= N bytes and zero-fills the rest, so partial chunks need no other path.
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
template <int N>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, u32 src_bytes) {
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Unpacks W little-endian words of a DT view into fp32 bit patterns.
template <DType DT, int C, int W>
__device__ __forceinline__ void unpack_words(const u32 (&w)[W], u32 (&xb)[C]) {
  using S = Storage<DT>;
#pragma unroll
  for (int i = 0; i < C; ++i) {
    if constexpr (sizeof(S) == 4) xb[i] = w[i];
    else xb[i] = to_f32_bits<DT>(static_cast<S>((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu));
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
    unpack_words<DT, C, W>(w, xb);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) xb[i] = to_f32_bits<DT>(k0 + i < p.K ? src[i] : S(0));
  }
}

// A chunk of a DT view as the view's own little-endian words (elements past K read as 0).
template <DType DT, int C>
__device__ __forceinline__ void load_chunk_words(const Params& p, i64 row, i64 k0, bool full, u32 (&w)[vec_bytes<DT, C>() / 4]) {
  using S = Storage<DT>;
  constexpr int W = vec_bytes<DT, C>() / 4;
  const S* src = reinterpret_cast<const S*>(p.x + row * p.x_stride) + k0;
  if (full && p.x_vec) {
    load_words<W>(src, w);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) w[j] = 0;
#pragma unroll
    for (int i = 0; i < C; ++i) w[i * int(sizeof(S)) / 4] |= u32(k0 + i < p.K ? src[i] : S(0)) << (8 * ((i * int(sizeof(S))) % 4));
  }
}

// Output bits of a chunk: fp32/fp16 in the low bits of ob[i]; bf16 in the HIGH half (the fp32
// pattern it truncates, so packing two is one byte permute). nan: the whole chunk is NaN.
template <DType DT>
__device__ __forceinline__ u32 hi16(u32 v) {
  return DT == DType::bf16 ? v << 16 : v;
}
// Stores a chunk's output words: C outputs of DT packed little-endian (two per word for 2-byte
// dtypes). nan: the whole chunk is NaN.
template <DType DT, int C>
__device__ __forceinline__ void store_packed(const Params& p, i64 row, i64 k0, bool full, const u32 (&w)[vec_bytes<DT, C>() / 4],
                                             bool nan) {
  using S = Storage<DT>;
  constexpr int W = vec_bytes<DT, C>() / 4;
  S* dst = reinterpret_cast<S*>(p.y + row * p.y_stride) + k0;
  if (full && p.y_vec) {
    constexpr u32 kNanWord = DT == DType::f32 ? 0x7FC00000u : nan_bits(DT) * 0x10001u;
    u32 v[W];
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = nan ? kNanWord : w[j];
    store_words<W>(dst, v);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (k0 + i < p.K) dst[i] = static_cast<S>(nan ? nan_bits(DT) : sizeof(S) == 4 ? w[i] : w[i / 2] >> (16 * (i % 2)));
  }
}
template <DType DT, int C>
__device__ __forceinline__ void store_chunk(const Params& p, i64 row, i64 k0, bool full, const u32 (&ob)[C], bool nan) {
  u32 w[vec_bytes<DT, C>() / 4];
#pragma unroll
  for (int j = 0; j < vec_bytes<DT, C>() / 4; ++j) {
    if constexpr (DT == DType::f32) w[j] = ob[j];
    else if constexpr (DT == DType::bf16) w[j] = __byte_perm(ob[2 * j], ob[2 * j + 1], 0x7632);
    else w[j] = (ob[2 * j] & 0xFFFFu) | (ob[2 * j + 1] << 16);
  }
  store_packed<DT, C>(p, row, k0, full, w, nan);
}

// prmt.b32 in its generic mode: a selector nibble with bit 3 set replicates the top bit of the chosen
// byte over the result byte (PTX ISA, prmt). Written out: __byte_perm documents only bits 2:0.
__device__ __forceinline__ u32 prmt_sign(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// 16-bit outputs of FP4 codes by table: t01..t67 hold the output bits of the eight magnitudes (two per
// word, entry 0 in the low half of t01); byte permutes split them into a high-byte and a low-byte
// table and look up four codes at a time, and a sign-replicating permute moves each code's sign bit
// (XORed with flip's) to bit 15 of its output. About 2.4 instructions per element.
template <int C>
__device__ __forceinline__ void fp4_bf16_lookup(const u32 (&cw)[C / 8], u32 t01, u32 t23, u32 t45, u32 t67, u32 flip,
                                                u32 (&o)[C / 2]) {
  const u32 th0 = __byte_perm(t01, t23, 0x7531), th1 = __byte_perm(t45, t67, 0x7531);  // high bytes
  const u32 tl0 = __byte_perm(t01, t23, 0x6420), tl1 = __byte_perm(t45, t67, 0x6420);  // low bytes
#pragma unroll
  for (int q = 0; q < C / 8; ++q) {
    const u32 w = cw[q] ^ flip, m = w & 0x77777777u, mh = m >> 16, ws = w << 4;
    const u32 ha = __byte_perm(th0, th1, m), la = __byte_perm(tl0, tl1, m);
    const u32 hb = __byte_perm(th0, th1, mh), lb = __byte_perm(tl0, tl1, mh);
    const u32 v[4] = {__byte_perm(la, ha, 0x5140), __byte_perm(la, ha, 0x7362), __byte_perm(lb, hb, 0x5140),
                      __byte_perm(lb, hb, 0x7362)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // element 2j's sign (bit 8j+3 of w) is the top bit of byte j of w << 4, element 2j+1's (bit
      // 8j+7) that of byte j of w: replicated into bytes 1 and 3, kept at bits 15 and 31.
      const u32 sgn = prmt_sign(ws, w, ((0x8u | (4u + j)) << 12) | ((0x8u | u32(j)) << 4));
      o[4 * q + j] = v[j] | (sgn & 0x80008000u);
    }
  }
}

// Chunk coordinates of the calling thread.
struct Coord {
  i64 row, k0, block;
  int lane_in_group;
  bool active, full;
};
// Flat launches: every dense problem, and every launch with C = 16 (make_plan), so known at compile
// time there (Static): no row arithmetic, every chunk complete.
// NOTE: measured on the H200 (2026-12-03): quantize gains from the static form, QDQ lost ~3% with it
// (82.0 against 79.8 us at 8192^2), so QDQ keeps the runtime test.
template <int C, bool Static = true>
__device__ __forceinline__ bool is_flat(const Params& p) {
  return (Static && C == 16) || p.flat;
}

template <int C, bool Static = true>
__device__ __forceinline__ Coord coord(const Params& p, i64 i) {
  Coord c;
  c.active = i < p.total;
  i64 ch;
  if (is_flat<C, Static>(p)) {
    c.row = 0;
    ch = c.active ? i : 0;
  } else if (p.small) {
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
  c.full = is_flat<C, Static>(p) || c.k0 + C <= p.K;
  return c;
}

// swizzled_offset in 32-bit arithmetic (flat launches: the padded layout is below 2^32 bytes).
__device__ __forceinline__ u32 swizzled_offset32(u32 r, u32 c, u32 Cp) {
  return ((r >> 7) * (Cp >> 2) + (c >> 2)) * 512u + ((r & 31u) << 4) + (((r >> 5) & 3u) << 2) + (c & 3u);
}

template <int C>
__device__ __forceinline__ i64 scale_index(const Params& p, i64 row, i64 b) {
  if (is_flat<C>(p)) {  // b counts the blocks of the whole tensor (fewer than 2^31 in flat mode)
    if (!p.swizzled) return b;  // dense linear scales: row * blocks per row + column
    const u32 r = p.row_blocks_div.div(u32(b));
    return swizzled_offset32(r, u32(b) - r * u32(p.row_blocks), u32(p.scale_cols_padded));
  }
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

// NVFP4 tensor encode scale of a launch: S (given, or from the tensor amax the amax kernel left), 1 / S
// and whether recip_div may stand in for the division by S.
struct NvScale {
  float S = 1.0f, r = 1.0f;
  bool fast = true;
};
__device__ __forceinline__ NvScale nv_scale(const Params& p) {
  NvScale n;
  if (!p.nvfp4) return n;
  n.S = p.amax ? nvfp4_encode_scale(u2f(*p.amax)) : p.S;
  n.r = div_rn(1.0f, n.S);
  n.fast = recip_div_ok(n.S);
  return n;
}
// a / S for a = |E2M1 value| * E4M3 block scale (a >= 0).
template <bool FAST>
__device__ __forceinline__ float div_S(float a, const NvScale& nv) {
  if constexpr (FAST) return recip_div(a, nv.S, nv.r);
  else return div_rn(a, nv.S);
}

// Output bits of the NVFP4 value sign * (a / S). Only the division path can overflow (S below
// recip_div's range): that infinity stays an infinity, as in the reference (to_dtype_bits_nonnan).
template <bool FAST, DType DT>
__device__ __forceinline__ u32 nv_out(float a, u32 sign, const NvScale& nv) {
  const float v = div_S<FAST>(a, nv);
  if constexpr (FAST) return out_mag_bits<DT>(v) | (sign << (DT == DType::f32 ? 31 : 15));
  else return to_dtype_bits_nonnan<DT>(u2f(f2u(v) | (sign << 31)));
}

// 16-bit (bf16, fp16) outputs of the eight NVFP4 magnitude codes under the block scale sval, two per
// word (code 2j in the low half of t[j]): the lookup table of fp4_bf16_lookup. bf16 in recip_div's
// range: two divisions (nvfp4_bf16_table); otherwise one nv_out per magnitude.
template <DType DT>
__device__ __forceinline__ void nv_table(float sval, const NvScale& nv, u32 (&t)[4]) {
  static_assert(DT != DType::f32, "16-bit outputs only");
  if (DT == DType::bf16 && nv.fast) {
    nvfp4_bf16_table(sval, nv.S, nv.r, t);
    return;
  }
  u32 e[8];
  auto table = [&](auto fast) {
#pragma unroll
    for (int m = 0; m < 8; ++m) e[m] = nv_out<decltype(fast)::value, DT>(mul_rn(e2m1_value(u32(m)), sval), 0u, nv);
  };
  if (nv.fast) table(std::true_type{});
  else table(std::false_type{});
#pragma unroll
  for (int j = 0; j < 4; ++j) t[j] = e[2 * j] | (e[2 * j + 1] << 16);
}

// The FP8 (E4M3, E5M2) quantize of the MX fast path by cvt.rn.satfinite: the two codes of lo and hi,
// lo's in the low byte. Only where the conversion exists (sm_89+); elsewhere the read-off rounding.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHaveF8Cvt = true;
#else
constexpr bool kHaveF8Cvt = false;
#endif
template <ElemType ET, bool QDQ>
constexpr bool kF8Cvt = kHaveF8Cvt && !QDQ && (ET == ElemType::e4m3 || ET == ElemType::e5m2);
template <ElemType ET>
__device__ __forceinline__ u32 f8x2_satfinite(float lo, float hi) {
  unsigned short d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (ET == ElemType::e4m3) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// NVFP4 tables of a launch, one copy per block of block_kernel in shared memory: for each E4M3 block
// scale code c (127, the NaN code: zeros, unused) its value, the element multiplier
// nvfp4_multiplier(c, S) and, for QDQ to 16-bit outputs, the block's eight outputs (nv_table). Per
// chunk that leaves a table read where there were two divisions and the table's arithmetic.
struct NvTables {
  float sval[128], m[128];
  uint4 out[128];
};
template <DType DT, bool QDQ>
__device__ __forceinline__ void fill_nv_tables(const NvScale& nv, NvTables& t) {
  for (int c = threadIdx.x; c < 128; c += kThreads) {
    const float sval = c == 127 ? 0.0f : decode_f32(u32(c), spec_e4m3());
    t.sval[c] = sval;
    t.m[c] = sval == 0.0f ? 0.0f : div_rn(nv.S, sval);
    if constexpr (QDQ && DT != DType::f32) {
      u32 o[4];
      nv_table<DT>(sval, nv, o);
      t.out[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
}

// ---- quantize and qdq ---------------------------------------------------------------------------------
template <ElemType ET, DType DT, int C, bool QDQ>
__device__ __forceinline__ void process_chunk(const Params& p, const Coord& c, const NvScale& nv, const NvTables& nvt,
                                              const u32 (&xw)[vec_bytes<DT, C>() / 4]) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  // The elements as fp32 bits, unpacked where a path needs them: the bf16 MX path works on the words,
  // and keeping both forms live through the shuffles costs registers.
  u32 xb[C];
  auto unpack = [&] { unpack_words<DT, C, vec_bytes<DT, C>() / 4>(xw, xb); };
  u32 am = 0;
  if constexpr (DT == DType::bf16) {
    u32 m2 = 0;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) m2 = vmaxu2(m2, xw[j] & 0x7FFF7FFFu);
    am = umax(m2 & 0xFFFFu, m2 >> 16) << 16;
  } else {
    unpack();
#pragma unroll
    for (int i = 0; i < C; ++i) am = umax(am, xb[i] & 0x7FFFFFFFu);
  }
  am = group_max(p, am);
  const bool nonfinite = am >= 0x7F800000u;

  u32 codes[C];      // element codes (quantize, and qdq with the scalar codec)
  bool paired = false;                              // quantize: the codes are packed in pw already
  u32 pw[code_words<ET, C>()];
  u32 out[C];        // qdq output bits
  u32 keep = 0;      // clip-mask bits, element i at bit i
  std::uint8_t sb;   // scale byte
  u32 rnd[C];
  if (p.stochastic) sr_words<C>(p.seed, p.offset + u64(c.row) * u64(p.K) + u64(c.k0), rnd);

  if (ET == ElemType::e2m1 && p.nvfp4) {
    // ---- NVFP4: E4M3 block scale under the tensor encode scale S
    unpack();
    // nvfp4_block_scale_code (amax * S / 6 is finite or +Inf, never NaN), then the scale's value and
    // multiplier from the tables (a NaN/Inf block: 0 and 0).
    const u32 sc = nonfinite ? u32(kE4M3NaN) : e4m3_code_rne_sat(div_rn(mul_rn(u2f(am), nv.S), 6.0f));
    const float sval = nvt.sval[sc], m = nvt.m[sc];
    sb = static_cast<std::uint8_t>(sc);
    if constexpr (QDQ && DT != DType::f32 && C % 8 == 0) {
      if (!p.stochastic) {
        // Each element's code read off its rounding, packed two per byte, and the output by table
        // lookup in the block's eight outputs (nv_table, from the launch's tables).
        u32 cw[C / 8] = {};
#pragma unroll
        for (int i = 0; i < C; ++i) cw[i / 8] += nvfp4_encode_rne_readoff(xb[i], m) << (4 * (i % 8));
        const uint4 t = nvt.out[sc];
        u32 o[C / 2];
        fp4_bf16_lookup<C>(cw, t.x, t.y, t.z, t.w, 0u, o);
        if (c.active) store_packed<DT, C>(p, c.row, c.k0, c.full, o, nonfinite);  // no shuffles follow
        return;
      }
    }
    if (QDQ && !p.stochastic) {
      // The rounded magnitude is the E2M1 value itself: no code round trip. (E2M1 value * s) / S with
      // the product exact and the quotient correctly rounded (recip_div in the usual S range).
      auto qdq_rne = [&](auto fast) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float rm = rne_mag<ElemType::e2m1>(mul_rn(u2f(xb[i]), m), 1.0f);
          const u32 o = nv_out<decltype(fast)::value, DT>(mul_rn(rm, sval), xb[i] >> 31, nv);
          out[i] = hi16<DT>(o);
        }
      };
      if (nv.fast) qdq_rne(std::true_type{});
      else qdq_rne(std::false_type{});
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        u32 code;
        if (p.stochastic) {
          code = nvfp4_encode_sr(xb[i], m, rnd[i]);
        } else {
          code = nvfp4_encode_rne_readoff(xb[i], m);  // NaN/Inf blocks: codes zeroed below
        }
        codes[i] = code;
        if (!QDQ && p.mask) keep |= u32(!nonfinite && fabs_bits(mul_rn(u2f(xb[i]), m)) < 6.0f) << i;
        if (QDQ) {
          const float a = mul_rn(e2m1_value(code & 7u), sval);
          const u32 o = nv.fast ? nv_out<true, DT>(a, code >> 3, nv) : nv_out<false, DT>(a, code >> 3, nv);
          out[i] = hi16<DT>(o);
        }
      }
    }
  } else {
    // ---- MX: E8M0 block scale 2^e
    float quest = 0.0f;
    if (p.rule == ScaleRule::quest) {
      unpack();
      quest = group_quest_arg<C>(p, xb);
    }
    int e = -127;
    if (am != 0 && !nonfinite) e = mx_scale_exp(p.rule, u2f(am), quest, f);
    sb = nonfinite ? kE8M0NaN : static_cast<std::uint8_t>(e + kE8M0Bias);
    const float inv = pow2f(-e), scale = pow2f(e);
    // NOTE: as the CPU path, round in the unscaled domain where every grid value is a normal float
    // with at most 8 significant bits: QDQ to bf16/fp32 is then a plain truncation, and a code is
    // read off the bits. Elsewhere (extreme scales, fp16 output) scale, round, scale back.
    constexpr int kELo = -126 - (f.emin - f.mbits);
    constexpr int kEHi = 254 - (f.emax + 1 + 127 + 23 - f.mbits);
    constexpr bool kFastOk = QDQ ? DT != DType::f16 : !f.twos_complement;
    const u32 lo = u32(f.emin + e + 127) << 23, hi = u32(f.emax + 1 + e + 127) << 23;
    constexpr u32 kC = (u32(23 - f.mbits) << 23) | 0x400000u;
    // bf16 input, round to nearest even, a scale of the fast range: two elements per instruction on the
    // input words (mx_qdq_bf16x2, mx_codes_bf16x2). Not for FP8 quantize where the conversion
    // instruction does it, nor for INT8 (no -0) and the QuTLASS rule (it scales x first).
    if constexpr (DT == DType::bf16 && !f.twos_complement && !kF8Cvt<ET, QDQ>) {
      if (!p.stochastic && p.rule != ScaleRule::qutlass_absmax && e >= kELo && e <= kEHi) {
        const MxPair k = mx_pair<ET>(e);
        u32 r[C / 2];
        auto run = [&](auto clamp_hi) {
          constexpr bool kHi = decltype(clamp_hi)::value;
#pragma unroll
          for (int j = 0; j < C / 2; ++j) r[j] = QDQ ? mx_qdq_bf16x2<ET, kHi>(xw[j], k) : mx_codes_bf16x2<ET, kHi>(xw[j], k);
        };
        if (p.rule == ScaleRule::quest) run(std::true_type{});
        else run(std::false_type{});
        if constexpr (QDQ) {
          if (c.active) store_packed<DT, C>(p, c.row, c.k0, c.full, r, nonfinite);  // no shuffles follow
          return;
        } else {
          // One code per 16-bit lane -> FP4: c0 | c1 << 4 in the low byte of r + (r >> 12), four such
          // bytes gathered per word; 8-bit codes: the lanes' low bytes.
          if constexpr (f.bits == 4) {
            if constexpr (C == 2) {
              pw[0] = r[0] + (r[0] >> 12);
            } else {
#pragma unroll
              for (int q = 0; q < C / 8; ++q) {
                u32 b[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) b[j] = r[4 * q + j] + (r[4 * q + j] >> 12);
                pw[q] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
              }
            }
          } else {
            if constexpr (C == 2) {
              pw[0] = __byte_perm(r[0], 0u, 0x0020);
            } else {
#pragma unroll
              for (int q = 0; q < C / 4; ++q) pw[q] = __byte_perm(r[2 * q], r[2 * q + 1], 0x6420);
            }
          }
          paired = true;
        }
      }
    }
    if (!paired) {
      unpack();
      if (p.rule == ScaleRule::qutlass_absmax) {  // QuTLASS quantizes 3x (numerics.md)
#pragma unroll
        for (int i = 0; i < C; ++i) xb[i] = f2u(mul_rn(3.0f, u2f(xb[i])));
      }
    } else {
      if (!QDQ && p.mask) unpack();  // the clip mask compares the elements
    }
    if (paired) {
      // codes in pw
    } else if (p.stochastic) {
      if (kFastOk && !f.twos_complement && e >= kELo && e <= kEHi) {
        // The unscaled stochastic rounding (fast_test proves it equal to encode_scaled_sr there).
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float r = sr_round_unscaled<ET>(xb[i], e, rnd[i]);
          if constexpr (QDQ) {
            out[i] = f2u(r) | (xb[i] & 0x80000000u);  // bf16: the high half, exact
          } else {
            // r is a grid value: r + Cc is exact, and its bits count r's quanta (as below).
            const u32 be = umax(f2u(r) & 0x7F800000u, lo), cb = be + kC;
            const u32 mag = umin(readoff_mag<f.mbits>(f2u(add_rn(r, u2f(cb))), be, cb, lo), f.maxcode);
            codes[i] = mag | ((xb[i] >> 31) << (f.bits - 1));
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          codes[i] = encode_scaled_sr<ET>(xb[i], e, rnd[i]);
          if (QDQ) out[i] = hi16<DT>(mx_dequant_finite<ET, DT>(codes[i], scale));
        }
      }
    } else {
      if (kF8Cvt<ET, QDQ> && e >= kELo && e <= kEHi) {
        // FP8 codes by the hardware conversion (sm_89+): x * 2^-e is exact there (or far below the
        // smallest subnormal, where both round to a signed zero), and cvt.rn.satfinite rounds to
        // nearest even and saturates as the reference does. Two codes per conversion: codes[i] holds
        // the bytes of elements i and i + 1 and codes[i + 1] is 0, which the packing below accepts.
#pragma unroll
        for (int i = 0; i < C; i += 2) {
          codes[i] = f8x2_satfinite<ET>(mul_rn(u2f(xb[i]), inv), mul_rn(u2f(xb[i + 1]), inv));
          codes[i + 1] = 0u;
        }
      } else if (kFastOk && e >= kELo && e <= kEHi) {
        const float maxv = mul_rn(u2f(max_value_bits(f)), scale);
        // NOTE: with the amax rules every |x| <= amax < 2^(emax + 1 + e), so the upper clamp of the
        // rounding binade never binds there; quest and the QuTLASS absmax rule can put x above it.
        auto round_all = [&](auto clamp_hi) {
#pragma unroll
          for (int i = 0; i < C; ++i) {
            u32 be = umax(xb[i] & 0x7F800000u, lo);  // exponent bits of the rounding binade
            if (decltype(clamp_hi)::value) be = umin(be, hi);
            const u32 cb = be + kC;
            const float Cc = u2f(cb);
            const float t = add_rn(fabs_op(u2f(xb[i])), Cc);  // Cc + n quanta: the grid point is t - Cc
            if constexpr (QDQ) {
              const float rm = fminf_nn(sub_rn(t, Cc), maxv);
              u32 sign = xb[i] & 0x80000000u;
              if (f.twos_complement) sign = rm != 0.0f ? sign : 0u;  // INT8 has no -0
              const u32 o = f2u(rm) | sign;                          // bf16: the high half, exact
              out[i] = o;  // never fp16 here
            } else {
              // readoff_mag; past the largest value it saturates.
              const u32 mag = umin(readoff_mag<f.mbits>(f2u(t), be, cb, lo), f.maxcode);
              codes[i] = mag | ((xb[i] >> 31) << (f.bits - 1));
            }
          }
        };
        if (p.rule == ScaleRule::quest || p.rule == ScaleRule::qutlass_absmax) round_all(std::true_type{});
        else round_all(std::false_type{});
      } else if constexpr (QDQ) {
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float rm = rne_mag<ET>(u2f(xb[i]), inv);
          u32 sign = xb[i] >> 31;
          if (f.twos_complement) sign &= u32(rm != 0.0f);
          out[i] = hi16<DT>(out_mag_bits<DT>(mul_rn(rm, scale)) | (sign << kSignBit));
        }
      } else {
#pragma unroll
        for (int i = 0; i < C; ++i) codes[i] = code_of<ET>(rne_mag<ET>(u2f(xb[i]), inv), xb[i] >> 31);
      }
    }
    if (!QDQ && p.mask) {  // the clip mask is optional: no compares when it is not wanted
      const float limit = mul_rn(u2f(max_value_bits(f)), scale);  // exact, or +Inf past FLT_MAX
#pragma unroll
      for (int i = 0; i < C; ++i) keep |= u32(!nonfinite && fabs_bits(u2f(xb[i])) < limit) << i;
    }
  }
  // Clip-mask byte of this chunk's elements; with C = 2 four adjacent lanes share a byte and OR their
  // bits together (rows hold a multiple of 4 chunks, so the four lanes are aligned and in one row).
  const i64 valid = is_flat<C>(p) ? C : p.K - c.k0 < C ? p.K - c.k0 : C;  // <= 0: the chunk is padding past K
  u32 mbyte = 0;  // C = 16: two bytes
  if (!QDQ && p.mask) {
    constexpr u32 kAll = (1u << C) - 1u;
    mbyte = valid <= 0 ? 0u : (keep & (valid >= C ? kAll : ((1u << valid) - 1u))) << (c.k0 % 8);
    if constexpr (C == 2) {
      mbyte |= __shfl_xor_sync(kFull, mbyte, 1);
      mbyte |= __shfl_xor_sync(kFull, mbyte, 2);
    }
  }
  if (!c.active) return;  // every shuffle is behind us

  if constexpr (QDQ) {
    store_chunk<DT, C>(p, c.row, c.k0, c.full, out, nonfinite);
  } else {
    if (valid <= 0) return;  // padding chunks own no bytes (lane 0 of a group is never padding)
    if (c.lane_in_group == 0) p.scales[scale_index<C>(p, c.row, c.block)] = sb;
    std::uint8_t* crow = p.codes + c.row * p.codes_stride;
    // Codes packed into 32-bit words: FP4 two per byte (low nibble first), others one per byte.
    constexpr int kBits = f.bits == 4 ? 4 : 8;
    constexpr int NB = C * kBits / 8;  // bytes of this chunk
    u32 w[(NB + 3) / 4] = {};
    if (paired) {
#pragma unroll
      for (int j = 0; j < (NB + 3) / 4; ++j) w[j] = pw[j];
    } else {
      // NOTE: every code is below 2^bits (sign bit included), so the fields do not overlap and a
      // shift-add (one LEA) packs each.
#pragma unroll
      for (int i = 0; i < C; ++i) w[i * kBits / 32] += codes[i] << ((i * kBits) % 32);
    }
#pragma unroll
    for (int j = 0; j < (NB + 3) / 4; ++j) w[j] = nonfinite ? 0u : w[j];  // a NaN/Inf block has zero codes
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
    if (p.mask && c.k0 % 8 == 0) {
      std::uint8_t* mrow = p.mask + c.row * p.mask_stride + c.k0 / 8;
      mrow[0] = static_cast<std::uint8_t>(mbyte);
      if (C == 16 && valid > 8) mrow[1] = static_cast<std::uint8_t>(mbyte >> 8);
    }
  }
}

// Loads of block_kernel: with cp.async the next kStages - 1 chunks of a thread are in flight while it
// computes one, independent of its registers.
// NOTE: tried on the H200 (2026-12-02): one chunk per thread and plain loads left the kernels
// latency-bound (~36% achieved occupancy, DRAM ~1/3 busy); holding four chunks per thread in
// registers instead halved the occupancy and was slower still.
constexpr int kStages = 4;

// Issues the cp.async of chunk i (nothing when i is past the end) into the shared slot at dst.
template <DType DT, int C, bool Static = true>
__device__ __forceinline__ void prefetch_chunk(const Params& p, i64 i, u32 dst) {
  using S = Storage<DT>;
  constexpr int B = vec_bytes<DT, C>();
  if (i >= p.total) return;
  if (is_flat<C, Static>(p)) {  // every chunk is complete and contiguous with the previous one
    const std::uint8_t* src = p.x + u64(i) * u64(B);
    if constexpr (B == 32) {
      cp_async<16>(dst, src, 16u);
      cp_async<16>(dst + 16, src + 16, 16u);
    } else {
      cp_async<B>(dst, src, u32(B));
    }
    return;
  }
  const Coord c = coord<C, Static>(p, i);
  const std::uint8_t* row = p.x + c.row * p.x_stride;
  const i64 valid = p.K - c.k0 < C ? (p.K - c.k0 > 0 ? p.K - c.k0 : 0) : C;  // padding chunks read nothing
  const std::uint8_t* src = valid > 0 ? row + c.k0 * i64(sizeof(S)) : row;
  const u32 bytes = u32(valid) * u32(sizeof(S));
  if constexpr (B == 32) {
    cp_async<16>(dst, src, bytes < 16 ? bytes : 16u);
    cp_async<16>(dst + 16, bytes > 16 ? src + 16 : src, bytes > 16 ? bytes - 16 : 0u);
  } else {
    cp_async<B>(dst, src, bytes);
  }
}

template <DType DT, int C>
__device__ __forceinline__ void read_slot(const std::uint8_t* slot, u32 (&w)[vec_bytes<DT, C>() / 4]) {
  constexpr int W = vec_bytes<DT, C>() / 4;
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 v = reinterpret_cast<const uint4*>(slot)[q];
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(slot);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const u32*>(slot);
  }
}

// Quantize (QDQ = false) or QDQ. A grid of at most one wave of resident blocks strides over the
// chunks; every thread of a block runs the same number of iterations (the group shuffles need whole
// warps). Views that are not vector-aligned load each chunk directly instead of through the ring.
template <ElemType ET, DType DT, int C, bool QDQ>
__global__ void __launch_bounds__(kThreads, C == 16 ? 3 : 1) block_kernel(const Params p) {
  constexpr int B = vec_bytes<DT, C>();
  constexpr bool kStatic = !QDQ;  // is_flat known at compile time (see is_flat)
  __shared__ __align__(16) std::uint8_t ring[kStages * kThreads * B];
  __shared__ NvTables nvt;
  const NvScale nv = nv_scale(p);
  if constexpr (ET == ElemType::e2m1)
    if (p.nvfp4) fill_nv_tables<DT, QDQ>(nv, nvt);  // every thread reaches the barrier: no exit before
  const i64 stride = i64(gridDim.x) * kThreads;
  const i64 block_first = i64(blockIdx.x) * kThreads;
  const i64 iters = (p.total - block_first + stride - 1) / stride;  // the grid never exceeds the work
  const i64 first = block_first + threadIdx.x;
  std::uint8_t* const mine = ring + threadIdx.x * B;
  const u32 mine_s = smem_addr(mine);
  if (p.x_vec) {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < iters) prefetch_chunk<DT, C, kStatic>(p, first + st * stride, mine_s + st * kThreads * B);
      cp_async_commit();
    }
  }
  int stage = 0;
  // i: this iteration's chunk; ahead_i: the chunk kStages - 1 iterations on. Quantize steps them
  // (ahead_i is past the end of the data exactly when past this block's last iteration, where
  // prefetch_chunk issues nothing); QDQ keeps the multiplications and the iteration test (measured:
  // the stepped form was slower for QDQ, faster for quantize).
  i64 i = first, ahead_i = first + (kStages - 1) * stride;
  for (i64 it = 0; it < iters; ++it) {
    if constexpr (QDQ) i = first + it * stride, ahead_i = first + (it + kStages - 1) * stride;
    const Coord c = coord<C, kStatic>(p, i);
    u32 xw[vec_bytes<DT, C>() / 4];  // the chunk as the input's own words
    if (p.x_vec) {
      const int ahead = stage == 0 ? kStages - 1 : stage - 1;  // the slot read one iteration ago
      if (!QDQ || it + kStages - 1 < iters) prefetch_chunk<DT, C, kStatic>(p, ahead_i, mine_s + ahead * kThreads * B);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      // NOTE: a thread past the end reads a stale slot. Its group is wholly past the end too (the
      // chunk count is a multiple of T, and of 4 when C = 2), so no shuffle mixes its values with
      // live ones, and nothing of it is stored; zeroing would cost C selects on every chunk.
      read_slot<DT, C>(mine + stage * kThreads * B, xw);
    } else if (c.active) {
      load_chunk_words<DT, C>(p, c.row, c.k0, c.full, xw);
    } else {
#pragma unroll
      for (int j = 0; j < vec_bytes<DT, C>() / 4; ++j) xw[j] = 0;
    }
    process_chunk<ET, DT, C, QDQ>(p, c, nv, nvt, xw);
    stage = stage == kStages - 1 ? 0 : stage + 1;
    if constexpr (!QDQ) i += stride, ahead_i += stride;
  }
}

// ---- dequantize -------------------------------------------------------------------------------------------
template <ElemType ET, int C>
__device__ __forceinline__ void load_codes(const Params& p, const Coord& c, u32 (&codes)[C], std::uint8_t& sb,
                                           u32 (&w)[code_words<ET, C>()]) {
  constexpr FloatSpec f = Elem<ET>::spec;
  sb = p.scales[scale_index<C>(p, c.row, c.block)];
  const std::uint8_t* crow = p.codes + c.row * p.codes_stride;
  const i64 valid = p.K - c.k0 < C ? p.K - c.k0 : C;
  constexpr int kBits = f.bits == 4 ? 4 : 8;
  constexpr int NB = C * kBits / 8;
#pragma unroll
  for (int j = 0; j < (NB + 3) / 4; ++j) w[j] = 0;
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
__device__ __forceinline__ void dequant_chunk(const Params& p, const Coord& c, const NvScale& nv, const u32 (&codes)[C],
                                              std::uint8_t sb, const u32 (&cw)[code_words<ET, C>()]) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  if constexpr (ET == ElemType::e2m1 && DT == DType::bf16 && C % 8 == 0) {
    u32 o[C / 2];
    if (!p.nvfp4) {
      // MXFP4, a finite scale 2^e with e in [-125, 125]: every product is a normal bf16, so the table
      // is the eight magnitudes' bf16 bits with e added to the exponent field (0 stays 0; for e < 0
      // the add wraps without a borrow between the halves).
      const int e = int(sb) - kE8M0Bias;
      if (e >= -125 && e <= 125) {
        const u32 d = u32(e) << 7, d2 = d * 0x10001u;  // bf16 bits of 0, 0.5 | 1, 1.5 | 2, 3 | 4, 6
        fp4_bf16_lookup<C>(cw, 0x3F000000u + (d << 16), 0x3FC03F80u + d2, 0x40404000u + d2, 0x40C04080u + d2, 0u, o);
        store_packed<DT, C>(p, c.row, c.k0, c.full, o, false);
        return;
      }
    } else if ((sb & 0x7F) != kE4M3NaN) {
      // NVFP4: the eight magnitudes' outputs (E2M1 value * s) / S once per chunk (C = 16 is one block);
      // the sign is the code's XOR the scale byte's (see below).
      u32 t[4];
      nv_table<DT>(decode_f32(sb & 0x7Fu, spec_e4m3()), nv, t);
      fp4_bf16_lookup<C>(cw, t[0], t[1], t[2], t[3], (sb & 0x80u) ? 0x88888888u : 0u, o);
      store_packed<DT, C>(p, c.row, c.k0, c.full, o, false);
      return;
    }
  }
  if constexpr (ET == ElemType::e4m3 && DT == DType::bf16) {
    // MXFP8 (E4M3) under a finite scale 2^e, e in [-117, 119], no NaN code in the chunk: e4m3_bf16_hi.
    const int e = int(sb) - kE8M0Bias;
    bool nan_code = false;
#pragma unroll
    for (int i = 0; i < C; ++i) nan_code |= (codes[i] & 0x7Fu) == 0x7Fu;
    if (e >= -117 && e <= 119 && !nan_code) {
      const float sc = pow2f(e), sc2 = pow2f(e + 1);
      u32 out[C];
#pragma unroll
      for (int i = 0; i < C; ++i) out[i] = e4m3_bf16_hi(codes[i], sc, sc2);
      store_chunk<DT, C>(p, c.row, c.k0, c.full, out, false);
      return;
    }
  }
  u32 out[C];
  if (ET == ElemType::e2m1 && p.nvfp4) {
    // A scale byte with its sign bit set (not produced by quantize, but any byte is accepted) flips the
    // sign of the block: the product's sign is the XOR, its magnitude that of |s|.
    const float sval = decode_f32(sb & 0x7Fu, spec_e4m3());
    const u32 ssign = u32(sb) >> 7;
    auto decode = [&](auto fast) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const u32 o = nv_out<decltype(fast)::value, DT>(mul_rn(e2m1_value(codes[i] & 7u), sval), (codes[i] >> 3) ^ ssign, nv);
        out[i] = hi16<DT>(o);
      }
    };
    if (nv.fast) decode(std::true_type{});
    else decode(std::false_type{});
  } else {
    const float scale = pow2f(int(sb) - kE8M0Bias);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      u32 sign = 0, n = 0;
      int pe = 0;
      if (sb == kE8M0NaN || !decode_parts(codes[i], f, sign, n, pe)) {
        out[i] = hi16<DT>(mx_dequant_bits(codes[i], sb, f, DT));
      } else {
        const float v = mul_rn(mul_rn(float(n), pow2f(pe)), scale);  // exact, or +Inf past FLT_MAX
        out[i] = hi16<DT>(out_mag_bits<DT>(v) | (sign << kSignBit));
      }
    }
  }
  store_chunk<DT, C>(p, c.row, c.k0, c.full, out, ET == ElemType::e2m1 && p.nvfp4 && (sb & 0x7F) == kE4M3NaN);
}

template <ElemType ET, DType DT, int C>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const Params p) {
  const Coord c = coord<C>(p, i64(blockIdx.x) * kThreads + threadIdx.x);
  if (!c.active || c.k0 >= p.K) return;
  u32 codes[C], cw[code_words<ET, C>()];
  std::uint8_t sb;
  load_codes<ET, C>(p, c, codes, sb, cw);
  dequant_chunk<ET, DT, C>(p, c, nv_scale(p), codes, sb, cw);
}

// ---- tensor amax, scale layouts, small helpers ------------------------------------------------------------
// max |x| as fp32 bits over the view, ORed into *acc with atomicMax (acc zeroed first). NaN bits
// compare above +Inf, so a NaN anywhere gives NaN.
template <DType DT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const Params p, u32* acc) {
  constexpr int C = 8, U = 4;  // U chunks loaded before any is reduced: loads in flight
  u32 m = 0;
  const i64 stride = i64(gridDim.x) * kThreads;
  for (i64 i = i64(blockIdx.x) * kThreads + threadIdx.x; i < p.total; i += U * stride) {
    u32 xb[U][C];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = i + u * stride;
      const i64 row = j / p.cpr, k0 = (j - row * p.cpr) * C;
      if (j < p.total) {
        load_chunk<DT, C>(p, row, k0, k0 + C <= p.K, xb[u]);
      } else {
#pragma unroll
        for (int e = 0; e < C; ++e) xb[u][e] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < C; ++e) m = umax(m, xb[u][e] & 0x7FFFFFFFu);
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

// Grid of a block_kernel launch: enough blocks for every chunk, at most one wave of resident blocks
// (the kernel strides over the rest). Blocks per SM come from the occupancy calculator once per
// kernel and device, capped at cap when cap > 0.
// NOTE: measured on the H200 (2026-12-03, 16-element kernels, 3 blocks fit per SM): QDQ with RNE and
// the FP8 quantize (the least work per element) ran faster at 2 blocks per SM (QDQ MXFP4 8192^2 78.4
// against 83.5 us), quantize MXFP4/NVFP4 and stochastic rounding at 3 (NVFP4 quantize 89.7 against
// 99.8 us).
template <auto Kernel>
unsigned wave_grid(const char* fn, i64 threads, int cap = 0) {
  static std::atomic<int> wave[64] = {};  // blocks per SM * 65536 + SMs
  int dev = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  std::atomic<int>& w = wave[dev & 63];
  int n = w.load(std::memory_order_relaxed);
  if (n == 0) {
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0), fn, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    n = std::max(per_sm, 1) * 65536 + sm_count(fn);
    w.store(n, std::memory_order_relaxed);
  }
  const int per_sm = cap > 0 ? std::min(n >> 16, cap) : n >> 16;
  return unsigned(std::min<i64>(launch_blocks(fn, threads), i64(per_sm) * (n & 0xFFFF)));
}

// Chunk width and layout of a launch. Dense problems (every group complete, every view
// row-contiguous) run flat, 2-byte dtypes then 16 elements per thread (fewer per-chunk instructions
// per element); the rest run row by row, 8 elements per thread (2 for groups of 2 and 4).
struct Plan {
  int C = 8;
  bool flat = false;
};
Plan make_plan(const Problem& p, int dtype_bytes, bool dense_views) {
  Plan pl;
  pl.C = p.g >= 8 ? 8 : 2;
  pl.flat = dense_views && pl.C == 8 && p.K % p.g == 0 && p.rows * p.K / 8 < (i64(1) << 31) &&
            p.scale_rows_padded * p.scale_cols_padded < (i64(1) << 32);  // swizzled_offset32
  if (pl.flat && dtype_bytes == 2 && p.g % 16 == 0) pl.C = 16;
  return pl;
}
// Row-contiguous views of the quantized side: codes, linear scales (swizzled ones are addressed by
// (row, column) in any case) and the optional clip mask.
bool dense_quantized(const Problem& p, const Tensor& codes, const Tensor& scales, const Tensor* mask) {
  const i64 code_cols = p.fp4 ? p.K / 2 : p.K;
  if (codes.stride() != code_cols) return false;
  if (p.opt.scale_layout != ScaleLayout::swizzled && scales.stride() != p.nblocks) return false;
  return !mask || !mask->data || mask->stride() == (p.K + 7) / 8;
}

// Geometry common to every chunked kernel.
Params base_params(const Problem& p, const Plan& pl) {
  const int C = pl.C;
  Params k;
  k.rows = p.rows;
  k.K = p.K;
  k.g = p.g;
  k.T = p.g / C;
  k.log2T = 0;
  while ((1 << k.log2T) < k.T) ++k.log2T;
  k.cpr = p.nblocks * k.T;
  if (C == 2) k.cpr = (k.cpr + 3) / 4 * 4;  // clip-mask bytes: 4 lanes per byte, aligned in the warp
  if (pl.flat) {
    k.flat = true;
    k.row_blocks = p.nblocks;
    k.row_blocks_div = FastDiv(u32(p.nblocks));
    k.K = p.rows * p.K;
    k.rows = 1;
    k.cpr = p.rows * k.cpr;
  }
  k.total = k.rows * k.cpr;
  k.small = k.total < (i64(1) << 31);
  if (k.small && !k.flat) k.cpr_div = FastDiv(u32(k.cpr));
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

// Chunk widths compiled: 16 for 2-byte dtypes only.
template <DType DT, class F>
void dispatch_chunk(int C, F&& f) {
  if constexpr (DT != DType::f32)
    if (C == 16) return f(std::integral_constant<int, 16>{});
  if (C >= 8) return f(std::integral_constant<int, 8>{});
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
  const Plan pl = make_plan(p, dtype_size(x.dtype), x.stride() == p.K && dense_quantized(p, out.codes, out.scales, &out.clip_mask));
  const int C = pl.C;
  Params k = base_params(p, pl);
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
      constexpr DType DT = decltype(dt)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
        constexpr int CC = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, CC>());
        constexpr bool kFp8 = ET == ElemType::e4m3 || ET == ElemType::e5m2;
        block_kernel<ET, DT, CC, false><<<wave_grid<block_kernel<ET, DT, CC, false>>(fn, k.total, kFp8 ? 2 : 0), kThreads, 0, s>>>(k);
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
  const Plan pl = make_plan(p, dtype_size(x.dtype), x.stride() == p.K && y.stride() == p.K);
  Params k = base_params(p, pl);
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.amax = acc;
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(x.dtype, [&](auto dt) {
      constexpr DType DT = decltype(dt)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
        constexpr int CC = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, CC>());
        k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, CC>());
        block_kernel<ET, DT, CC, true><<<wave_grid<block_kernel<ET, DT, CC, true>>(fn, k.total, k.stochastic ? 0 : 2), kThreads, 0, s>>>(k);
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
  const Plan pl = make_plan(p, dtype_size(y.dtype), y.stride() == p.K && dense_quantized(p, q.codes, q.scales, nullptr));
  const int C = pl.C;
  Params k = base_params(p, pl);
  k.codes = static_cast<std::uint8_t*>(q.codes.data);
  k.codes_stride = q.codes.stride();
  k.scales = static_cast<std::uint8_t*>(q.scales.data);
  k.scales_stride = q.scales.stride();
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.codes_vec = aligned(k.codes, k.codes_stride, p.fp4 ? C / 2 : C);
  dispatch_elem(p.info.elem, [&](auto et) {
    dispatch_dtype(y.dtype, [&](auto dt) {
      constexpr DType DT = decltype(dt)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr ElemType ET = decltype(et)::value;
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
