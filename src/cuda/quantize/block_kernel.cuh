#pragma once
// The quantize / QDQ kernel: a grid of at most one wave of resident blocks strides over the chunks;
// each thread keeps its next chunks in flight through a per-thread cp.async ring in shared memory, so
// memory parallelism does not cost registers. The chunk itself is mx_chunk or nvfp4_chunk.
#include <cooperative_groups.h>

#include "cuda/common/params.cuh"
#include "cuda/common/rotation.cuh"
#include "cuda/common/vector_io.cuh"
#include "cuda/quantize/mx_chunk.cuh"
#include "cuda/quantize/nvfp4_chunk.cuh"

namespace mxq::cuda {

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

// The fused tensor amax (Params::fused_amax): max |x| over this thread's chunks (first + it * stride,
// flat and vector-aligned), four loads in flight, reduced over the block and atomicMax'ed into
// *p.amax (zeroed before the launch). The part of x read last is loaded with normal L2 priority (the
// rest evict-first) and is still in the L2 when the second pass starts there.
template <DType DT, int C>
__device__ __forceinline__ void reduce_fused_amax(const Params& p, i64 first, i64 stride, i64 iters) {
  constexpr int W = vec_words<DT, C>(), U = 4;
  u32 m = 0;
  for (i64 it = 0; it < iters; it += U) {
    u32 w[U][W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = first + (it + u) * stride;
      if (it + u < iters && i < p.total) {  // the last iteration of a block may be partly past the end
        const uint4* src = reinterpret_cast<const uint4*>(p.x + u64(i) * u64(vec_bytes<DT, C>()));
        const bool keep = it + u >= iters - p.l2_keep_iters;  // uniform over the block
#pragma unroll
        for (int q = 0; q < W / 4; ++q) {
          const uint4 v = keep ? __ldcg(src + q) : __ldcs(src + q);
          w[u][4 * q] = v.x, w[u][4 * q + 1] = v.y, w[u][4 * q + 2] = v.z, w[u][4 * q + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) w[u][j] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (DT == DType::bf16) {
        m = umax(m, bf16_words_amax<C>(w[u]));
      } else {
        u32 xb[C];
        unpack_words<DT, C, W>(w[u], xb);
#pragma unroll
        for (int e = 0; e < C; ++e) m = umax(m, xb[e] & 0x7FFFFFFFu);
      }
    }
  }
  block_max_into(m, p.amax);
}

// Quantize (QDQ = false) or QDQ of format Fmt from dtype DT, C elements per chunk, choices Ch. Every
// thread of a block runs the same number of iterations (the group shuffles need whole warps). Views
// that are not vector-aligned load each chunk directly instead of through the ring.
// FUSED (NVFP4 with Params::fused_amax, a cooperative launch): first the tensor amax over the whole
// grid, one grid-wide barrier, then the chunks in reverse order (the last read are in the L2).
// ROT (Params::rot_size set): each chunk is rotated (cuda/common/rotation.cuh) and the fp32 result
// quantized, QDQ's outputs rounded to DT.
// Register budget: three blocks per SM at 16-element chunks, except the rotated runtime-choice kernels
// (the rotation's values live beside every rule's code: they spilled at that budget).
template <class Fmt, DType DT, int C, bool QDQ, class Ch, bool FUSED = false, bool ROT = false>
__global__ void __launch_bounds__(kThreads, C == 16 && !(ROT && Ch::round == RoundChoice::runtime) ? 3 : 1)
    block_kernel(const Params p) {
  static_assert(!FUSED || Fmt::nvfp4, "only NVFP4 derives a scale from the tensor amax");
  static_assert(!(FUSED && ROT), "a rotated NVFP4 launch takes its tensor amax from rotated_amax_kernel");
  constexpr int B = vec_bytes<DT, C>();
  constexpr int W = vec_words<DT, C>();
  constexpr bool kStatic = !QDQ && !FUSED;  // is_flat known at compile time, and the stepped loop
  __shared__ __align__(16) std::uint8_t ring[kStages * kThreads * B];
  __shared__ NvTables nvt;
  const i64 stride = i64(gridDim.x) * kThreads;
  const i64 block_first = i64(blockIdx.x) * kThreads;
  const i64 iters = (p.total - block_first + stride - 1) / stride;  // the grid never exceeds the work
  const i64 first = block_first + threadIdx.x;
  NvScale nv;
  if constexpr (Fmt::nvfp4) {
    if constexpr (FUSED) {
      reduce_fused_amax<DT, C>(p, first, stride, iters);
      cooperative_groups::this_grid().sync();
    }
    nv = nv_scale(p);
    fill_nv_tables<DT, QDQ>(nv, nvt);  // every thread reaches the barrier: no exit before
  }
  // The chunk of iteration it: forward, or (FUSED) backward.
  auto chunk_of = [&](i64 it) { return first + (FUSED ? iters - 1 - it : it) * stride; };
  u32 rsigns = 0;
  if constexpr (ROT) rsigns = rotation_lane_signs<C>(p);
  std::uint8_t* const mine = ring + threadIdx.x * B;
  const u32 mine_s = smem_addr(mine);
  if (p.x_vec) {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < iters) prefetch_chunk<DT, C, kStatic>(p, chunk_of(st), mine_s + st * kThreads * B);
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
    if constexpr (!kStatic) i = chunk_of(it), ahead_i = chunk_of(it + kStages - 1);
    const Coord c = coord<C, kStatic>(p, i);
    u32 xw[W];  // the chunk as the input's own words
    if (p.x_vec) {
      const int ahead = stage == 0 ? kStages - 1 : stage - 1;  // the slot read one iteration ago
      if (kStatic || it + kStages - 1 < iters) prefetch_chunk<DT, C, kStatic>(p, ahead_i, mine_s + ahead * kThreads * B);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      // NOTE: a thread past the end reads a stale slot. Its group is wholly past the end too (the
      // chunk count is a multiple of T, and of 4 when C = 2), so no shuffle mixes its values with
      // live ones, and nothing of it is stored; zeroing would cost C selects on every chunk.
      read_slot<W>(mine + stage * kThreads * B, xw);
    } else if (c.active) {
      load_chunk_words<DT, C>(p, c.row, c.k0, c.full, xw);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) xw[j] = 0;
    }
    if constexpr (ROT) {
      u32 xr[C];  // the rotated chunk, fp32 bits
      unpack_words<DT, C, W>(xw, xr);
      rotate_chunk<C, false>(p, rsigns, xr);
      if constexpr (Fmt::nvfp4) nvfp4_chunk<DType::f32, C, QDQ, Ch, DT>(p, c, nv, nvt, xr);
      else mx_chunk<Fmt, DType::f32, C, QDQ, Ch, DT>(p, c, xr);
    } else if constexpr (Fmt::nvfp4) {
      nvfp4_chunk<DT, C, QDQ, Ch>(p, c, nv, nvt, xw);
    } else {
      mx_chunk<Fmt, DT, C, QDQ, Ch>(p, c, xw);
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
    if constexpr (kStatic) i += stride, ahead_i += stride;
  }
}

}  // namespace mxq::cuda
