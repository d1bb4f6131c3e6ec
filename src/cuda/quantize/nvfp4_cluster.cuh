#pragma once
// NVFP4 with a computed tensor scale, for tensors that fit one thread-block cluster (sm_90+): one
// kernel and one read of x. Each block holds its chunks in registers and reduces their max |x|; the
// blocks exchange their maxima through distributed shared memory; every block then derives S and
// quantizes (or QDQs) the chunks it holds. For decode-size activations this replaces the memset and
// the cooperative fused-amax launch, whose grid barrier and second pass cost more than the work.
#include <cooperative_groups.h>

#include "cuda/common/vector_io.cuh"
#include "cuda/quantize/nvfp4_chunk.cuh"

namespace mxq::cuda {

struct ClusterConfig {
  static constexpr int kMaxBlocks = 16;  // the largest (non-portable) cluster of sm_90
  static constexpr int kIters = 4;       // chunks a thread holds in registers
  static constexpr i64 kMaxChunks = i64(kMaxBlocks) * kThreads * kIters;
  static_assert(kMaxBlocks <= 32, "one warp reads every block's maximum");
  static_assert(kIters * 32 <= 128, "a thread's chunks fit in registers (at most 32 words each x 4)");
};

// Launched as one cluster of gridDim.x blocks over a flat, vector-aligned problem (block_kernel's
// chunk coordinates); p.amax, when set, receives the tensor amax bits (quantize's tensor-scale output).
template <DType DT, int C, bool QDQ, class Ch>
__global__ void __launch_bounds__(kThreads, 1) nvfp4_cluster_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int W = vec_words<DT, C>();
  constexpr int kIt = ClusterConfig::kIters;
  __shared__ NvTables nvt;
  __shared__ u32 block_amax, cluster_amax;
  const i64 stride = i64(gridDim.x) * kThreads;
  const i64 block_first = i64(blockIdx.x) * kThreads;
  const i64 iters = (p.total - block_first + stride - 1) / stride;  // uniform over the block, <= kIt
  const i64 first = block_first + threadIdx.x;

  // Load: every chunk of this thread, past the end zeros (they never raise the amax).
  u32 xw[kIt][W];
  u32 m = 0;
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    const i64 i = first + it * stride;
    if (i < p.total) {
      load_words<W>(p.x + u64(i) * u64(vec_bytes<DT, C>()), xw[it]);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) xw[it][j] = 0;
    }
    u32 xb[C];
    m = umax(m, chunk_amax<DT, C>(xw[it], xb, [&] { unpack_words<DT, C, W>(xw[it], xb); }));
  }

  // The block's max, then the cluster's: warp 0 reads each block's through distributed shared memory.
  m = block_max(m);
  if (threadIdx.x == 0) block_amax = m;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's maximum is written
  if (threadIdx.x < 32) {
    u32 a = 0;
    if (threadIdx.x < cluster.num_blocks()) a = *cluster.map_shared_rank(&block_amax, threadIdx.x);
    a = warp_max(a);
    if (threadIdx.x == 0) cluster_amax = a;
  }
  cluster.sync();  // no block leaves (or reuses its shared memory) while another still reads it
  const u32 amax = cluster_amax;
  if (p.amax && blockIdx.x == 0 && threadIdx.x == 0) *p.amax = amax;

  const NvScale nv = nv_scale_of(amax);
  fill_nv_tables<DT, QDQ>(nv, nvt);  // ends with a barrier
#pragma unroll
  for (int it = 0; it < kIt; ++it) {
    if (it < iters) {  // uniform: whole warps run the chunk (group shuffles)
      const Coord c = coord<C, true>(p, first + it * stride);
      nvfp4_chunk<DT, C, QDQ, Ch>(p, c, nv, nvt, xw[it]);
    }
  }
#endif
}

}  // namespace mxq::cuda
