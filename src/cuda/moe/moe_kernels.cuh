#pragma once
// The W4A16 MoE's CUDA kernels (docs/moe.md): routing, the grouped GEMM, the activation and the combine.
//
// The grouped GEMM is the dense decode kernel's mainloop (cuda/gemm/w4a16.cuh: weights as the mma's A
// operand, 8 warps splitting K, partial tiles added in shared memory in a fixed order) on work items
// (expert e, tile of TOKENS of e's sorted rows): each CTA finds its item from expert_offsets, gathers its
// rows of x (a token's row for the first GEMM, the sorted row for the second) and writes sorted rows of y.
// Each output is one dot product summed in a fixed order whatever rows share its tile, so the result does
// not depend on the order moe_route puts an expert's pairs in (its atomics make that order vary).
// NOTE: the mainloop is a copy of w4a16_kernel's with WN = 1, CLUSTER = 1 (row addressing and the
// epilogue differ); fold both into one device function once the dense kernel's x-staging variant lands.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "core/fused_math.hpp"
#include "core/moe_math.hpp"
#include "cuda/gemm/w4a16.cuh"

namespace mxq::cuda::moe_kernels {

using gemm::kStrips;
using gemm::kWarps;

constexpr int kRouteThreads = 1024;
constexpr int kMaxExperts = 12288;  // the routing kernel's per-expert counters live in 48 KB of shared memory

// ---- routing ------------------------------------------------------------------------------------------
// One CTA: count the pairs per expert (dropping ids outside [0, E) and raising the flag), scan the counts
// into offsets, then give each pair a position in its expert's range.
template <typename Id>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const Id* ids, std::int64_t ids_stride, int T, int k, int E,
                                                              int* offsets, int* sorted, int* pos, int* flag) {
  extern __shared__ int cursor[];  // E counters, turned into E cursors (the next free position) by the scan
  using Scan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int bad, carry;
  const int tid = threadIdx.x, P = T * k;
  for (int e = tid; e < E; e += kRouteThreads) cursor[e] = 0;
  if (tid == 0) {
    bad = 0;
    carry = 0;
  }
  __syncthreads();
  for (int p = tid; p < P; p += kRouteThreads) {
    const long long e = static_cast<long long>(ids[(p / k) * ids_stride + p % k]);
    if (e < 0 || e >= E) {
      atomicOr(&bad, 1);
      pos[p] = -1;
    } else {
      atomicAdd(&cursor[e], 1);
    }
  }
  __syncthreads();
  for (int base = 0; base < E; base += kRouteThreads) {
    const int e = base + tid;
    const int n = e < E ? cursor[e] : 0;
    int ex, total;
    Scan(scan).ExclusiveSum(n, ex, total);
    const int start = carry + ex;
    __syncthreads();  // every thread has read carry (and the scan storage is free again)
    if (e < E) {
      offsets[e] = start;
      cursor[e] = start;
    }
    if (tid == 0) carry += total;
    __syncthreads();
  }
  if (tid == 0) {
    offsets[E] = carry;
    flag[0] = bad;
  }
  for (int p = tid; p < P; p += kRouteThreads) {
    const long long e = static_cast<long long>(ids[(p / k) * ids_stride + p % k]);
    if (e >= 0 && e < E) {
      const int q = atomicAdd(&cursor[e], 1);
      sorted[q] = p;
      pos[p] = q;
    }
  }
  for (int q = carry + tid; q < P; q += kRouteThreads) sorted[q] = -1;  // the dropped pairs' positions
}

// ---- the grouped GEMM ---------------------------------------------------------------------------------
struct GemmArgs {
  const std::uint8_t* codes;   // [E, codes_stride] u8: expert e's packed tiles (linear_layout)
  const std::uint8_t* scales;  // [E, scales_stride] u8
  std::int64_t codes_stride, scales_stride;
  const int* exp_shift;        // [E]
  const float* tensor_scale;   // [E] (NVFP4 S; 1 for MXFP4)
  const std::uint16_t* x;      // [T or P, K] bf16 / f16, row stride x_stride elements
  std::int64_t x_stride;
  bool token_rows;             // row of sorted position q: sorted[q] / k (true) or q
  int k;
  const int* offsets;          // [E + 1]
  const int* sorted;           // [P]
  int E;
  std::int64_t N, K;
  int katoms;
  const std::uint16_t* bias;   // [E, N] (row stride bias_stride) or nullptr
  std::int64_t bias_stride;
  const void* row_scale;       // [T, k] f32 / bf16 / f16 (row stride rs_stride) or nullptr: the output is fp32
  int rs_dtype;                // 0 f32, 1 bf16, 2 f16
  std::int64_t rs_stride;
  void* y;                     // [P, N], row stride y_stride elements: x's dtype, or f32 with row_scale
  std::int64_t y_stride;
};

__device__ __forceinline__ float load_scale(const void* p, int dtype, std::int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const std::uint16_t b = static_cast<const std::uint16_t*>(p)[i];
  return dtype == 1 ? __bfloat162float(__ushort_as_bfloat16(b)) : __half2float(__ushort_as_half(b));
}

