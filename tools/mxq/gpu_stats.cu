// Error statistics on the GPU: a grid-stride pass over x and y with per-thread double sums, a block
// reduction in shared memory, per-block partials summed on the host in order.
#include "gpu_stats.hpp"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_util.hpp"

namespace mxq::cli::gpu {
namespace {

constexpr int kThreads = 256, kBlocks = kErrorPartials / 4;

template <DType T>
__device__ __forceinline__ float load(const void* p, long long i) {
  if constexpr (T == DType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == DType::bf16) {
    return __uint_as_float(unsigned(static_cast<const unsigned short*>(p)[i]) << 16);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);  // exact
  }
}

template <DType XT, DType YT>
__global__ void __launch_bounds__(kThreads) error_totals_kernel(const void* x, const void* y, long long n, double* partials) {
  double s[4] = {0, 0, 0, 0};  // e, r, bad_in, bad_out
  for (long long i = blockIdx.x * (long long)kThreads + threadIdx.x; i < n; i += (long long)gridDim.x * kThreads) {
    const float xv = load<XT>(x, i), yv = load<YT>(y, i);
    if (!isfinite(xv)) {
      s[2] += 1.0;
    } else if (!isfinite(yv)) {
      s[3] += 1.0;
    } else {
      const double d = __dsub_rn(double(yv), double(xv));
      s[0] = __dadd_rn(s[0], __dmul_rn(d, d));
      s[1] = __dadd_rn(s[1], __dmul_rn(double(xv), double(xv)));
    }
  }
  __shared__ double sh[4][kThreads];
  const int t = threadIdx.x;
  for (int k = 0; k < 4; ++k) sh[k][t] = s[k];
  __syncthreads();
  for (int st = kThreads / 2; st > 0; st >>= 1) {
    if (t < st)
      for (int k = 0; k < 4; ++k) sh[k][t] = __dadd_rn(sh[k][t], sh[k][t + st]);
    __syncthreads();
  }
  if (t == 0)
    for (int k = 0; k < 4; ++k) partials[blockIdx.x * 4 + k] = sh[k][0];
}

template <DType XT>
void launch(const void* x, const void* y, DType yt, long long n, double* partials, cudaStream_t s) {
  if (yt == DType::f32) error_totals_kernel<XT, DType::f32><<<kBlocks, kThreads, 0, s>>>(x, y, n, partials);
  else if (yt == DType::bf16) error_totals_kernel<XT, DType::bf16><<<kBlocks, kThreads, 0, s>>>(x, y, n, partials);
  else error_totals_kernel<XT, DType::f16><<<kBlocks, kThreads, 0, s>>>(x, y, n, partials);
}

}  // namespace

void error_totals_async(const void* x, DType xt, const void* y, DType yt, std::int64_t n, double* partials,
                        double* host_partials, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (n > 0) {
    if (xt == DType::f32) launch<DType::f32>(x, y, yt, n, partials, s);
    else if (xt == DType::bf16) launch<DType::bf16>(x, y, yt, n, partials, s);
    else launch<DType::f16>(x, y, yt, n, partials, s);
    cuda_util::check(cudaGetLastError(), "the error statistics kernel");
  } else {
    cuda_util::check(cudaMemsetAsync(partials, 0, sizeof(double) * kErrorPartials, s), "cudaMemsetAsync");
  }
  cuda_util::check(cudaMemcpyAsync(host_partials, partials, sizeof(double) * kErrorPartials, cudaMemcpyDeviceToHost, s),
                   "copy of the error statistics from the GPU");
}

ErrorTotals sum_partials(const double* h) {
  ErrorTotals t;
  for (int b = 0; b < kBlocks; ++b) {
    t.e += h[4 * b];
    t.r += h[4 * b + 1];
    t.bad_in += std::int64_t(h[4 * b + 2]);
    t.bad_out += std::int64_t(h[4 * b + 3]);
  }
  return t;
}

}  // namespace mxq::cli::gpu
