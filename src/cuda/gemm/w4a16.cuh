#pragma once
// The W4A16 linear kernel: y = x @ W^T (+ bias), W prepacked MXFP4 / NVFP4 (docs/linear.md), x and y
// bf16 or fp16, fp32 accumulation on the tensor cores (mma.sync m16n8k16: sm80, sm89, sm90).
//
// Weights are the mma's A operand (16 rows of W per fragment), tokens the B operand (8 per
// fragment). A CTA of 8 warps owns WN x 32 rows of W and TOKENS rows of x; the warps of one 32-row
// group split the CTA's share of K, and the partial tiles are added in shared memory in a fixed order
// (deterministic, no atomics); on sm90 a cluster of CTAs may split K further, reduced through
// distributed shared memory in rank order. Weights stream straight into registers (16 bytes per lane
// per 64-column tile, kDepth tiles ahead); x is read through L1, where the WN warps reading the same
// columns find it.
//
// Exactness (docs/numerics.md, "W4A16 linear"): an E2M1 nibble placed in the low exponent bits of a
// bf16 (fp16) is the code's value times 2^-126 (2^-14), subnormals included; one bf16x2 (f16x2)
// multiply by C = scale * 2^(126 - d) (2^(14 - d)), a normal number by prepack's choice of d, gives
// code * scale * 2^-d exactly; the fp32 sum is multiplied by 2^d in the epilogue.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/linear_layout.hpp"

