// The rotated dequantize (dequantize, then the inverse rotation, rounded to y's dtype) and the tensor
// amax of a rotated tensor (NVFP4's computed tensor scale under a rotation).
#include "core/dispatch.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/reductions.cuh"
#include "cuda/common/rotation.cuh"
#include "cuda/dequantize/dequantize_chunk.cuh"
#include "cuda/dequantize/dequantize_launch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {
namespace {

// One chunk per thread as dequant_kernel, but no thread leaves before the rotation's shuffles: chunks
// past the end (whole rotation groups) carry zeros through them and store nothing. The values are
// decoded to fp32 (dequant_f32), rotated back and rounded once to DT; a NaN anywhere in a rotation
// group makes the group NaN (the canonical NaN).
template <class Fmt, DType DT, int C>
__global__ void __launch_bounds__(kThreads) dequant_rotated_kernel(const Params p) {
  const Coord c = coord<C>(p, i64(blockIdx.x) * kThreads + threadIdx.x);
  const bool live = c.active && c.k0 < p.K;
  u32 v[C];
#pragma unroll
  for (int e = 0; e < C; ++e) v[e] = 0;
  if (live) dequant_f32<Fmt, C>(p, c, v);
  rotate_chunk<C, true>(p, rotation_lane_signs<C>(p), v);
  if (!live) return;
  store_rounded_chunk<DT, C>(p, c, v);
}

// max |x R| over the chunks of the launch described by k (fp32 bits), atomicMax'ed into *acc. Every
// lane of a block runs the same iterations (the rotation's shuffles); four chunks in flight.
template <DType DT, int C>
__global__ void __launch_bounds__(kThreads) rotated_amax_kernel(const Params p, u32* acc) {
  constexpr int W = vec_words<DT, C>(), U = 4;
  const i64 stride = i64(gridDim.x) * kThreads;
  const i64 block_first = i64(blockIdx.x) * kThreads;
  const i64 iters = (p.total - block_first + stride - 1) / stride;
  const u32 signs = rotation_lane_signs<C>(p);
  u32 m = 0;
  for (i64 it = 0; it < iters; it += U) {
    u32 xr[U][C];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const Coord c = coord<C, false>(p, block_first + threadIdx.x + (it + u) * stride);
      u32 w[W];
      if (c.active) {
        load_chunk_words<DT, C>(p, c.row, c.k0, c.full, w);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) w[j] = 0;
      }
      unpack_words<DT, C, W>(w, xr[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      rotate_chunk<C, false>(p, signs, xr[u]);
#pragma unroll
      for (int e = 0; e < C; ++e) m = umax(m, xr[u][e] & 0x7FFFFFFFu);
    }
  }
  block_max_into(m, acc);
}

}  // namespace

void enqueue_rotated_amax(const char* fn, DType dt, const Plan& pl, const Params& k, u32* acc, cudaStream_t s) {
  check(cudaMemsetAsync(acc, 0, sizeof(u32), s), fn, "zeroing the amax accumulator");
  if (k.total == 0) return;
  Params a = k;
  a.blocks = unsigned(std::min<i64>(launch_blocks(fn, a.total), i64(sm_count(fn)) * 8));
  core::dispatch_dtype(dt, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
    dispatch_chunk<DT>(pl.C, [&](auto cc) {
      constexpr int C = decltype(cc)::value;
      if constexpr (C >= 8) {
        a.x_vec = aligned(a.x, a.x_stride, vec_align<DT, C>());
        rotated_amax_kernel<DT, C><<<a.blocks, kThreads, 0, s>>>(a, acc);
      }
    });
  });
  check_launch(fn, "rotated amax kernel");
}

void dequantize_rotated(const core::Problem& p, const QuantizedIn& q, const Tensor& y) {
  const cudaStream_t s = stream_of(p);
  DequantLaunch l = dequant_launch(p, q, y);
  set_rotation(l.k, p.opt);
  dispatch_dequant(p, y.dtype, l, [&](auto fmt, auto dt, auto cc) {
    if constexpr (decltype(cc)::value >= 8)
      dequant_rotated_kernel<decltype(fmt), decltype(dt)::value, decltype(cc)::value><<<l.k.blocks, kThreads, 0, s>>>(l.k);
    else
      throw Error(Error::Code::internal, std::string(p.fn) + ": a rotated launch with chunks of 2 (groups of 2 or 4)");
  });
  check_launch(p.fn, "rotated dequantize kernel");
}

}  // namespace mxq::cuda
