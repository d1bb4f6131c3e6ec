// nvfp4_e5m3 quantize, QDQ and dequantize on the CUDA backend: one thread per block of 16 or 32 elements,
// a grid striding over the blocks, the arithmetic core/problem.hpp's nvfp4_e5m3 helpers (the same as
// every other backend's). Three kernels per input dtype, nine in all, in this translation unit only (the
// chunk pipeline of block_kernel is not instantiated for the format: its launcher TUs stay as they were).
// NOTE: plain loads and stores, no staging ring: correct at every shape and stride, not tuned for speed.
#include <algorithm>

#include "core/dispatch.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/vector_io.cuh"
#include "cuda/layout/amax.hpp"
#include "cuda/quantize/e5m3.hpp"

namespace mxq::cuda {
namespace {

struct E5m3Args {
  const std::uint8_t* x = nullptr;  // (rows, K) of the input dtype, rows x_stride elements apart
  i64 x_stride = 0;
  std::uint8_t* y = nullptr;        // QDQ / dequantize output (rows, K), rows y_stride elements apart
  i64 y_stride = 0;
  std::uint8_t* codes = nullptr;    // (rows, ceil(K/2)) e2m1x2, rows codes_stride bytes apart
  i64 codes_stride = 0;
  std::uint8_t* scales = nullptr;   // (rows, nblocks) UE5M3 linear, or the swizzled 128x4 layout
  i64 scales_stride = 0;
  std::uint8_t* mask = nullptr;     // optional (rows, ceil(K/8)) clip-mask bits, LSB first
  i64 mask_stride = 0;
  i64 rows = 0, K = 0, nblocks = 0, cols_padded = 0;  // cols_padded: the swizzled layout's column count
  int g = 16;
  bool swizzled = false;
};

__device__ __forceinline__ i64 scale_index(const E5m3Args& a, i64 r, i64 b) {
  return a.swizzled ? swizzled_offset(r, b, a.cols_padded) : r * a.scales_stride + b;
}

// Element k of row r as fp32 bits (0 past K: the block's zero padding).
template <DType DT>
__device__ __forceinline__ u32 load_elem(const E5m3Args& a, i64 r, i64 k) {
  if (k >= a.K) return 0u;
  return to_f32_bits<DT>(reinterpret_cast<const Storage<DT>*>(a.x)[r * a.x_stride + k]);
}
template <DType DT>
__device__ __forceinline__ void store_elem(const E5m3Args& a, i64 r, i64 k, u32 bits) {
  reinterpret_cast<Storage<DT>*>(a.y)[r * a.y_stride + k] = static_cast<Storage<DT>>(bits);
}

// Block (r, b): quantize writes its codes, scale byte and clip-mask bytes, QDQ its outputs.
template <DType DT, bool QDQ>
__global__ void __launch_bounds__(LaunchConfig::kThreads) e5m3_block_kernel(const E5m3Args a) {
  const i64 total = a.rows * a.nblocks;
  for (i64 t = i64(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += i64(gridDim.x) * blockDim.x) {
    const i64 r = t / a.nblocks, b = t % a.nblocks, k0 = b * a.g;
    u32 xb[32];  // the block as fp32 bits (g is 16 or 32)
    u32 amax = 0;  // max |x| bits: a NaN element wins the integer maximum (torch's amax propagates NaN)
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (i < a.g) {
        xb[i] = load_elem<DT>(a, r, k0 + i);
        amax = max(amax, xb[i] & 0x7FFFFFFFu);
      }
    }
    const u32 sc = nvfp4_e5m3_scale_code(amax);
    const i64 n = min(i64(a.g), a.K - k0);
    if constexpr (QDQ) {
      for (int i = 0; i < n; ++i) store_elem<DT>(a, r, k0 + i, nvfp4_e5m3_qdq_bits(xb[i], sc, DT));
    } else {
      std::uint8_t* row = a.codes + r * a.codes_stride + k0 / 2;
      for (int i = 0; 2 * i < n; ++i)  // the padding past K is code 0: an odd K's last high nibble is 0
        row[i] = static_cast<std::uint8_t>(nvfp4_e5m3_code(xb[2 * i], sc) | (nvfp4_e5m3_code(xb[2 * i + 1], sc) << 4));
      a.scales[scale_index(a, r, b)] = static_cast<std::uint8_t>(sc);
      if (a.mask) {  // whole bytes (k0 is a multiple of 8), the bits past K 0
        std::uint8_t* m = a.mask + r * a.mask_stride + k0 / 8;
        for (int j = 0; 8 * j < n; ++j) {
          u32 bits = 0;
          for (int i = 0; i < 8; ++i) bits |= u32(8 * j + i < n && nvfp4_e5m3_kept(xb[8 * j + i], sc)) << i;
          m[j] = static_cast<std::uint8_t>(bits);
        }
      }
    }
  }
}

template <DType DT>
__global__ void __launch_bounds__(LaunchConfig::kThreads) e5m3_dequant_kernel(const E5m3Args a) {
  const i64 total = a.rows * a.nblocks;
  for (i64 t = i64(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += i64(gridDim.x) * blockDim.x) {
    const i64 r = t / a.nblocks, b = t % a.nblocks, k0 = b * a.g;
    const u32 sc = a.scales[scale_index(a, r, b)];
    const std::uint8_t* row = a.codes + r * a.codes_stride;
    const i64 n = min(i64(a.g), a.K - k0);
    for (int i = 0; i < n; ++i) {
      const u32 code = (row[(k0 + i) / 2] >> (4 * ((k0 + i) % 2))) & 0xFu;
      store_elem<DT>(a, r, k0 + i, nvfp4_e5m3_out_bits(code, sc, DT));
    }
  }
}

E5m3Args base_args(const core::Problem& p) {
  E5m3Args a;
  a.rows = p.rows, a.K = p.K, a.nblocks = p.nblocks, a.g = p.g;
  a.swizzled = p.opt.scale_layout == ScaleLayout::swizzled;
  a.cols_padded = p.scale_cols_padded;
  return a;
}

// Kernel<<<grid, kThreads, 0, s>>>(a) over every block of the problem: at most 16 thread blocks per SM,
// the grid striding over the rest.
template <auto Kernel>
void launch(const core::Problem& p, const E5m3Args& a, const char* what) {
  const i64 threads = a.rows * a.nblocks;
  const i64 blocks = std::min<i64>(launch_blocks(p.fn, threads), i64(sm_count(p.fn)) * 16);
  Kernel<<<unsigned(blocks), LaunchConfig::kThreads, 0, static_cast<cudaStream_t>(p.opt.stream)>>>(a);
  check_launch(p.fn, what);
}

}  // namespace

void quantize_e5m3(const core::Problem& p, const Tensor& x, const QuantizedOut& out) {
  const cudaStream_t s = static_cast<cudaStream_t>(p.opt.stream);
  E5m3Args a = base_args(p);
  a.x = static_cast<const std::uint8_t*>(x.data), a.x_stride = x.stride();
  a.codes = static_cast<std::uint8_t*>(out.codes.data), a.codes_stride = out.codes.stride();
  a.scales = static_cast<std::uint8_t*>(out.scales.data), a.scales_stride = out.scales.stride();
  a.mask = static_cast<std::uint8_t*>(out.clip_mask.data), a.mask_stride = out.clip_mask.stride();
  if (a.swizzled) check(cudaMemsetAsync(a.scales, 0, p.scale_rows_padded * p.scale_cols_padded, s), p.fn, "zeroing swizzle padding");
  dispatch_dtype(x.dtype, [&](auto dt) {
    launch<e5m3_block_kernel<decltype(dt)::value, false>>(p, a, "nvfp4_e5m3 quantize kernel");
  });
  if (out.tensor_scale) enqueue_tensor_scale(p.fn, out.tensor_scale, nullptr, p.S, s);  // 1: no tensor scale
}

void qdq_e5m3(const core::Problem& p, const Tensor& x, const Tensor& y) {
  E5m3Args a = base_args(p);
  a.x = static_cast<const std::uint8_t*>(x.data), a.x_stride = x.stride();
  a.y = static_cast<std::uint8_t*>(y.data), a.y_stride = y.stride();
  // NOTE: in place (y == x) is safe: each thread reads its whole block before writing it.
  dispatch_dtype(x.dtype, [&](auto dt) {
    launch<e5m3_block_kernel<decltype(dt)::value, true>>(p, a, "nvfp4_e5m3 qdq kernel");
  });
}

void dequantize_e5m3(const core::Problem& p, const QuantizedIn& q, const Tensor& y) {
  E5m3Args a = base_args(p);
  a.codes = static_cast<std::uint8_t*>(q.codes.data), a.codes_stride = q.codes.stride();
  a.scales = static_cast<std::uint8_t*>(q.scales.data), a.scales_stride = q.scales.stride();
  a.y = static_cast<std::uint8_t*>(y.data), a.y_stride = y.stride();
  dispatch_dtype(y.dtype, [&](auto dt) {
    launch<e5m3_dequant_kernel<decltype(dt)::value>>(p, a, "nvfp4_e5m3 dequantize kernel");
  });
}

}  // namespace mxq::cuda