namespace mxq::cuda::gemm {

struct LinearArgs {
  const uint4* codes;           // (Np/16 * Kp/64 tiles, 512) u8, 32 uint4 per tile
  const std::uint8_t* scales;   // (tiles, 32 | 64) u8
  const std::uint16_t* x;       // (M, K) bf16 | f16, row stride x_stride elements
  const std::uint16_t* bias;    // (N) or nullptr
  std::uint16_t* y;             // (M, N), row stride y_stride elements
  std::int64_t M, N, K, x_stride, y_stride;
  int katoms;                   // Kp / 64
  int exp_shift;                // d
  float mul, div;               // epilogue: y = (acc * mul) / div (+ bias)
};

constexpr int kWarps = 8;          // warps per CTA, each a slice of K
constexpr int kStrips = 2;         // 16-row strips of W per warp (and per CTA)

template <bool NV>
constexpr int scale_bytes() { return NV ? 64 : 32; }

// The bf16 (fp16) bits of the multiplier C for scale byte b; NaN for a NaN scale. A scale whose C would
// leave the normal range belongs only to blocks of zero codes (prepack refuses the others): 0 then.
template <bool NV, bool F16>
__device__ std::uint16_t scale_multiplier(int b, int d) {
  if (!NV) {
    if (b == 0xFF) return F16 ? 0x7E00 : 0x7FC0;
    const int field = F16 ? b - 98 - d : b + 126 - d;
    if (field < 1 || field > (F16 ? 30 : 254)) return 0;
    return static_cast<std::uint16_t>(field << (F16 ? 10 : 7));
  } else {
    const int mag = b & 0x7F;
    if (mag == 0x7F) return F16 ? 0x7E00 : 0x7FC0;
    const int e = mag >> 3, m = mag & 7;
    // E4M3 value (e ? (8 + m) * 2^(e - 10) : m * 2^-9), times 2^118 (bf16) or 2^6 (fp16): exact in fp32.
    float v = e ? ldexpf(float(8 + m), e - 10) : ldexpf(float(m), -9);
    v = ldexpf(v, F16 ? 6 : 118);
    if (b & 0x80) v = -v;
    if (F16) return __half_as_ushort(__float2half_rn(v));
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// Pair i of a packed word (core/linear_layout.hpp) as a bf16x2 (fp16x2) of code * 2^-126 (2^-14): the
// sign in bit 15 and the magnitude bits e1 e0 m in the low exponent bits and the top mantissa bit of each
// half. bf16: two operations for pairs 0-2, three for pair 3; fp16 moves the magnitude up by 3 bits.
template <bool F16, int I>
__device__ __forceinline__ std::uint32_t upcast_pair(std::uint32_t w) {
  constexpr int kRot = I == 0 ? 4 : I == 1 ? 10 : 14;
  static_assert(I >= 3 || kRot == core::kPairRotation[I < 3 ? I : 0], "the rotations of core/linear_layout.hpp");
  std::uint32_t r;
  if (I < 3)
    r = __funnelshift_r(w, w, kRot) & 0x81C081C0u;
  else
    r = (w & 0x81808180u) | ((w >> 8) & 0x00400040u);
  if (F16) r = (r & 0x80008000u) | ((r << 3) & 0x0E000E00u);
  return r;
}

template <bool F16>
__device__ __forceinline__ std::uint32_t mul2(std::uint32_t a, std::uint32_t c) {
  std::uint32_t d;
  if (F16) {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(c));
  } else {
    // fma with -0: the exact product (bf16x2 multiply is sm90-only); subnormal operands are kept.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(c), "r"(0x80008000u));
  }
  return d;
}

template <bool F16>
__device__ __forceinline__ void mma16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if (F16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ std::uint32_t load_stream_u16(const std::uint16_t* p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// Cluster primitives (sm90): rank, barrier, and loads from another CTA's shared memory.
namespace ptx {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ std::uint32_t cluster_rank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The value of the same shared float in CTA `rank` of the cluster.
__device__ __forceinline__ float load_rank_f32(const float* local, std::uint32_t rank) {
  const std::uint32_t addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(local));
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif
}  // namespace ptx

template <int TOKENS>
constexpr int reduce_floats() { return kWarps * kStrips * (TOKENS / 8) * 4 * 32; }

// XS (x staged): each K slice's warps share a ring of kXStages x tiles (TOKENS rows x 64 columns, rows
// padded to 144 bytes so that a warp's 16-byte fragment loads hit distinct banks), filled by cp.async.
constexpr int kXStages = 3;
constexpr int kXRow = 144;
template <int TOKENS, int WN>
constexpr int xring_bytes() { return (kWarps / WN) * kXStages * TOKENS * kXRow; }
template <int TOKENS, int WN, bool XS>
constexpr int linear_smem_bytes() {
  return XS && xring_bytes<TOKENS, WN>() > reduce_floats<TOKENS>() * 4 ? xring_bytes<TOKENS, WN>() : reduce_floats<TOKENS>() * 4;
}

// TOKENS: rows of x per CTA (8 .. 64); DEPTH: 64-column weight tiles each warp keeps in flight; WN: strip
// pairs per CTA (warp w takes pair w % WN and K slice w / WN of the CTA's kWarps / WN, so the WN warps of
// one K slice read the same x, once from L2); CLUSTER: CTAs of a cluster (sm90; grid.x = pairs / WN *
// CLUSTER) splitting K further. Sums: over the CTA's K slices in order, then over the cluster's ranks in
// order (deterministic, no atomics, no workspace).
template <int TOKENS, int DEPTH, int WN, int CLUSTER, bool NV, bool F16, bool XS = false>
__global__ void __launch_bounds__(kWarps * 32, TOKENS <= 16 && DEPTH <= 4 ? 2 : 1) w4a16_kernel(const LinearArgs a) {
  constexpr int NT = TOKENS / 8;  // n8 fragments of tokens
  constexpr int kDepth = DEPTH;
  constexpr int KS = kWarps / WN;  // K slices per CTA
  static_assert(TOKENS % 8 == 0 && NT <= 8, "TOKENS is a multiple of 8, at most 64");
  static_assert(kWarps % WN == 0, "WN divides the warps");
  __shared__ std::uint32_t lut[256];  // the multiplier of each scale byte, in both halves
  extern __shared__ float red[];  // (kWarps, kStrips, NT, 4, 32) fp32 partial tiles

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  lut[tid] = std::uint32_t(scale_multiplier<NV, F16>(tid, a.exp_shift)) * 0x10001u;  // 256 threads, one entry each
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int rank = CLUSTER > 1 ? int(ptx::cluster_rank()) : 0;
#else
  constexpr int rank = 0;
#endif

  const int ng = warp % WN, ks = warp / WN;
  const std::int64_t pair0 = std::int64_t(blockIdx.x / CLUSTER) * WN;   // the CTA's first strip pair
  const std::int64_t strip0 = (pair0 + ng) * kStrips;                  // this warp's first strip
  // The last CTA's groups may lie past Np. With XS such a warp still runs the loop (the slice's barriers)
  // on strip 0's tiles, and its outputs are never written.
  const bool rows_exist = strip0 * 16 < a.N;
  const bool run_loop = XS || rows_exist;
  const std::int64_t m0 = std::int64_t(blockIdx.y) * TOKENS;
  const int slice = rank * KS + ks, slices = KS * CLUSTER;
  const int a_begin = int(std::int64_t(slice) * a.katoms / slices);
  const int n_atoms = run_loop ? int(std::int64_t(slice + 1) * a.katoms / slices) - a_begin : 0;
  const int slot = NV ? lane : 2 * g + (tq >> 1);
  constexpr int kScaleStride = scale_bytes<NV>() / 2;  // u16 per tile
  // The next tile each strip loads: tiles advance along K, 32 uint4 / kScaleStride u16 apart.
  const uint4* cnext[kStrips];
  const std::uint16_t* snext[kStrips];
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    const std::int64_t tile = rows_exist ? (strip0 + s) * a.katoms + a_begin : 0;
    cnext[s] = a.codes + tile * 32 + lane;
    snext[s] = reinterpret_cast<const std::uint16_t*>(a.scales + tile * scale_bytes<NV>()) + slot;
  }

  // The weight ring: tiles 0 .. kDepth-1 now, tile i + kDepth when tile i has been read.
  uint4 wq[kDepth][kStrips];
  std::uint32_t sq[kDepth][kStrips];
  // The next tile of both strips into ring slot d.
  const auto load_tile = [&](int d) {
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
      wq[d][s] = load_stream(cnext[s]);
      sq[d][s] = load_stream_u16(snext[s]);
      cnext[s] += 32;
      snext[s] += kScaleStride;
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    if (d < n_atoms) load_tile(d);
  __syncthreads();  // the LUT
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: the weights above are not written by earlier kernels; x is.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

  float acc[kStrips][NT][4];
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[s][t][e] = 0.0f;

  // x: this thread's rows m0 + 8t + g (row 0 for rows past M, never read) and columns 64 * tile + 16 * tq ..
  const std::uint16_t* xp = a.x + std::int64_t(a_begin) * 64 + 16 * tq;
  std::uint32_t xmask = 0;  // bit t: row m0 + 8t + g exists
  std::int64_t xoff[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const std::int64_t m = m0 + 8 * t + g;
    xmask |= (m < a.M ? 1u : 0u) << t;
    xoff[t] = (m < a.M ? m : 0) * a.x_stride;
  }
  std::int64_t kleft = a.K - (std::int64_t(a_begin) * 64 + 16 * tq);  // columns of x left from xp on

  // XS: the slice's x ring. Stage i (atom a_begin + i) goes to slot i % kXStages; the WN warps of the
  // slice copy it 16 bytes at a time (zeros for rows past M and columns past K) and meet at the slice's
  // named barrier before reading it.
  unsigned char* xring = reinterpret_cast<unsigned char*>(red) + ks * kXStages * TOKENS * kXRow;
  const auto x_issue = [&](int i) {
    if constexpr (XS) {
      if (i < n_atoms) {
        unsigned char* dst = xring + (i % kXStages) * TOKENS * kXRow;
        const std::int64_t col0 = std::int64_t(a_begin + i) * 64;
        for (int c = ng * 32 + lane; c < TOKENS * 8; c += WN * 32) {
          const int r = c >> 3, q = c & 7;
          const std::int64_t m = m0 + r, col = col0 + 8 * q;
          const bool ok = m < a.M && col < a.K;
          const std::uint16_t* src = ok ? a.x + m * a.x_stride + col : a.x;
          const std::uint32_t d = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst + r * kXRow + 16 * q));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  };
  const auto slice_sync = [&] {
    if constexpr (XS) asm volatile("bar.sync %0, %1;" ::"r"(1 + ks), "r"(WN * 32) : "memory");
  };
  if constexpr (XS) {
#pragma unroll
    for (int i = 0; i < kXStages - 1; ++i) x_issue(i);
  }

  for (int base = 0; base < n_atoms; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + d < n_atoms) {
        std::uint32_t cm[kStrips][2];
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          const std::uint32_t sb = sq[d][s];
          cm[s][0] = lut[sb & 0xFF];
          cm[s][1] = lut[sb >> 8];
        }
        const unsigned char* xs = nullptr;
        if constexpr (XS) {
          // Stage base + d has landed (the newest kXStages - 2 may still be in flight) and every warp of
          // the slice is done with stage base + d - 1, whose slot the next copy reuses.
          asm volatile("cp.async.wait_group %0;" ::"n"(kXStages - 2) : "memory");
          slice_sync();
          x_issue(base + d + kXStages - 1);
          xs = xring + ((base + d) % kXStages) * TOKENS * kXRow + g * kXRow + 32 * tq;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 xv[NT];
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            if constexpr (XS)
              xv[t] = *reinterpret_cast<const uint4*>(xs + 8 * t * kXRow + 16 * h);
            else
              xv[t] = ((xmask >> t) & 1u) && kleft > 8 * h ? *reinterpret_cast<const uint4*>(xp + xoff[t] + 8 * h)
                                                           : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * h + jj;
#pragma unroll
            for (int s = 0; s < kStrips; ++s) {
              const std::uint32_t word = j == 0 ? wq[d][s].x : j == 1 ? wq[d][s].y : j == 2 ? wq[d][s].z : wq[d][s].w;
              const std::uint32_t frag[4] = {mul2<F16>(upcast_pair<F16, 0>(word), cm[s][0]),
                                             mul2<F16>(upcast_pair<F16, 1>(word), cm[s][1]),
                                             mul2<F16>(upcast_pair<F16, 2>(word), cm[s][0]),
                                             mul2<F16>(upcast_pair<F16, 3>(word), cm[s][1])};
#pragma unroll
              for (int t = 0; t < NT; ++t) {
                const std::uint32_t b0 = jj == 0 ? xv[t].x : xv[t].z;
                const std::uint32_t b1 = jj == 0 ? xv[t].y : xv[t].w;
                mma16816<F16>(acc[s][t], frag, b0, b1);
              }
            }
          }
        }
        // Slot d is refilled after its last read, so that the load writes its registers directly (loading
        // before the reads made the compiler load into temporaries and move them into the slot within this
        // tile, waiting for the load).
        if (base + d + kDepth < n_atoms) load_tile(d);
        xp += 64;
        kleft -= 64;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif

  if constexpr (XS) {
    // Every slice's warps pass the same number of slice barriers (slices differ by at most one atom), so
    // that the barrier phases line up across the CTA for the sanitizer's model as well.
    const int most = (a.katoms + slices - 1) / slices;
    for (int i = n_atoms; i < most; ++i) slice_sync();
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // the x rings share their memory with the partial tiles
  }
  // Partial tiles to shared memory; each output summed over the CTA's K slices in order (into slice 0's
  // slot, by the one thread that read them), then over the cluster's ranks in order.
  constexpr int per = kStrips * NT * 4 * 32;
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp * per + ((s * NT + t) * 4 + e) * 32 + lane] = acc[s][t][e];
  __syncthreads();
  constexpr int outs = WN * per;  // outputs of the CTA: (group, strip, token fragment, e, lane)
  if constexpr (CLUSTER > 1) {
    for (int q = tid; q < outs; q += kWarps * 32) {
      const int grp = q / per, idx = q % per;
      float v = 0.0f;
#pragma unroll
      for (int k = 0; k < KS; ++k) v = __fadd_rn(v, red[(k * WN + grp) * per + idx]);
      red[grp * per + idx] = v;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    ptx::cluster_sync();
#endif
  }
  for (int q = rank * kWarps * 32 + tid; q < outs; q += kWarps * 32 * CLUSTER) {
    const int grp = q / per, idx = q % per;
    float v = 0.0f;
    if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) v = __fadd_rn(v, ptx::load_rank_f32(red + grp * per + idx, r));
#endif
    } else {
#pragma unroll
      for (int k = 0; k < KS; ++k) v = __fadd_rn(v, red[(k * WN + grp) * per + idx]);
    }
    const int ln = idx & 31, e = (idx >> 5) & 3, st = idx >> 7, t = st % NT, s = st / NT;
    const std::int64_t n = ((pair0 + grp) * kStrips + s) * 16 + (ln >> 2) + (e >= 2 ? 8 : 0);
    const std::int64_t m = m0 + 8 * t + 2 * (ln & 3) + (e & 1);
    if (n < a.N && m < a.M) {
      float o = __fdiv_rn(__fmul_rn(v, a.mul), a.div);
      if (a.bias) {
        const std::uint16_t bb = a.bias[n];
        o = __fadd_rn(o, F16 ? __half2float(__ushort_as_half(bb)) : __bfloat162float(__ushort_as_bfloat16(bb)));
      }
      a.y[m * a.y_stride + n] = F16 ? __half_as_ushort(__float2half_rn(o)) : __bfloat16_as_ushort(__float2bfloat16_rn(o));
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER > 1) ptx::cluster_sync();  // no CTA leaves while another reads its shared memory
#endif
}

}  // namespace mxq::cuda::gemm

namespace mxq::cuda::gemm {

// dequantize_packed: one warp per tile; each lane writes its 16 columns of rows g and g + 8 as two
// 32-byte runs (the same upcast and multiplier as the GEMM, so the values are its operand exactly).
template <bool NV, bool F16>
__global__ void __launch_bounds__(256) dequantize_packed_kernel(const uint4* codes, const std::uint8_t* scales,
                                                                std::uint16_t* out, std::int64_t N, std::int64_t K,
                                                                int katoms, std::int64_t tiles, int exp_shift) {
  __shared__ std::uint32_t lut[256];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  lut[tid] = std::uint32_t(scale_multiplier<NV, F16>(tid, exp_shift)) * 0x10001u;
  __syncthreads();
  const std::int64_t tile = std::int64_t(blockIdx.x) * 8 + warp;
  if (tile >= tiles) return;
  const std::int64_t r = tile / katoms, a = tile % katoms;
  const uint4 w = codes[tile * 32 + lane];
  const int slot = NV ? lane : 2 * g + (tq >> 1);
  const std::uint8_t* sb = scales + tile * scale_bytes<NV>() + 2 * slot;
  const std::uint32_t cm[2] = {lut[sb[0]], lut[sb[1]]};
  std::uint32_t rows[2][8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t word = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
    rows[0][2 * j] = mul2<F16>(upcast_pair<F16, 0>(word), cm[0]);
    rows[1][2 * j] = mul2<F16>(upcast_pair<F16, 1>(word), cm[1]);
    rows[0][2 * j + 1] = mul2<F16>(upcast_pair<F16, 2>(word), cm[0]);
    rows[1][2 * j + 1] = mul2<F16>(upcast_pair<F16, 3>(word), cm[1]);
  }
  const std::int64_t col = 64 * a + 16 * tq;
  if (col >= K) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::int64_t row = 16 * r + g + 8 * h;
    if (row >= N) continue;
    uint4* o = reinterpret_cast<uint4*>(out + row * K + col);
    o[0] = make_uint4(rows[h][0], rows[h][1], rows[h][2], rows[h][3]);
    o[1] = make_uint4(rows[h][4], rows[h][5], rows[h][6], rows[h][7]);
  }
}

}  // namespace mxq::cuda::gemm
