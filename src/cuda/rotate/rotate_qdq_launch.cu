// The rotated QDQ kernels (block_kernel<QDQ = true, ROT = true>): one translation unit of their own.
#include "cuda/rotate/rotate_dispatch.cuh"

namespace mxq::cuda {
template void launch_rotated<true>(const char*, const core::Problem&, DType, const Plan&, Params&, cudaStream_t);
}  // namespace mxq::cuda
