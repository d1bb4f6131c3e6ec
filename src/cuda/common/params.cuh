#pragma once
// The kernel parameters (runtime arguments and the launch geometry derived from them, together) and
// the chunk indexing, loads and stores every chunked kernel shares.
//
// Work decomposition: a row of K elements is cut into chunks of C contiguous elements (C = 16, 8, or 2
// for group sizes 2 and 4); one thread owns one chunk at a time, and the T = g / C threads of a group
// are adjacent lanes of one warp, so block reductions (amax, the quest sums) are xor-shuffles inside
// the group. Dense tensors (every group complete, row-contiguous views) run "flat": the tensor is one
// long row, a chunk's address is base + i * bytes.
#include <cstdint>

#include "core/format_traits.hpp"
#include "core/problem.hpp"
#include "cuda/common/config.cuh"
#include "cuda/common/vector_io.cuh"

namespace mxq::cuda {

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

// Everything a kernel needs, by value (kernel parameter space), and the grid it is launched with:
// the launcher that fills it sets `blocks`, so kernel and grid cannot drift apart.
struct Params {
  const std::uint8_t* x = nullptr;  // (rows, K) DT, row stride x_stride bytes
  i64 x_stride = 0;
  std::uint8_t* y = nullptr;        // (rows, K) DT, row stride y_stride bytes
  i64 y_stride = 0;
  std::uint8_t* codes = nullptr;    // (rows, code_cols) u8
  i64 codes_stride = 0;
  std::uint8_t* scales = nullptr;   // linear (rows, nblocks) u8, or swizzled (dense)
  i64 scales_stride = 0;
  std::uint8_t* mask = nullptr;     // optional (rows, ceil(K/8)) u8, one bit per element
  i64 mask_stride = 0;
  i64 rows = 0, K = 0, cpr = 0, total = 0;  // chunks per row, chunks in all
  i64 scale_cols_padded = 0;
  FastDiv cpr_div;
  // Flat: a dense tensor (K a multiple of g, every view row-contiguous) is run as one row of rows * K
  // elements, so chunk i sits at element C * i with no division; row_blocks (blocks per real row)
  // recovers the (row, column) of a scale where the layout needs it.
  bool flat = false;
  i64 row_blocks = 0;
  FastDiv row_blocks_div;
  bool small = true;  // total < 2^31: 32-bit index arithmetic
  int g = 32, T = 4, log2T = 2;
  // Runtime variants only (ScaleChoice::runtime / RoundChoice::runtime kernels): the rule and the
  // rounding; every other kernel has them as template parameters.
  ScaleRule rule = ScaleRule::floor;
  bool stochastic = false;
  core::AmaxRule arule;  // floor/ceil/even/rceil as constants (core/format_traits.hpp)
  bool swizzled = false;
  bool x_vec = false, y_vec = false, codes_vec = false;
  u64 seed = 0, offset = 0;
  int sr_bits = 32;  // stochastic rounding: random bits per element (32, 16, 8)
  float S = 1.0f;
  u32* amax = nullptr;  // NVFP4: S comes from this tensor amax (fp32 bits) when set
  // NVFP4 with amax set, flat and vector-aligned: block_kernel reduces the amax itself (cooperative
  // launch, one grid-wide barrier) instead of a separate amax kernel before it.
  bool fused_amax = false;
  // Fused amax: the last l2_keep_iters iterations of every thread are read with normal L2 priority,
  // the earlier ones evict-first, so that what the reverse second pass reads first is still there.
  i64 l2_keep_iters = 0;
  // Rotation before quantization (cuda/common/rotation.cuh): rot_size elements per group (0: none),
  // the fp32 normalizer RN32(1/sqrt(rot_size)) and, for the randomised Hadamard, its 256 sign bits.
  int rot_size = 0;
  float rot_norm = 1.0f;
  u32 rot_signs[8] = {};
  unsigned blocks = 0;  // the grid
};

// Chunk coordinates of the calling thread.
struct Coord {
  i64 row, k0, block;
  int lane_in_group;
  bool active, full;
};
// Flat launches: every dense problem, and every launch with C = 16 (the launcher's plan), so known at
// compile time there (Static): no row arithmetic, every chunk complete.
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

// A chunk of x as fp32 bits (elements past K read as 0).
template <DType DT, int C>
__device__ __forceinline__ void load_chunk(const Params& p, i64 row, i64 k0, bool full, u32 (&xb)[C]) {
  using S = Storage<DT>;
  const S* src = reinterpret_cast<const S*>(p.x + row * p.x_stride) + k0;
  if (full && p.x_vec) {
    constexpr int W = vec_words<DT, C>();
    u32 w[W];
    load_words<W>(src, w);
    unpack_words<DT, C, W>(w, xb);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) xb[i] = to_f32_bits<DT>(k0 + i < p.K ? src[i] : S(0));
  }
}

// A chunk of x as the view's own little-endian words (elements past K read as 0).
template <DType DT, int C>
__device__ __forceinline__ void load_chunk_words(const Params& p, i64 row, i64 k0, bool full, u32 (&w)[vec_words<DT, C>()]) {
  using S = Storage<DT>;
  constexpr int W = vec_words<DT, C>();
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

// Stores a chunk's output words into y: C outputs of DT packed little-endian (two per word for 2-byte
// dtypes). nan: the whole chunk is NaN.
template <DType DT, int C>
__device__ __forceinline__ void store_packed(const Params& p, i64 row, i64 k0, bool full, const u32 (&w)[vec_words<DT, C>()],
                                             bool nan) {
  using S = Storage<DT>;
  constexpr int W = vec_words<DT, C>();
  S* dst = reinterpret_cast<S*>(p.y + row * p.y_stride) + k0;
  if (full && p.y_vec) {
    constexpr u32 kNanWord = DT == DType::f32 ? 0x7FC00000u : core::nan_bits(DT) * 0x10001u;
    u32 v[W];
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = nan ? kNanWord : w[j];
    store_words<W>(dst, v);
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i)
      if (k0 + i < p.K) dst[i] = static_cast<S>(nan ? core::nan_bits(DT) : sizeof(S) == 4 ? w[i] : w[i / 2] >> (16 * (i % 2)));
  }
}
// store_packed of C outputs in hi16 form.
template <DType DT, int C>
__device__ __forceinline__ void store_chunk(const Params& p, i64 row, i64 k0, bool full, const u32 (&ob)[C], bool nan) {
  u32 w[vec_words<DT, C>()];
  pack_outputs<DT, C>(ob, w);
  store_packed<DT, C>(p, row, k0, full, w, nan);
}

}  // namespace mxq::cuda
