#pragma once
// Host side of the matrix rotation's kernels (rotate_matrix_launch.cu, rotate_matrix_dequantize_launch.cu):
// their arguments and their launch.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "cuda/common/launch.cuh"
#include "cuda/rotate/matrix_bf16.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

inline MatrixArgs matrix_args(const QuantOptions& o, bool inverse, DType dt) {
  const Tensor& r = inverse ? o.rotation_inverse : o.rotation_matrix;
  MatrixArgs m;
  m.R = r.data;
  m.r_bf16 = r.dtype == DType::bf16;
  m.dt = dt;
  const char* v = std::getenv("MXQ_CUDA_MATRIX_CUDA_CORES");  // read at each call: the tests switch it
  m.cuda_cores = v && std::string(v) == "1";
  m.bf16 = !inverse && o.matrix_precision == MatrixPrecision::bf16;
  return m;
}

// Warps per block of the bf16 product's kernels for RS on the current device: at RS = 128, 8 where two
// such blocks fit an SM's shared memory (16 resident warps, as many as 128 registers allow; the H100 /
// H200), else 4 (three blocks of 4 on the H100, shared memory the limit; sm_80 / 86 / 89). Below RS 128
// the 4-warp blocks are small enough for 16 resident warps already: 4. NVFP4 (and its amax pass): 4,
// since its 8-warp kernels spill under the 128-register cap and measured slower (H100, 2026-12-06:
// QDQ given S 41.4% -> 38.0% of copy at 8192^2, while MXFP4 went 42.8% -> 46.6%).
// MXQ_CUDA_MATRIX_BF16_WARPS=4 or 8 forces one (a test and benchmark switch; 8 where it does not fit
// fails its launch).
inline int matrix_bf16_warps(const char* fn, int rs, bool nvfp4) {
  const char* v = std::getenv("MXQ_CUDA_MATRIX_BF16_WARPS");
  if (v && (std::string(v) == "4" || std::string(v) == "8")) return v[0] - '0';
  if (rs < 128 || nvfp4) return 4;
  // The fit depends only on the device: asked once per device (0: not asked yet), as
  // launch_matrix_kernel caches its occupancy; the variable above is read on every call.
  static std::atomic<int> fit[64] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  int w = fit[dev & 63].load(std::memory_order_relaxed);
  if (w == 0) {
    int per_sm = 0, per_block = 0;
    check(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), fn, "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), fn, "cudaDeviceGetAttribute");
    // + 4 KB a block: NVFP4's static tables (3 KB) and the 1 KB the runtime reserves per block
    const int need = matrix_bf16_smem_bytes(128, 8) + 4096;
    w = need <= per_block && 2 * need <= per_sm ? 8 : 4;
    fit[dev & 63].store(w, std::memory_order_relaxed);
  }
  return w;
}

// Kernel<<<grid, threads, smem, s>>>(k, m): a warp per tile of rotation groups, at most the resident
// warps (the kernel strides over the rest). The shared memory above 48 KB is opted into once per kernel
// and device, for the largest RS (an attribute set for a smaller one would refuse a larger RS launched
// after it). BW: 0, the exact product's kernels (kMatrixThreads); 4 or 8, a kernel of the bf16 product
// with blocks of BW warps (matrix_bf16.cuh; RS <= 128).
template <auto Kernel, int BW = 0>
void launch_matrix_kernel(const char* fn, const Params& k, const MatrixArgs& m, cudaStream_t s, const char* what) {
  static_assert(BW == 0 || kBf16Warps<BW>, "the bf16 product's blocks are of 4 or 8 warps");
  constexpr int threads = BW ? 32 * BW : kMatrixThreads;
  const int rs = k.rot_size;
  const int smem = BW ? matrix_bf16_smem_bytes(rs, BW) : matrix_smem_bytes(rs);
  const int smem_max = BW ? matrix_bf16_smem_bytes(128, BW) : matrix_smem_bytes(256);
  static std::atomic<int> per_sm[64][5] = {};  // per device and RS: resident blocks + 1 (0: not asked)
  static std::atomic<bool> opted[64] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  if (!opted[dev & 63].load(std::memory_order_acquire)) {
    check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max), fn,
          std::string("allowing ") + std::to_string(smem_max) + " bytes of shared memory for the " + what);
    opted[dev & 63].store(true, std::memory_order_release);
  }
  int ri = 0;
  while ((16 << ri) < rs) ++ri;
  int n = per_sm[dev & 63][ri].load(std::memory_order_relaxed);
  if (n == 0) {
    int b = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, threads, smem), fn, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    n = std::max(b, 1) + 1;
    per_sm[dev & 63][ri].store(n, std::memory_order_relaxed);
  }
  const i64 per_tile = i64(BW ? kBf16TileGroups : matrix_tile_groups(rs)) * rs / kMatrixChunk;
  const i64 tiles = (k.total + per_tile - 1) / per_tile;
  const i64 blocks = std::min<i64>((tiles + threads / 32 - 1) / (threads / 32), i64(n - 1) * sm_count(fn));
  Kernel<<<unsigned(std::max<i64>(blocks, 1)), threads, smem, s>>>(k, m);
  check_launch(fn, what);
}

}  // namespace mxq::cuda
