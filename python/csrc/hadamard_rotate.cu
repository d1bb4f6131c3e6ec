// The CUDA kernel of torch.ops.mxq.hadamard_rotate_f64 (python/csrc/ops.cpp declares the op, checks
// its arguments and holds the CPU loop): each group of RS consecutive elements (RS = 16..256, a power
// of two) becomes y_j = RN32(RN64(c * S_j) + 0), S_j = sum_i (-1)^popcount(i & j) x_i computed as the
// float64 fast Walsh-Hadamard butterfly, stages h = 1, 2, .., RS/2 in that order, each pair
// (lo, hi) -> (lo + hi, lo - hi) rounded to double: the same operations, in the same order, as the CPU
// loop, so that both give the same bits on every input (exact or not). docs/numerics.md, "QuTLASS
// shim rotation", says when the result equals the float64 matmul by c * H.
//
// Layout: a group is handled by L = min(RS, 32) lanes (32 / L groups per warp), each lane holding
// E = RS / L doubles in registers; element i of a group lives in lane (i % L), register (i / L), so
// that the loads (bf16, fp16 or fp32) and the fp32 stores of each register are coalesced. The stages
// h < L run across lanes (__shfl_xor_sync of doubles), the stages h >= L within a thread. Grid-stride
// over warp tasks, no allocation, no synchronisation (CUDA-graph safe); IEEE double operations through
// the _rn intrinsics (no contraction, whatever the compiler flags).
//
// NOTE: an interim step: the rotation writes an fp32 intermediate that mxq's quantize kernel reads
// back; a kernel fusing it into the quantization is the next step (issue 39).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mxq_torch {
namespace {

template <class T>
__device__ __forceinline__ double load_as_double(const T* p, int64_t i);

template <>
__device__ __forceinline__ double load_as_double<float>(const float* p, int64_t i) {
  return static_cast<double>(p[i]);
}
template <>
__device__ __forceinline__ double load_as_double<__half>(const __half* p, int64_t i) {
  return static_cast<double>(__half2float(p[i]));  // exact: every fp16 value is an fp32 value
}
template <>
__device__ __forceinline__ double load_as_double<uint16_t>(const uint16_t* p, int64_t i) {  // bf16 bits
  return static_cast<double>(__uint_as_float(static_cast<unsigned>(p[i]) << 16));
}

template <class T, int RS>
__global__ void __launch_bounds__(256) hadamard_rotate_f64_kernel(const T* __restrict__ a, float* __restrict__ y,
                                                                  int64_t groups, double c) {
  constexpr int L = RS < 32 ? RS : 32;  // lanes per group
  constexpr int E = RS / L;             // elements per lane
  constexpr int GPW = 32 / L;           // groups per warp
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int sub = lane / L, li = lane % L;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t tasks = (groups + GPW - 1) / GPW;
  // warp-uniform loop: every lane of a warp runs every shuffle
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < tasks; w += warps) {
    const int64_t g = w * GPW + sub;
    const bool live = g < groups;
    const int64_t base = g * RS + li;
    double x[E];
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = live ? load_as_double(a, base + static_cast<int64_t>(k) * L) : 0.0;
    // stages h = 1 .. L/2: across lanes (pair partner lane ^ h); the lane holding the lower index
    // computes lo + hi, the other lo - hi, with lo and hi the same two doubles on both lanes
#pragma unroll
    for (int h = 1; h < L; h <<= 1) {
      const bool upper = (li & h) != 0;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const double other = __shfl_xor_sync(0xffffffffu, x[k], h);
        x[k] = upper ? __dsub_rn(other, x[k]) : __dadd_rn(x[k], other);
      }
    }
    // stages h = L .. RS/2: within the thread (register index bit h / L)
#pragma unroll
    for (int hk = 1; hk < E; hk <<= 1) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        if (k & hk) continue;
        const double lo = x[k], hi = x[k + hk];
        x[k] = __dadd_rn(lo, hi);
        x[k + hk] = __dsub_rn(lo, hi);
      }
    }
    if (live) {
#pragma unroll
      for (int k = 0; k < E; ++k)  // + 0: a zero result is +0, as the matmul's sums starting from +0
        y[base + static_cast<int64_t>(k) * L] = __double2float_rn(__dadd_rn(__dmul_rn(x[k], c), 0.0));
    }
  }
}

template <class T, int RS>
cudaError_t launch(const void* a, float* y, int64_t groups, double c, cudaStream_t stream) {
  constexpr int threads = 256, GPW = RS < 32 ? 32 / RS : 1;
  const int64_t tasks = (groups + GPW - 1) / GPW;
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  const int64_t want = (tasks + threads / 32 - 1) / (threads / 32);
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * 16;  // grid-stride beyond 16 blocks per SM
  const unsigned blocks = static_cast<unsigned>(want < cap ? want : cap);
  hadamard_rotate_f64_kernel<T, RS><<<blocks, threads, 0, stream>>>(static_cast<const T*>(a), y, groups, c);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_rs(const void* a, float* y, int64_t groups, int rs, double c, cudaStream_t stream) {
  switch (rs) {
    case 16: return launch<T, 16>(a, y, groups, c, stream);
    case 32: return launch<T, 32>(a, y, groups, c, stream);
    case 64: return launch<T, 64>(a, y, groups, c, stream);
    case 128: return launch<T, 128>(a, y, groups, c, stream);
    case 256: return launch<T, 256>(a, y, groups, c, stream);
    default: return cudaErrorInvalidValue;
  }
}
}  // namespace

// a: `groups` * rs contiguous elements of dtype 0 (fp32), 1 (fp16) or 2 (bf16) on the current device;
// y: as many fp32. Enqueued on `stream`; returns the launch's error (cudaSuccess when enqueued).
cudaError_t hadamard_rotate_f64_cuda(const void* a, int dtype, float* y, int64_t groups, int rs, double c,
                                     cudaStream_t stream) {
  if (groups <= 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_rs<float>(a, y, groups, rs, c, stream);
    case 1: return launch_rs<__half>(a, y, groups, rs, c, stream);
    case 2: return launch_rs<uint16_t>(a, y, groups, rs, c, stream);
    default: return cudaErrorInvalidValue;
  }
}
}  // namespace mxq_torch
