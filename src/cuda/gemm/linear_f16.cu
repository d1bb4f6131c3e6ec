// The fp16-activation kernels of the W4A16 linear (linear_launch.cuh).
#include "cuda/gemm/linear_launch.cuh"

namespace mxq::cuda::gemm {
void launch_linear_f16(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream) {
  launch_linear<true>(args, nv, p, stream);
}
}  // namespace mxq::cuda::gemm
