#pragma once
// Host side of the W4A16 linear: one launch per call, the tile from core::plan_linear. The kernels of
// one activation dtype live in one translation unit (linear_bf16.cu, linear_f16.cu) so that the two
// compile in parallel.
#include <cuda_runtime.h>

#include "core/linear_plan.hpp"
#include "cuda/common/device.hpp"
#include "cuda/gemm/w4a16.cuh"

namespace mxq::cuda::gemm {

// Programmatic dependent launch where the device has it (sm90+): the kernel may start under the
// previous kernel's tail and streams weights before it waits for x.
inline bool pdl_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  return ok;
}

template <int TOKENS, int DEPTH, bool NV, bool F16>
void launch_one(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream) {
  auto kernel = w4a16_kernel<TOKENS, DEPTH, NV, F16>;
  constexpr int smem = reduce_floats<TOKENS>() * 4;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(attr, "linear", "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_n), static_cast<unsigned>(p.grid_m), 1);
  cfg.blockDim = dim3(kWarps * 32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = pdl_supported() ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, args), "linear", "launching w4a16_kernel");
}

template <bool F16>
void launch_linear(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream) {
  auto go = [&]<bool NV>() {
    switch (p.tokens * 10 + p.depth) {
      case 84: return launch_one<8, 4, NV, F16>(args, p, stream);
      case 88: return launch_one<8, 8, NV, F16>(args, p, stream);
      case 164: return launch_one<16, 4, NV, F16>(args, p, stream);
      case 168: return launch_one<16, 8, NV, F16>(args, p, stream);
      case 324: return launch_one<32, 4, NV, F16>(args, p, stream);
      default: return launch_one<64, 4, NV, F16>(args, p, stream);
    }
  };
  if (nv)
    go.template operator()<true>();
  else
    go.template operator()<false>();
}

// Defined in linear_bf16.cu / linear_f16.cu.
void launch_linear_bf16(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream);
void launch_linear_f16(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream);

}  // namespace mxq::cuda::gemm
