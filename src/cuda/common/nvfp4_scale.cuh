#pragma once
// The NVFP4 tensor encode scale S of a launch and the divisions by it, shared by the NVFP4 quantize,
// QDQ and dequantize kernels.
#include "core/fastmath.hpp"
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// S (given, or from the tensor amax the amax kernel left), 1 / S and whether recip_div may stand in for
// the division by S.
struct NvScale {
  float S = 1.0f, r = 1.0f;
  bool fast = true;
};
__device__ __forceinline__ NvScale nv_scale_given(float S) {
  NvScale n;
  n.S = S;
  n.r = div_rn(1.0f, n.S);
  n.fast = recip_div_ok(n.S);
  return n;
}
// From the tensor amax (fp32 bits).
__device__ __forceinline__ NvScale nv_scale_of(u32 amax) { return nv_scale_given(nvfp4_encode_scale(u2f(amax))); }
__device__ __forceinline__ NvScale nv_scale(const Params& p) {
  // NOTE: __ldcg (L2, not L1): the amax may have been completed by other blocks' atomics.
  return p.amax ? nv_scale_of(__ldcg(p.amax)) : nv_scale_given(p.S);
}
// a / S for a = |E2M1 value| * E4M3 block scale (a >= 0).
template <bool FAST>
__device__ __forceinline__ float div_S(float a, const NvScale& nv) {
  if constexpr (FAST) return recip_div(a, nv.S, nv.r);
  else return div_rn(a, nv.S);
}

// Output bits of the NVFP4 value sign * (a / S). Only the division path can overflow (S below
// recip_div's range): that infinity stays an infinity, as in the reference (to_dtype_bits_nonnan).
template <bool FAST, DType DT>
__device__ __forceinline__ u32 nv_out(float a, u32 sign, const NvScale& nv) {
  const float v = div_S<FAST>(a, nv);
  if constexpr (FAST) return out_mag_bits<DT>(v) | (sign << (DT == DType::f32 ? 31 : 15));
  else return to_dtype_bits_nonnan<DT>(u2f(f2u(v) | (sign << 31)));
}

// 16-bit (bf16, fp16) outputs of the eight NVFP4 magnitude codes under the block scale sval, two per
// word (code 2j in the low half of t[j]): the lookup table of fp4_bf16_lookup. bf16 in recip_div's
// range: two divisions (nvfp4_bf16_table); otherwise one nv_out per magnitude.
template <DType DT>
__device__ __forceinline__ void nv_table(float sval, const NvScale& nv, u32 (&t)[4]) {
  static_assert(DT != DType::f32, "16-bit outputs only");
  if (DT == DType::bf16 && nv.fast) {
    nvfp4_bf16_table(sval, nv.S, nv.r, t);
    return;
  }
  u32 e[8];
  auto table = [&](auto fast) {
#pragma unroll
    for (int m = 0; m < 8; ++m) e[m] = nv_out<decltype(fast)::value, DT>(mul_rn(e2m1_value(u32(m)), sval), 0u, nv);
  };
  if (nv.fast) table(std::true_type{});
  else table(std::false_type{});
#pragma unroll
  for (int j = 0; j < 4; ++j) t[j] = e[2 * j] | (e[2 * j + 1] << 16);
}

}  // namespace mxq::cuda