template <int TOKENS, int DEPTH, bool NV, bool F16>
__global__ void __launch_bounds__(kWarps * 32) grouped_kernel(const GemmArgs a) {
  constexpr int NT = TOKENS / 8;
  constexpr int kDepth = DEPTH;
  using Scan = cub::BlockScan<int, kWarps * 32>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int item_e, item_m0, carry;
  __shared__ std::uint32_t lut[256];
  extern __shared__ float red[];  // (kWarps, kStrips, NT, 4, 32) fp32 partial tiles

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  // The work item: the blockIdx.y-th (expert, tile of TOKENS rows) over the experts with rows, in order.
  if (tid == 0) {
    item_e = -1;
    carry = 0;
  }
  __syncthreads();
  const int want = int(blockIdx.y);
  for (int base = 0; base < a.E; base += kWarps * 32) {
    const int e = base + tid;
    const int rows = e < a.E ? a.offsets[e + 1] - a.offsets[e] : 0;
    const int n = (rows + TOKENS - 1) / TOKENS;
    int ex, total;
    Scan(scan).ExclusiveSum(n, ex, total);
    const int first = carry + ex;
    if (n > 0 && want >= first && want < first + n) {
      item_e = e;
      item_m0 = (want - first) * TOKENS;
    }
    __syncthreads();
    if (tid == 0) carry += total;
    __syncthreads();
    if (carry > want) break;
  }
  const int e = item_e;
  if (e < 0) return;  // fewer items than the grid's bound: nothing to do
  const int q0 = a.offsets[e] + item_m0;                             // first sorted row of the tile
  const int mrows = min(TOKENS, a.offsets[e + 1] - q0);              // rows of the tile
  const int shift = a.exp_shift[e];
  lut[tid] = std::uint32_t(gemm::scale_multiplier<NV, F16>(tid, shift)) * 0x10001u;

  const std::int64_t strip0 = std::int64_t(blockIdx.x) * kStrips;
  const int slice = warp;  // 8 K slices, one per warp
  const int a_begin = int(std::int64_t(slice) * a.katoms / kWarps);
  const int n_atoms = int(std::int64_t(slice + 1) * a.katoms / kWarps) - a_begin;
  const int slot = NV ? lane : 2 * g + (tq >> 1);
  constexpr int kScaleStride = gemm::scale_bytes<NV>() / 2;
  const uint4* codes = reinterpret_cast<const uint4*>(a.codes + e * a.codes_stride);
  const std::uint8_t* scales = a.scales + e * a.scales_stride;
  const uint4* cnext[kStrips];
  const std::uint16_t* snext[kStrips];
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    const std::int64_t tile = (strip0 + s) * a.katoms + a_begin;
    cnext[s] = codes + tile * 32 + lane;
    snext[s] = reinterpret_cast<const std::uint16_t*>(scales + tile * gemm::scale_bytes<NV>()) + slot;
  }
  uint4 wq[kDepth][kStrips];
  std::uint32_t sq[kDepth][kStrips];
  const auto load_tile = [&](int d) {
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
      wq[d][s] = gemm::load_stream(cnext[s]);
      sq[d][s] = gemm::load_stream_u16(snext[s]);
      cnext[s] += 32;
      snext[s] += kScaleStride;
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    if (d < n_atoms) load_tile(d);
  __syncthreads();  // the LUT

  float acc[kStrips][NT][4];
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[s][t][i] = 0.0f;

  // x: this thread's tile rows 8t + g (gathered), columns 64 * tile + 16 * tq ..
  const std::uint16_t* xp = a.x + std::int64_t(a_begin) * 64 + 16 * tq;
  std::uint32_t xmask = 0;
  std::int64_t xoff[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + g;
    std::int64_t row = 0;
    if (m < mrows) {
      const int q = q0 + m;
      row = a.token_rows ? a.sorted[q] / a.k : q;
      xmask |= 1u << t;
    }
    xoff[t] = row * a.x_stride;
  }
  std::int64_t kleft = a.K - (std::int64_t(a_begin) * 64 + 16 * tq);

  for (int base = 0; base < n_atoms; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + d < n_atoms) {
        std::uint32_t cm[kStrips][2];
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          cm[s][0] = lut[sq[d][s] & 0xFF];
          cm[s][1] = lut[sq[d][s] >> 8];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 xv[NT];
#pragma unroll
          for (int t = 0; t < NT; ++t)
            xv[t] = ((xmask >> t) & 1u) && kleft > 8 * h ? *reinterpret_cast<const uint4*>(xp + xoff[t] + 8 * h)
                                                         : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * h + jj;
#pragma unroll
            for (int s = 0; s < kStrips; ++s) {
              const std::uint32_t word = j == 0 ? wq[d][s].x : j == 1 ? wq[d][s].y : j == 2 ? wq[d][s].z : wq[d][s].w;
              const std::uint32_t frag[4] = {gemm::mul2<F16>(gemm::upcast_pair<F16, 0>(word), cm[s][0]),
                                             gemm::mul2<F16>(gemm::upcast_pair<F16, 1>(word), cm[s][1]),
                                             gemm::mul2<F16>(gemm::upcast_pair<F16, 2>(word), cm[s][0]),
                                             gemm::mul2<F16>(gemm::upcast_pair<F16, 3>(word), cm[s][1])};
#pragma unroll
              for (int t = 0; t < NT; ++t) {
                const std::uint32_t b0 = jj == 0 ? xv[t].x : xv[t].z;
                const std::uint32_t b1 = jj == 0 ? xv[t].y : xv[t].w;
                gemm::mma16816<F16>(acc[s][t], frag, b0, b1);
              }
            }
          }
        }
        if (base + d + kDepth < n_atoms) load_tile(d);  // after slot d's last read (w4a16.cuh)
        xp += 64;
        kleft -= 64;
      }
    }
  }

  // Partial tiles, summed over the 8 K slices in order by one thread per output.
  constexpr int per = kStrips * NT * 4 * 32;
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp * per + ((s * NT + t) * 4 + i) * 32 + lane] = acc[s][t][i];
  __syncthreads();
  const float mul = ldexpf(1.0f, shift), div = NV ? a.tensor_scale[e] : 1.0f;
  for (int idx = tid; idx < per; idx += kWarps * 32) {
    float v = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kWarps; ++ks) v = __fadd_rn(v, red[ks * per + idx]);
    const int ln = idx & 31, i = (idx >> 5) & 3, st = idx >> 7, t = st % NT, s = st / NT;
    const std::int64_t n = (strip0 + s) * 16 + (ln >> 2) + (i >= 2 ? 8 : 0);
    const int m = 8 * t + 2 * (ln & 3) + (i & 1);
    if (n < a.N && m < mrows) {
      const int q = q0 + m;
      float o = __fdiv_rn(__fmul_rn(v, mul), div);
      if (a.bias) {
        const std::uint16_t bb = a.bias[e * a.bias_stride + n];
        o = __fadd_rn(o, F16 ? __half2float(__ushort_as_half(bb)) : __bfloat162float(__ushort_as_bfloat16(bb)));
      }
      if (a.row_scale) {
        const int p = a.sorted[q];
        const float rs = load_scale(a.row_scale, a.rs_dtype, std::int64_t(p / a.k) * a.rs_stride + p % a.k);
        static_cast<float*>(a.y)[q * a.y_stride + n] = __fmul_rn(o, rs);
      } else {
        static_cast<std::uint16_t*>(a.y)[q * a.y_stride + n] =
            F16 ? __half_as_ushort(__float2half_rn(o)) : __bfloat16_as_ushort(__float2bfloat16_rn(o));
      }
    }
  }
}

