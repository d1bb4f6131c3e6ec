#pragma once
// The rotation before quantization on the GPU (docs/numerics.md, "Rotation before quantization"): the
// butterfly of core/rotation.hpp on a chunk of C elements per thread, the stages h < C in registers and
// the stages h = C, 2C, ..., RS/2 across the RS/C adjacent lanes that hold one rotation group, by xor
// shuffles. Stage by stage the same additions and subtractions as core::hadamard_butterfly (each pair
// (j, j + h) gives a + b at j and a - b at j + h, a the value at j), so the results are the same bits.
//
// Requirements the launchers guarantee: RS/C lanes (at most 32) hold a rotation group, adjacent and
// aligned in the warp (chunk i sits in lane i mod 32, K is a multiple of RS, a row holds a multiple of
// RS/C chunks); every lane of the warp calls rotate_chunk (shuffles over the full warp).
#include "core/fastmath.hpp"
#include "core/rotation.hpp"
#include "cuda/common/params.cuh"

namespace mxq::cuda {

// Fills the rotation fields of the kernel parameters from the problem's options.
inline void set_rotation(Params& k, const QuantOptions& o) {
  k.rot_size = o.rotation == Rotation::none ? 0 : o.rotation_size;
  if (k.rot_size == 0) return;
  k.rot_norm = core::hadamard_normalizer(k.rot_size);
  if (o.rotation == Rotation::random_hadamard) {
    const core::RotationSigns s = core::rotation_signs(o.rotation_seed);
    for (int w = 0; w < 8; ++w) k.rot_signs[w] = s.w[w];
  }
}

// The sign bits of the calling lane's C elements (element e at bit e; 0 without random signs). A lane
// keeps its place in its rotation group for the whole launch (strides are multiples of 32 lanes).
template <int C>
__device__ __forceinline__ u32 rotation_lane_signs(const Params& p) {
  const int lanes = p.rot_size / C;
  const int pos = int(threadIdx.x & 31u) % lanes * C;  // first element of this lane in its group
  u32 w = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) w = j == pos / 32 ? p.rot_signs[j] : w;  // no dynamic index into the parameters
  return C == 32 ? w : (w >> (pos % 32)) & ((1u << C) - 1u);
}

// The butterfly stages h = H, 2H, ..., C/2 inside one lane's C values. Every index is a constant: a
// loop whose bounds depend on an outer loop's variable is not always unrolled, and a runtime index into
// v would put the array in local memory (measured on the H200: 5x slower).
template <int C, int H>
__device__ __forceinline__ void butterfly_lane(float (&v)[C]) {
  if constexpr (H < C) {
#pragma unroll
    for (int k = 0; k < C / 2; ++k) {
      const int j = (k / H) * 2 * H + k % H;  // pair k of the stage: (j, j + H)
      const float a = v[j], b = v[j + H];
      v[j] = add_rn(a, b);
      v[j + H] = sub_rn(a, b);
    }
    butterfly_lane<C, 2 * H>(v);
  }
}

// x (fp32 bits, C elements of one lane) <- its rotation: forward R = D H / sqrt(RS), or (inverse) the
// butterfly, the normalizer, then the signs.
template <int C, bool INVERSE>
__device__ __forceinline__ void rotate_chunk(const Params& p, u32 signs, u32 (&x)[C]) {
  if constexpr (!INVERSE) {
#pragma unroll
    for (int e = 0; e < C; ++e) x[e] ^= ((signs >> e) & 1u) << 31;
  }
  float v[C];
#pragma unroll
  for (int e = 0; e < C; ++e) v[e] = u2f(x[e]);
  butterfly_lane<C, 1>(v);
  const int lanes = p.rot_size / C;
  const u32 lane = threadIdx.x & 31u;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    if (m < lanes) {  // uniform over the warp
      // This lane holds the j + h side of its pairs where bit m of the lane is set: there w - v, else
      // v + w, both as fma(sgn, v, w) = RN(sgn v + w) with sgn = -1 or +1 (the product exact, one
      // rounding, signed zeros as in the subtraction and the addition): one instruction per element
      // instead of an addition, a subtraction and a select.
      const float sgn = (lane & u32(m)) != 0 ? -1.0f : 1.0f;
#pragma unroll
      for (int e = 0; e < C; ++e) v[e] = __fmaf_rn(sgn, v[e], __shfl_xor_sync(kFull, v[e], m));
    }
  }
#pragma unroll
  for (int e = 0; e < C; ++e) x[e] = f2u(mul_rn(v[e], p.rot_norm));
  if constexpr (INVERSE) {
#pragma unroll
    for (int e = 0; e < C; ++e) x[e] ^= ((signs >> e) & 1u) << 31;
  }
}

}  // namespace mxq::cuda
