// Host side of the W4A16 linear's sm90a prefill kernel (w4a16_wgmma.cuh): the tensor map of x (encoded
// per call: x's address is the call's), then one launch per call. The kernel bodies exist only where the
// library was built for sm_90a (MXQ_HAVE_SM90A); core::plan_linear chooses them only then.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <iterator>
#include <utility>

#include "core/linear_plan.hpp"
#include "core/validate.hpp"
#include "cuda/common/device.hpp"
#include "cuda/gemm/linear_launch.cuh"
#include "cuda/gemm/w4a16_wgmma.cuh"

namespace mxq::cuda::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// x [M, K] (row stride x_stride elements, 16-byte aligned) in boxes of BM rows x 64 columns, zeros
// outside.
CUtensorMap x_map(const LinearArgs& a, bool f16, int bm) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (!encode) core::fail(Error::Code::unsupported, "linear", "the CUDA driver has no cuTensorMapEncodeTiled (driver too old for sm90a kernels)");
  CUtensorMap m{};
  const cuuint64_t dims[2] = {cuuint64_t(a.K), cuuint64_t(a.M)};
  const cuuint64_t strides[1] = {cuuint64_t(a.x_stride) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(bm)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(&m, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                            const_cast<std::uint16_t*>(a.x), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    core::fail(Error::Code::internal, "linear", "cuTensorMapEncodeTiled failed for x (error " + std::to_string(int(r)) + ")");
  return m;
}

template <int BM, int STRIPS, int STAGES, int PF, bool EPI, int KSPLIT, int RAW, int WAIT, bool WSMEM, bool NV, bool F16>
void launch_wgmma_one(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream) {
  auto kernel = w4a16_wgmma_kernel<BM, STRIPS, STAGES, PF, NV, F16, EPI, KSPLIT, RAW, WAIT, WSMEM>;
  constexpr int smem = wg::smem_bytes<BM, STRIPS, KSPLIT>(STAGES, RAW, WSMEM ? PF : 0);
  static_assert(smem <= 227 * 1024, "the kernel's shared memory fits an sm90 CTA");
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(attr, "linear", "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  const CUtensorMap map = x_map(args, F16, BM);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.grid_n), static_cast<unsigned>(p.grid_m), 1);
  cfg.blockDim = dim3(wg::kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;  // split K: grid.x = tiles along N x KSPLIT
  attrs[1].val.clusterDim.x = KSPLIT;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = KSPLIT > 1 ? 2 : 1;
  check(cudaLaunchKernelEx(&cfg, kernel, map, args), "linear", "launching w4a16_wgmma_kernel");
}

template <bool NV, bool F16, std::size_t... I>
void launch_wgmma_row(const LinearArgs& args, const core::LinearPlan& p, cudaStream_t stream, std::index_sequence<I...>) {
  constexpr auto& rows = core::kWgmmaKernels;
  const bool launched =
      ((rows[I].matches(p) && (launch_wgmma_one<rows[I].bm, rows[I].strips, rows[I].stages, rows[I].prefetch, rows[I].smem_epilogue,
                                                 rows[I].ksplit, rows[I].raw, rows[I].wait, rows[I].wsmem, NV, F16>(args, p, stream),
                               true)) ||
       ...);
  if (!launched) core::fail(Error::Code::internal, "linear", "no kernel for the plan: " + core::to_string(p));
}

}  // namespace

bool wgmma_built() {
#ifdef MXQ_HAVE_SM90A
  return true;
#else
  return false;
#endif
}

void launch_linear_wgmma(const LinearArgs& args, bool nv, bool f16, const core::LinearPlan& p, cudaStream_t stream) {
  constexpr auto rows = std::make_index_sequence<std::size(core::kWgmmaKernels)>();
  if (nv)
    f16 ? launch_wgmma_row<true, true>(args, p, stream, rows) : launch_wgmma_row<true, false>(args, p, stream, rows);
  else
    f16 ? launch_wgmma_row<false, true>(args, p, stream, rows) : launch_wgmma_row<false, false>(args, p, stream, rows);
}

}  // namespace mxq::cuda::gemm
