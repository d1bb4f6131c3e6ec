// The tensor amax (NVFP4's computed tensor scale) and the tensor-scale output.
#include "cuda/backend.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/params.cuh"
#include "cuda/common/reductions.cuh"
#include "cuda/layout/amax.hpp"

namespace mxq::cuda {
namespace {

// max |x| as fp32 bits over the view, ORed into *acc with atomicMax (acc zeroed first). NaN bits
// compare above +Inf, so a NaN anywhere gives NaN.
template <DType DT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const Params p, u32* acc) {
  constexpr int C = 8, U = 4;  // U chunks loaded before any is reduced: loads in flight
  u32 m = 0;
  const i64 stride = i64(gridDim.x) * kThreads;
  for (i64 i = i64(blockIdx.x) * kThreads + threadIdx.x; i < p.total; i += U * stride) {
    u32 xb[U][C];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = i + u * stride;
      const i64 row = j / p.cpr, k0 = (j - row * p.cpr) * C;
      if (j < p.total) {
        load_chunk<DT, C>(p, row, k0, k0 + C <= p.K, xb[u]);
      } else {
#pragma unroll
        for (int e = 0; e < C; ++e) xb[u][e] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < C; ++e) m = umax(m, xb[u][e] & 0x7FFFFFFFu);
  }
  block_max_into(m, acc);
}

__global__ void encode_scale_kernel(float* ts, const u32* acc) { *ts = nvfp4_encode_scale(u2f(*acc)); }
__global__ void fill_kernel(float* ts, float v) { *ts = v; }

}  // namespace

void enqueue_amax(const char* fn, const Tensor& x, u32* acc, cudaStream_t s) {
  check(cudaMemsetAsync(acc, 0, sizeof(u32), s), fn, "zeroing the amax accumulator");
  if (x.rows == 0 || x.cols == 0) return;
  Params k;
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  k.K = x.cols;
  k.rows = x.rows;
  k.cpr = (x.cols + 7) / 8;
  k.total = k.rows * k.cpr;
  k.blocks = unsigned(std::min<i64>(launch_blocks(fn, k.total), i64(sm_count(fn)) * 8));
  dispatch_dtype(x.dtype, [&](auto dt) {
    constexpr DType DT = decltype(dt)::value;
    k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, 8>());
    amax_kernel<DT><<<k.blocks, kThreads, 0, s>>>(k, acc);
  });
  check_launch(fn, "amax_kernel");
}

void enqueue_tensor_scale(const char* fn, float* ts, const u32* acc, float S, cudaStream_t s) {
  if (acc) encode_scale_kernel<<<1, 1, 0, s>>>(ts, acc);
  else fill_kernel<<<1, 1, 0, s>>>(ts, S);
  check_launch(fn, "tensor scale");
}

float tensor_amax(const Tensor& x, void* stream) {
  const char* fn = "tensor_amax";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  void* buf = nullptr;
  check(cudaMallocAsync(&buf, sizeof(u32), s), fn, "cudaMallocAsync");
  u32 bits = 0;
  cudaError_t e = cudaSuccess;
  try {
    enqueue_amax(fn, x, static_cast<u32*>(buf), s);
    e = cudaMemcpyAsync(&bits, buf, sizeof(u32), cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  } catch (...) {
    cudaFreeAsync(buf, s);
    throw;
  }
  cudaFreeAsync(buf, s);
  check(e, fn, "reading the amax back");
  return u2f(bits);
}

}  // namespace mxq::cuda
