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

// Kernel<<<grid, kMatrixThreads, smem, s>>>(k, m): a warp per tile of rotation groups, at most the
// resident warps (the kernel strides over the rest). The shared memory above 48 KB is opted into once
// per kernel and device, for the largest RS (an attribute set for a smaller one would refuse a larger
// RS launched after it). BF16: a kernel of the bf16 product (matrix_bf16.cuh; RS <= 128).
template <auto Kernel, bool BF16 = false>
void launch_matrix_kernel(const char* fn, const Params& k, const MatrixArgs& m, cudaStream_t s, const char* what) {
  const int rs = k.rot_size;
  const int smem = BF16 ? matrix_bf16_smem_bytes(rs) : matrix_smem_bytes(rs);
  const int smem_max = BF16 ? matrix_bf16_smem_bytes(128) : matrix_smem_bytes(256);
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
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kMatrixThreads, smem), fn, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    n = std::max(b, 1) + 1;
    per_sm[dev & 63][ri].store(n, std::memory_order_relaxed);
  }
  const i64 per_tile = i64(BF16 ? kBf16TileGroups : matrix_tile_groups(rs)) * rs / kMatrixChunk;
  const i64 tiles = (k.total + per_tile - 1) / per_tile;
  const i64 blocks = std::min<i64>((tiles + kMatrixThreads / 32 - 1) / (kMatrixThreads / 32), i64(n - 1) * sm_count(fn));
  Kernel<<<unsigned(std::max<i64>(blocks, 1)), kMatrixThreads, smem, s>>>(k, m);
  check_launch(fn, what);
}

}  // namespace mxq::cuda
