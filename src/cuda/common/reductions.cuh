#pragma once
// Reductions inside a group (the T = g / C adjacent lanes that hold one block): amax, the fixed-order
// pairwise sums of the quest rule.
//
// The shuffle tree combines chunk sums of adjacent halves, which is exactly pairwise_sum's order (fp32
// addition is commutative, so both lanes of a pair compute the same bits).
#include "core/fastmath.hpp"
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// Pairwise sum of the N values v[OFF .. OFF + N) of a thread (the leaves of pairwise_sum's tree:
// S(v, n) = S(v, n/2) + S(v + n/2, n/2)), unrolled at compile time.
// NOTE: measured on the H200 (2026-12-03): written as the level-by-level loop over a copy, nvcc kept
// the copy in local memory and the quest kernels ran at 17% of copy (ncu: LDL.128 on the hot path).
template <int N, int OFF = 0, int C>
__device__ __forceinline__ float pairwise_tree(const float (&v)[C]) {
  if constexpr (N == 1) return v[OFF];
  else return core::add_rn(pairwise_tree<N / 2, OFF>(v), pairwise_tree<N / 2, OFF + N / 2>(v));
}
template <int C>
__device__ __forceinline__ float chunk_pairwise(const float (&v)[C]) {
  return pairwise_tree<C>(v);
}
// Over the T = g / C lanes of a group (T <= 32), unrolled: each step predicated on T (uniform).
__device__ __forceinline__ float group_sum(const Params& p, float s) {
#pragma unroll
  for (int st = 1; st < 32; st <<= 1)
    if (st < p.T) s = core::add_rn(s, __shfl_xor_sync(kFull, s, st));
  return s;
}
__device__ __forceinline__ u32 group_max(const Params& p, u32 m) {
#pragma unroll
  for (int st = 1; st < 32; st <<= 1)
    if (st < p.T) m = core::umax(m, __shfl_xor_sync(kFull, m, st));
  return m;
}

// max |x| as fp32 bits of C elements of a bf16 view given as its words, two lanes per instruction.
template <int C>
__device__ __forceinline__ u32 bf16_words_amax(const u32 (&xw)[C / 2]) {
  u32 m2 = 0;
#pragma unroll
  for (int j = 0; j < C / 2; ++j) m2 = core::vmaxu2(m2, xw[j] & 0x7FFF7FFFu);
  return core::umax(m2 & 0xFFFFu, m2 >> 16) << 16;
}

// The max of m over the warp's lanes, in every lane (every lane calls it).
__device__ __forceinline__ u32 warp_max(u32 m) {
  for (int st = 16; st > 0; st >>= 1) m = core::umax(m, __shfl_xor_sync(kFull, m, st));
  return m;
}
// The max of m over the block's threads, in thread 0 (every thread calls it; one barrier).
__device__ __forceinline__ u32 block_max(u32 m) {
  m = warp_max(m);
  __shared__ u32 warp_maxima[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_maxima[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = core::umax(m, warp_maxima[w]);
  }
  return m;
}
// The max of m over the block's threads, atomicMax'ed into *acc by thread 0 (every thread calls it).
__device__ __forceinline__ void block_max_into(u32 m, u32* acc) {
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(acc, m);
}

// The chunk's max |x| as fp32 bits, from the input words: bf16 two lanes per instruction; other
// dtypes from the unpacked fp32 bits xb (which unpack() fills).
template <DType DT, int C, class Unpack>
__device__ __forceinline__ u32 chunk_amax(const u32 (&xw)[vec_words<DT, C>()], u32 (&xb)[C], Unpack&& unpack) {
  u32 am = 0;
  if constexpr (DT == DType::bf16) {
    am = bf16_words_amax<C>(xw);
  } else {
    unpack();
#pragma unroll
    for (int i = 0; i < C; ++i) am = core::umax(am, xb[i] & 0x7FFFFFFFu);
  }
  return am;
}

template <int C>
constexpr int log2_chunk() {
  return C == 16 ? 4 : C == 8 ? 3 : C == 4 ? 2 : C == 2 ? 1 : 0;
}

// The quest argument of the calling thread's group (quest_arg's arithmetic, distributed).
template <int C>
__device__ __forceinline__ float group_quest_arg(const Params& p, const u32 (&xb)[C]) {
  using namespace core;
  float xs[C], d2[C];
#pragma unroll
  for (int i = 0; i < C; ++i) xs[i] = u2f(xb[i]);
  // NOTE: g is a power of two, so s / g and s * (1 / g) are the same real number, both correctly
  // rounded: equal bits, without a division's instruction sequence.
  const float inv_g = pow2f(-(p.log2T + log2_chunk<C>()));
  const float mean = mul_rn(group_sum(p, chunk_pairwise<C>(xs)), inv_g);
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const float d = sub_rn(xs[i], mean);
    d2[i] = mul_rn(d, d);
  }
  const float var = mul_rn(group_sum(p, chunk_pairwise<C>(d2)), inv_g);
  return add_rn(div_rn(mul_rn(sqrt_rn(var), 2.92247856f), 6.0f), 1e-8f);
}

