// The rotated quantize kernels (block_kernel<QDQ = false, ROT = true>): one translation unit of their own.
#include "cuda/rotate/rotate_dispatch.cuh"

namespace mxq::cuda {
template void launch_rotated<false>(const char*, const core::Problem&, DType, const Plan&, Params&, cudaStream_t);
}  // namespace mxq::cuda
