#pragma once
// Vector global accesses, the cp.async staging ring, and dtype words <-> fp32 bits.
#include <cuda_fp16.h>

#include <cstdint>

#include "core/dispatch.hpp"
#include "core/format_traits.hpp"
#include "cuda/common/config.cuh"

namespace mxq::cuda {

using core::Storage;

template <DType DT>
__device__ __forceinline__ u32 to_f32_bits(Storage<DT> v) {
  if constexpr (DT == DType::f32) return v;
  else if constexpr (DT == DType::bf16) return u32(v) << 16;
  else return core::f2u(__half2float(__ushort_as_half(v)));  // exact
}

// Bytes moved by one C-element vector access of a DT view, the alignment it needs, and its words.
template <DType DT, int C>
constexpr int vec_bytes() {
  return C * int(sizeof(Storage<DT>));
}
template <DType DT, int C>
constexpr int vec_align() {
  return vec_bytes<DT, C>() < 16 ? vec_bytes<DT, C>() : 16;
}
template <DType DT, int C>
constexpr int vec_words() {
  return vec_bytes<DT, C>() / 4;
}
static_assert(vec_bytes<DType::f32, 8>() <= LaunchConfig::kMaxChunkBytes &&
                  vec_bytes<DType::bf16, 16>() <= LaunchConfig::kMaxChunkBytes,
              "the widest chunks fit a ring slot");

// 32-bit words holding the packed codes of a C-element chunk of format Fmt.
template <class Fmt, int C>
constexpr int code_words() {
  return (C * Fmt::code_bits / 8 + 3) / 4;
}

// Vector global accesses of W 32-bit words (W = 1, 2 or a multiple of 4) with streaming cache hints.
// NOTE: values move through plain register words; a local array whose address is taken would be
// placed in local memory (a stack frame) and cost a round trip per access.
template <int W>
__device__ __forceinline__ void load_words(const void* src, u32 (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 v = __ldcs(static_cast<const uint4*>(src) + q);
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = __ldcs(static_cast<const uint2*>(src));
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = __ldcs(static_cast<const unsigned int*>(src));
  }
}
template <int W>
__device__ __forceinline__ void store_words(void* dst, const u32 (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) __stcs(static_cast<uint4*>(dst) + q, make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]));
  } else if constexpr (W == 2) {
    __stcs(static_cast<uint2*>(dst), make_uint2(w[0], w[1]));
  } else {
    __stcs(static_cast<unsigned int*>(dst), w[0]);
  }
}

// Asynchronous global -> shared copies (cp.async, sm_80+): the staging ring of block_kernel. A copy of
// N bytes reads src_bytes <= N bytes and zero-fills the rest, so partial chunks need no other path.
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
template <int N>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, u32 src_bytes) {
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A ring slot (shared memory) as W words.
template <int W>
__device__ __forceinline__ void read_slot(const std::uint8_t* slot, u32 (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 v = reinterpret_cast<const uint4*>(slot)[q];
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(slot);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const u32*>(slot);
  }
}

// Unpacks W little-endian words of a DT view into fp32 bit patterns.
template <DType DT, int C, int W>
__device__ __forceinline__ void unpack_words(const u32 (&w)[W], u32 (&xb)[C]) {
  using S = Storage<DT>;
#pragma unroll
  for (int i = 0; i < C; ++i) {
    if constexpr (sizeof(S) == 4) xb[i] = w[i];
    else xb[i] = to_f32_bits<DT>(static_cast<S>((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu));
  }
}

// Output bits of a chunk: fp32/fp16 in the low bits; bf16 in the HIGH half (the fp32 pattern it
// truncates, so packing two is one byte permute).
template <DType DT>
__device__ __forceinline__ u32 hi16(u32 v) {
  return DT == DType::bf16 ? v << 16 : v;
}
// Packs C outputs (hi16 form) into the little-endian words of a DT view.
template <DType DT, int C>
__device__ __forceinline__ void pack_outputs(const u32 (&ob)[C], u32 (&w)[vec_words<DT, C>()]) {
#pragma unroll
  for (int j = 0; j < vec_words<DT, C>(); ++j) {
    if constexpr (DT == DType::f32) w[j] = ob[j];
    else if constexpr (DT == DType::bf16) w[j] = __byte_perm(ob[2 * j], ob[2 * j + 1], 0x7632);
    else w[j] = (ob[2 * j] & 0xFFFFu) | (ob[2 * j + 1] << 16);
  }
}

}  // namespace mxq::cuda