// Stochastic-rounding words of the C elements starting at logical index j0, B random bits each
// (sr_bits(seed, j, B) for each, core/codec.hpp). The chunk's random bits are nw = C B / 32 words of
// the Philox stream: whole calls when j0 is a multiple of a call's 128 / B elements (C B >= 128), or
// part of one call when the chunk lies inside one (C B < 128); then each element's field is spread
// into its own word, in place from the last element down (element i reads word i B / 32 <= i). Any
// other chunk (unaligned offsets or rows, C = 2) takes one sr_bits per element.
// NOTE: one code path for every B: three inlined variants (B as a template parameter) spilled
// registers in the 80-register stochastic kernels (nvcc 13.0, sm_90a).
template <int C>
__device__ __forceinline__ void sr_words(u64 seed, u64 j0, int B, u32 (&a)[C]) {
  using namespace core;
  if constexpr (C >= 8) {
    const int lp = sr_log2_per_call(B), nw = C * B / 32;
    const u32 in_call = u32(j0) & ((1u << lp) - 1u);  // j0's field in its call
    // (whole calls are counted on from j0's: not across 2^64, where the element index wraps to 0)
    const bool whole = nw >= 4 && in_call == 0 && j0 + u64(C - 1) >= j0;
    const bool part = nw < 4 && (u32(j0) & u32(C - 1)) == 0;
    if (whole || part) {
      if (whole) {
#pragma unroll
        for (int n = 0; n < C / 4; ++n) {  // at most C / 4 calls (B = 32)
          if (4 * n < nw) {
            const U32x4 r = philox_block(seed, (j0 >> lp) + u64(n));
#pragma unroll
            for (int k = 0; k < 4; ++k) a[4 * n + k] = r.v[k];
          }
        }
      } else {
        const U32x4 r = philox_block(seed, j0 >> lp);
        const u32 q = in_call * u32(B) / 32;  // the chunk's first word in the call
#pragma unroll
        for (int k = 0; k < 3; ++k)
          if (k < nw) a[k] = philox_word(r, q + u32(k));
      }
      if (B != 32) {
#pragma unroll
        for (int i = C - 1; i >= 0; --i) {
          if (B == 16) a[i] = sr_field_of_word(a[i / 2], i % 2, 16);
          else a[i] = sr_field_of_word(a[i / 4], i % 4, 8);
        }
      }
      return;
    }
  }
#pragma unroll 1
  for (int i = 0; i < C; ++i) {  // rare: one call per element, shifted into place (static indices)
    const u32 v = sr_bits(seed, j0 + u64(i), B);
#pragma unroll
    for (int k = 0; k + 1 < C; ++k) a[k] = a[k + 1];
    a[C - 1] = v;
  }
}

// The stochastic-rounding words of chunk c's elements (logical index offset + row * K + column), with
// the launch's random bits per element.
template <int C>
__device__ __forceinline__ void chunk_sr_words(const Params& p, const Coord& c, u32 (&rnd)[C]) {
  sr_words<C>(p.seed, p.offset + u64(c.row) * u64(p.K) + u64(c.k0), p.sr_bits, rnd);
}

}  // namespace mxq::cuda
