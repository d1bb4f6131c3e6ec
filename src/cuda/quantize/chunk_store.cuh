#pragma once
// The end of a quantize chunk, shared by the MX and NVFP4 chunk code: packed codes, the block's scale
// byte and the optional clip-mask bits.
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// Packs C element codes (each below 2^bits, sign included) into words: FP4 two per byte, low nibble
// first; other formats one per byte.
template <class Fmt, int C>
__device__ __forceinline__ void pack_codes(const u32 (&codes)[C], u32 (&w)[code_words<Fmt, C>()]) {
  constexpr int kBits = Fmt::code_bits;
#pragma unroll
  for (int j = 0; j < code_words<Fmt, C>(); ++j) w[j] = 0;
  // NOTE: the fields do not overlap, so a shift-add (one LEA) packs each.
#pragma unroll
  for (int i = 0; i < C; ++i) w[i * kBits / 32] += codes[i] << ((i * kBits) % 32);
}

// Stores a chunk's packed codes cw (zeroed for a NaN/Inf block), its block's scale byte sb (lane 0 of
// the group) and, where the clip mask is wanted, the bits of keep (element i at bit i). Every lane
// calls it: with C = 2 four adjacent lanes share a mask byte and OR their bits by shuffles (rows hold
// a multiple of 4 chunks, so the four lanes are aligned and in one row).
template <class Fmt, int C>
__device__ __forceinline__ void store_quantized(const Params& p, const Coord& c, bool nonfinite, std::uint8_t sb,
                                                const u32 (&cw)[code_words<Fmt, C>()], u32 keep) {
  const i64 valid = is_flat<C>(p) ? C : p.K - c.k0 < C ? p.K - c.k0 : C;  // <= 0: the chunk is padding past K
  u32 mbyte = 0;  // C = 16: two bytes
  if (p.mask) {
    constexpr u32 kAll = (1u << C) - 1u;
    mbyte = valid <= 0 ? 0u : (keep & (valid >= C ? kAll : ((1u << valid) - 1u))) << (c.k0 % 8);
    if constexpr (C == 2) {
      mbyte |= __shfl_xor_sync(kFull, mbyte, 1);
      mbyte |= __shfl_xor_sync(kFull, mbyte, 2);
    }
  }
  if (!c.active) return;  // every shuffle is behind us
  if (valid <= 0) return;  // padding chunks own no bytes (lane 0 of a group is never padding)
  if (c.lane_in_group == 0) p.scales[scale_index<C>(p, c.row, c.block)] = sb;
  constexpr int kBits = Fmt::code_bits;
  constexpr int NB = C * kBits / 8;  // bytes of this chunk
  u32 w[code_words<Fmt, C>()];
#pragma unroll
  for (int j = 0; j < code_words<Fmt, C>(); ++j) w[j] = nonfinite ? 0u : cw[j];  // a NaN/Inf block has zero codes
  std::uint8_t* d = p.codes + c.row * p.codes_stride + c.k0 * kBits / 8;
  if (c.full && p.codes_vec) {
    if constexpr (NB >= 4) store_words<NB / 4>(d, w);
    else if constexpr (NB == 2) *reinterpret_cast<std::uint16_t*>(d) = static_cast<std::uint16_t>(w[0]);
    else *d = static_cast<std::uint8_t>(w[0]);
  } else {
    const i64 nbytes = (valid * kBits + 7) / 8;
#pragma unroll
    for (int j = 0; j < NB; ++j)
      if (j < nbytes) d[j] = static_cast<std::uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
  if (p.mask && c.k0 % 8 == 0) {
    std::uint8_t* mrow = p.mask + c.row * p.mask_stride + c.k0 / 8;
    mrow[0] = static_cast<std::uint8_t>(mbyte);
    if (C == 16 && valid > 8) mrow[1] = static_cast<std::uint8_t>(mbyte >> 8);
  }
}

}  // namespace mxq::cuda
