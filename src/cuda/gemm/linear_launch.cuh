#pragma once
// Host side of the W4A16 linear: one launch per call, the tile from core::plan_linear. The kernels of
// one activation dtype live in one translation unit (linear_bf16.cu, linear_f16.cu) so that the two
// compile in parallel.
#include <cuda_runtime.h>

#include "core/linear_plan.hpp"
#include "core/validate.hpp"
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

template <int TOKENS, int DEPTH, int WN, int CLUSTER, bool NV, bool F16>
void launch_one(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream) {
  auto kernel = w4a16_kernel<TOKENS, DEPTH, WN, CLUSTER, NV, F16>;
  constexpr int smem = reduce_floats<TOKENS>() * 4;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(attr, "linear", "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_n), static_cast<unsigned>(p.grid_m), 1);
  cfg.blockDim = dim3(kWarps * 32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (pdl_supported()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (CLUSTER > 1) {  // sm90 only (core::plan_linear)
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = CLUSTER;
    attrs[n].val.clusterDim.y = 1;
    attrs[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  check(cudaLaunchKernelEx(&cfg, kernel, args), "linear", "launching w4a16_kernel");
}

template <bool F16>
void launch_linear(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream) {
  auto go = [&]<bool NV>() {
    // core::kLinearKernels: tokens, depth, row groups, cluster.
    switch (p.tokens * 1000 + p.depth * 100 + p.groups * 10 + p.cluster) {
      case 8811: return launch_one<8, 8, 1, 1, NV, F16>(args, p, stream);
      case 8411: return launch_one<8, 4, 1, 1, NV, F16>(args, p, stream);
      case 8421: return launch_one<8, 4, 2, 1, NV, F16>(args, p, stream);
      case 8412: return launch_one<8, 4, 1, 2, NV, F16>(args, p, stream);
      case 16811: return launch_one<16, 8, 1, 1, NV, F16>(args, p, stream);
      case 16411: return launch_one<16, 4, 1, 1, NV, F16>(args, p, stream);
      case 16421: return launch_one<16, 4, 2, 1, NV, F16>(args, p, stream);
      case 32411: return launch_one<32, 4, 1, 1, NV, F16>(args, p, stream);
      case 64411: return launch_one<64, 4, 1, 1, NV, F16>(args, p, stream);
      default:
        core::fail(Error::Code::internal, "linear", "no kernel for the plan: " + core::to_string(p));
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
