#pragma once
// Quantize and QDQ of one chunk of NVFP4 (E2M1 elements, E4M3 block scale under the tensor encode
// scale S).
#include "core/fastmath.hpp"
#include "cuda/common/fp4_lookup.cuh"
#include "cuda/common/nvfp4_scale.cuh"
#include "cuda/common/params.cuh"
#include "cuda/common/reductions.cuh"
#include "cuda/quantize/choices.cuh"
#include "cuda/quantize/chunk_store.cuh"

namespace mxq::cuda {

// NVFP4 tables of a launch, one copy per block of block_kernel in shared memory: for each E4M3 block
// scale code c (127, the NaN code: zeros, unused) its value, the element multiplier
// nvfp4_multiplier(c, S) and, for QDQ to 16-bit outputs, the block's eight outputs (nv_table). Per
// chunk that leaves a table read where there were two divisions and the table's arithmetic.
struct NvTables {
  float sval[128], m[128];
  uint4 out[128];
};
template <DType DT, bool QDQ>
__device__ __forceinline__ void fill_nv_tables(const NvScale& nv, NvTables& t) {
  // QDQ to 16-bit outputs: 256 items, the multipliers (items 0..127) and the output tables (128..255)
  // on different threads. At decode sizes each thread has one chunk and this fill is on every warp's
  // path (the barrier), so its length counts; a block of 256 fills it in one pass of whole warps.
  constexpr int kItems = QDQ && DT != DType::f32 ? 256 : 128;
  for (int i = int(threadIdx.x); i < kItems; i += int(blockDim.x)) {
    const int c = i & 127;
    const float sval = c == 127 ? 0.0f : decode_f32(u32(c), spec_e4m3());
    if (i < 128) {
      t.sval[c] = sval;
      t.m[c] = sval == 0.0f ? 0.0f : nvfp4_multiplier(u32(c), nv.S);
    } else if constexpr (kItems == 256) {
      u32 o[4];
      nv_table<DT>(sval, nv, o);
      t.out[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
}

// One C-element chunk xw (the input's own words) of NVFP4: QDQ writes its outputs (of dtype ODT: the
// input's, or any dtype for a rotated fp32 chunk; nvt filled for ODT), quantize its codes, scale and
// clip-mask bits. Every lane of a warp calls it (group shuffles).
template <DType DT, int C, bool QDQ, class Ch, DType ODT = DT>
__device__ __forceinline__ void nvfp4_chunk(const Params& p, const Coord& c, const NvScale& nv, const NvTables& nvt,
                                            const u32 (&xw)[vec_words<DT, C>()]) {
  static_assert(ODT == DT || DT == DType::f32, "another output dtype only for fp32 chunks");
  using Fmt = core::FormatTraits<Format::nvfp4>;
  const bool sr = Ch::stochastic(p);
  u32 xb[C];
  auto unpack = [&] { unpack_words<DT, C, vec_words<DT, C>()>(xw, xb); };
  const u32 am = group_max(p, chunk_amax<DT, C>(xw, xb, unpack));
  bool nonfinite = am >= 0x7F800000u;  // (or, under rule quest, a NaN statistic: below)
  u32 rnd[C];
  if (sr) chunk_sr_words<C>(p, c, rnd);
  unpack();
  // nvfp4_block_scale_code (nvfp4_scale_code_fast: amax * S is finite or +Inf, never NaN), or under rule quest
  // nvfp4_quest_scale_code of the group's quest statistic (S = 1: the tables' multipliers are RN(1/s);
  // every lane takes the statistic's shuffles), then the scale's value and multiplier from the tables
  // (a NaN/Inf block: 0 and 0).
  u32 sc;
  if (Ch::quest(p)) {
    const float t = group_quest_arg<C>(p, xb);
    sc = nonfinite ? u32(kE4M3NaN) : nvfp4_quest_scale_code(t);
    nonfinite = sc == kE4M3NaN;  // a NaN statistic (sums overflowing to both infinities): as a NaN/Inf block
  } else {
    sc = nonfinite ? u32(kE4M3NaN) : nvfp4_scale_code_fast(mul_rn(u2f(am), nv.S));
  }
  const float sval = nvt.sval[sc], m = nvt.m[sc];
  const std::uint8_t sb = static_cast<std::uint8_t>(sc);
  if constexpr (QDQ && ODT != DType::f32 && C % 8 == 0) {
    if (!sr) {
      // Each element's code read off its rounding, packed two per byte, and the output by table
      // lookup in the block's eight outputs (nv_table, from the launch's tables).
      u32 cw[C / 8] = {};
#pragma unroll
      for (int i = 0; i < C; ++i) cw[i / 8] += nvfp4_encode_rne_readoff(xb[i], m) << (4 * (i % 8));
      const uint4 t = nvt.out[sc];
      u32 o[C / 2];
      fp4_bf16_lookup<C>(cw, t.x, t.y, t.z, t.w, 0u, o);
      if (c.active) store_packed<ODT, C>(p, c.row, c.k0, c.full, o, nonfinite);  // no shuffles follow
      return;
    }
  }
  u32 codes[C], out[C], keep = 0;
  if (sr) {
    // x * m rounded once, then stochastic rounding onto E2M1 in the unscaled form (e = 0): the
    // dithered add for 16 or 8 random bits, the fixed-point fraction for 32 (fastmath_test checks both
    // against nvfp4_encode_sr for any fp32 product). QDQ takes the rounded magnitude as it is.
    auto round_sr = [&](auto dither) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const u32 v = f2u(nvfp4_product(xb[i], m));
        const float rm = decltype(dither)::value ? sr_round_dither<ElemType::e2m1>(v, 0, rnd[i])
                                                 : sr_round_unscaled<ElemType::e2m1>(v, 0, rnd[i]);
        if constexpr (QDQ) {
          const float a = mul_rn(rm, sval);
          const u32 o = nv.fast ? nv_out<true, ODT>(a, xb[i] >> 31, nv) : nv_out<false, ODT>(a, xb[i] >> 31, nv);
          out[i] = hi16<ODT>(o);
        } else {
          codes[i] = e2m1_code_of_grid(rm) | ((xb[i] >> 31) << 3);  // NaN/Inf blocks: zeroed by store_quantized
          // the reference's |x * m| < 6 (the raw product: a zero under an infinite m is not kept)
          if (p.mask) keep |= u32(!nonfinite && fabs_bits(mul_rn(u2f(xb[i]), m)) < 6.0f) << i;
        }
      }
    };
    if (p.sr_bits <= 16) round_sr(std::true_type{});
    else round_sr(std::false_type{});
  } else if constexpr (QDQ) {
    // The rounded magnitude is the E2M1 value itself: no code round trip. (E2M1 value * s) / S with
    // the product exact and the quotient correctly rounded (recip_div in the usual S range).
    auto qdq_rne = [&](auto fast) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const float rm = rne_mag<ElemType::e2m1>(nvfp4_product(xb[i], m), 1.0f);
        const u32 o = nv_out<decltype(fast)::value, ODT>(mul_rn(rm, sval), xb[i] >> 31, nv);
        out[i] = hi16<ODT>(o);
      }
    };
    if (nv.fast) qdq_rne(std::true_type{});
    else qdq_rne(std::false_type{});
  } else {
#pragma unroll
    for (int i = 0; i < C; ++i) {
      // NaN/Inf blocks: codes zeroed by store_quantized
      codes[i] = nvfp4_encode_rne_readoff(xb[i], m);
      if (p.mask) keep |= u32(!nonfinite && fabs_bits(mul_rn(u2f(xb[i]), m)) < 6.0f) << i;
    }
  }
  if constexpr (QDQ) {
    if (c.active) store_chunk<ODT, C>(p, c.row, c.k0, c.full, out, nonfinite);
  } else {
    u32 cw[code_words<Fmt, C>()];
    pack_codes<Fmt, C>(codes, cw);
    store_quantized<Fmt, C>(p, c, nonfinite, sb, cw, keep);
  }
}

}  // namespace mxq::cuda
