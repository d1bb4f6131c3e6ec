#pragma once
// Host side of the chunked kernels: the launch plan (chunk width, flat or by rows), the parameters of
// a problem, and the grid of a wave-limited launch.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/problem.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// Chunk width and layout of a launch. Dense problems (every group complete, every view
// row-contiguous) run flat, 2-byte dtypes then 16 elements per thread (fewer per-chunk instructions
// per element); the rest run row by row, 8 elements per thread (2 for groups of 2 and 4).
struct Plan {
  int C = 8;
  bool flat = false;
};
inline Plan make_plan(const core::Problem& p, int dtype_bytes, bool dense_views) {
  Plan pl;
  pl.C = p.g >= 8 ? 8 : 2;
  pl.flat = dense_views && pl.C == 8 && p.K % p.g == 0 && p.rows * p.K / 8 < (i64(1) << 31) &&
            p.scale_rows_padded * p.scale_cols_padded < (i64(1) << 32);  // swizzled_offset32
  if (pl.flat && dtype_bytes == 2 && p.g % 16 == 0) pl.C = 16;
  return pl;
}
// MXQ_CUDA_QDQ_CHUNK=8 or 16: the QDQ launches' chunk width forced where the plan has 16 (a test and
// benchmark switch, read once per process); 0 when unset. Any other value is refused at each call.
inline int qdq_chunk_override(const char* fn) {
  static const int n = [] {
    const char* v = std::getenv("MXQ_CUDA_QDQ_CHUNK");
    if (!v || !*v) return 0;
    return std::strcmp(v, "8") == 0 ? 8 : std::strcmp(v, "16") == 0 ? 16 : -1;
  }();
  if (n < 0) throw Error(Error::Code::invalid_argument, std::string(fn) + ": MXQ_CUDA_QDQ_CHUNK must be 8 or 16 (or unset)");
  return n;
}
// QDQ launches too small to give every SM a block at 16-element chunks (decode: a few rows) take 8:
// twice the threads, each with half the dependent work, which is what such a launch waits on. Only
// where it measured faster (H100, 2026-12-06, 16x8192 bf16 in a CUDA graph): the rotated launches
// (this rule: NVFP4 given S had128 3.43 -> 2.89 us, MXFP4 had128 2.63 -> 2.26 us) and NVFP4 with a
// given S (2.53 -> 2.43 us); with 8 forced, the plain MX ones were slower (1.82 -> 1.90 us), as were
// a computed S (it loses the fused amax) and 256 rows; NVFP4 quest (S = 1) not measured.
inline Plan small_qdq_plan(const char* fn, const core::Problem& p, Plan pl) {
  if (pl.C != 16) return pl;
  if (const int forced = qdq_chunk_override(fn)) {
    pl.C = forced;
    return pl;
  }
  const bool nv_given = p.opt.format == Format::nvfp4 && !p.amax_acc && p.opt.rule != ScaleRule::quest;
  const bool rotated = p.opt.rotation != Rotation::none;
  if ((rotated || nv_given) && p.rows * p.K / 16 < i64(sm_count(fn)) * kThreads) pl.C = 8;
  return pl;
}
// The chunk width whose kernels are compiled with every choice static (the flat launches of 2-byte
// dtypes, every launch of fp32 with groups of 8 or more); other widths take the runtime choices.
template <DType DT>
constexpr int fast_chunk() {
  return DT == DType::f32 ? 8 : 16;
}
// Chunk widths compiled: 16 for 2-byte dtypes only.
template <DType DT, class F>
void dispatch_chunk(int C, F&& f) {
  if constexpr (DT != DType::f32)
    if (C == 16) return f(std::integral_constant<int, 16>{});
  if (C >= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 2>{});
}

// Row-contiguous views of the quantized side: codes, linear scales (swizzled ones are addressed by
// (row, column) in any case) and the optional clip mask.
inline bool dense_quantized(const core::Problem& p, const Tensor& codes, const Tensor& scales, const Tensor* mask) {
  const i64 code_cols = p.fp4 ? p.K / 2 : p.K;
  if (codes.stride() != code_cols) return false;
  if (p.opt.scale_layout != ScaleLayout::swizzled && scales.stride() != p.nblocks) return false;
  return !mask || !mask->data || mask->stride() == (p.K + 7) / 8;
}

// Geometry and options common to every chunked kernel.
inline Params base_params(const core::Problem& p, const Plan& pl) {
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
  k.arule = core::amax_rule(p.opt.rule, p.elem);
  k.stochastic = p.stochastic;
  k.swizzled = p.opt.scale_layout == ScaleLayout::swizzled;
  k.seed = p.opt.seed;
  k.offset = p.opt.offset;
  k.sr_bits = p.sr_bits;
  k.S = p.S;
  k.amax = p.amax_acc;
  return k;
}

inline cudaStream_t stream_of(const core::Problem& p) { return static_cast<cudaStream_t>(p.opt.stream); }

// Grid of a wave-limited launch (block_kernel): enough blocks for every chunk, at most one wave of
// resident blocks (the kernel strides over the rest). Blocks per SM come from the occupancy calculator
// once per kernel and device, capped at cap when cap > 0.
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

}  // namespace mxq::cuda
