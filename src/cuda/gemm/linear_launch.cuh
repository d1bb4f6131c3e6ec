#pragma once
// Host side of the W4A16 linear: one launch per call, the tile from core::plan_linear. The kernels of
// one activation dtype live in one translation unit (linear_bf16.cu, linear_f16.cu) so that the two
// compile in parallel.
#include <cuda_runtime.h>

#include <iterator>
#include <utility>

#include "core/linear_plan.hpp"
#include "core/validate.hpp"
#include "cuda/common/device.hpp"
#include "cuda/gemm/w4a16.cuh"

namespace mxq::cuda::gemm {

template <int TOKENS, int DEPTH, int WN, int CLUSTER, bool XS, bool NV, bool F16>
void launch_one(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream) {
  auto kernel = w4a16_kernel<TOKENS, DEPTH, WN, CLUSTER, NV, F16, XS>;
  constexpr int smem = linear_smem_bytes<TOKENS, WN, XS>();
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(attr, "linear", "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_n), static_cast<unsigned>(p.grid_m), 1);
  cfg.blockDim = dim3(kWarps * 32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (p.sm >= 90) {  // programmatic dependent launch: the weight stream starts under the previous kernel's tail
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

// One instance per row of core::kLinearKernels, chosen by the plan.
template <bool NV, bool F16, std::size_t... I>
void launch_row(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream, std::index_sequence<I...>) {
  constexpr auto& rows = core::kLinearKernels;
  const bool launched =
      ((rows[I].matches(p) && (launch_one<rows[I].tokens, rows[I].depth, rows[I].groups, rows[I].cluster, rows[I].xstage, NV, F16>(args, p, stream), true)) || ...);
  if (!launched) core::fail(Error::Code::internal, "linear", "no kernel for the plan: " + core::to_string(p));
}

template <bool F16>
void launch_linear(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream) {
  constexpr auto rows = std::make_index_sequence<std::size(core::kLinearKernels)>();
  if (nv)
    launch_row<true, F16>(args, p, stream, rows);
  else
    launch_row<false, F16>(args, p, stream, rows);
}

// Defined in linear_wgmma.cu: whether the library holds the sm90a prefill kernels, and their launch.
bool wgmma_built();
void launch_linear_wgmma(const LinearArgs& args, bool nv, bool f16, const core::LinearPlan& p, cudaStream_t stream);

// Defined in linear_bf16.cu / linear_f16.cu.
void launch_linear_bf16(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream);
void launch_linear_f16(const LinearArgs& args, bool nv, const core::LinearPlan& p, cudaStream_t stream);

}  // namespace mxq::cuda::gemm