// Rows q >= offsets[E] of y (the dropped pairs'): zeros.
__global__ void zero_dropped_kernel(const int* offsets, int E, int P, std::int64_t N, void* y, std::int64_t y_stride, int elem_bytes) {
  const int first = offsets[E];
  const std::int64_t cells = std::int64_t(P - first) * N;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < cells; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t q = first + i / N, n = i % N;
    if (elem_bytes == 4)
      static_cast<float*>(y)[q * y_stride + n] = 0.0f;
    else
      static_cast<std::uint16_t*>(y)[q * y_stride + n] = 0;
  }
}

// ---- activation and combine ----------------------------------------------------------------------------
// kind: 0 none, 1 swiglu, 2 swiglu_oai; dt: the dtype of h and a (core's DType).
template <int KIND, DType DT>
__global__ void activation_kernel(const std::uint16_t* h, std::int64_t h_stride, std::uint16_t* out, std::int64_t a_stride,
                                  std::int64_t rows, std::int64_t I, float alpha, float limit) {
  const std::int64_t cells = rows * I;
  for (std::int64_t c = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cells; c += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = c / I, i = c % I;
    const std::uint16_t* hr = h + r * h_stride;
    const auto ld = [&](std::int64_t col) { return core::dtype_bits_to_f32(hr[col], DT); };
    float v;
    if constexpr (KIND == 0)
      v = ld(i);
    else if constexpr (KIND == 1)
      v = core::moe_swiglu(ld(i), ld(I + i));
    else
      v = core::moe_swiglu_oai(ld(2 * i), ld(2 * i + 1), alpha, limit);
    out[r * a_stride + i] = static_cast<std::uint16_t>(core::round_to_dtype_bits(v, DT));
  }
}

template <DType DT>
__global__ void combine_kernel(const float* o, std::int64_t o_stride, const int* pos, int k, std::uint16_t* y, std::int64_t y_stride,
                               std::int64_t T, std::int64_t H) {
  const std::int64_t cells = T * H;
  for (std::int64_t c = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cells; c += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = c / H, col = c % H;
    float s = 0.0f;
    bool first = true;
    for (int j = 0; j < k; ++j) {
      const int q = pos[t * k + j];
      if (q < 0) continue;
      const float v = o[q * o_stride + col];
      s = first ? v : __fadd_rn(s, v);
      first = false;
    }
    y[t * y_stride + col] = static_cast<std::uint16_t>(core::round_to_dtype_bits(s, DT));
  }
}

}  // namespace mxq::cuda::moe_kernels
