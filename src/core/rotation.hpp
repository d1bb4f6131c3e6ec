#pragma once
// Rotation before quantization (docs/numerics.md, "Rotation"): each contiguous group of RS elements of
// a row is replaced by y = x_group @ R with R = D H / sqrt(RS) (H the Sylvester Hadamard matrix,
// H[i][j] = (-1)^popcount(i & j); D = I, or random signs from a seed). Computed as a Walsh-Hadamard
// butterfly in fp32 in one fixed order (stages h = 1, 2, 4, ..., RS/2; within a stage pairs (j, j + h)
// in increasing j; a + b and a - b each rounded once), then one multiplication by the fp32 normalizer:
// every backend performs these operations in this order.
#include <cstdint>

#include <mxq/types.hpp>

#include "core/codec.hpp"

namespace mxq::core {

constexpr bool valid_rotation_size(int rs) { return rs >= 16 && rs <= 256 && (rs & (rs - 1)) == 0; }

// 1 / sqrt(RS) rounded to fp32 (exact for 16, 64, 256).
MXQ_HD float hadamard_normalizer(int rs) {
  switch (rs) {
    case 16: return 0.25f;
    case 32: return u2f(0x3E3504F3u);   // RN32(1/sqrt(32)) = 0.17677669...
    case 64: return 0.125f;
    case 128: return u2f(0x3DB504F3u);  // RN32(1/sqrt(128)) = 0.08838834...
    default: return 0.0625f;            // 256
  }
}

// The signs of the randomised Hadamard transform: sign i (0 <= i < 256) is bit i of the 256-bit string
// made of Philox4x32-10 blocks 0 and 1 under key `seed` (word w = i / 32 is block w / 4, lane w % 4);
// set means -1. The same signs for every group of every row: drawn once per operation.
struct RotationSigns {
  std::uint32_t w[8];
  MXQ_HD bool negative(int i) const { return (w[i / 32] >> (i % 32)) & 1u; }
};
MXQ_HD RotationSigns rotation_signs(std::uint64_t seed) {
  RotationSigns s{};
  for (int b = 0; b < 2; ++b) {
    const U32x4 r = philox_block(seed, std::uint64_t(b));
    for (int k = 0; k < 4; ++k) s.w[4 * b + k] = r.v[k];
  }
  return s;
}

// The butterfly in place: v <- H v (H symmetric: x @ H), unnormalised.
MXQ_HD void hadamard_butterfly(float* v, int rs) {
  for (int h = 1; h < rs; h <<= 1)
    for (int i = 0; i < rs; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = add_rn(a, b);
        v[j + h] = sub_rn(a, b);
      }
}

// y = x @ R (forward) or x = y @ R^-1 = butterfly(y) * norm, then the signs (inverse), in place.
// `signs` is read only for Rotation::random_hadamard.
MXQ_HD void rotate_group(float* v, int rs, Rotation kind, const RotationSigns& signs, bool inverse) {
  const bool random = kind == Rotation::random_hadamard;
  if (random && !inverse)
    for (int i = 0; i < rs; ++i)
      if (signs.negative(i)) v[i] = -v[i];
  hadamard_butterfly(v, rs);
  const float n = hadamard_normalizer(rs);
  for (int i = 0; i < rs; ++i) v[i] = mul_rn(v[i], n);
  if (random && inverse)
    for (int i = 0; i < rs; ++i)
      if (signs.negative(i)) v[i] = -v[i];
}

}  // namespace mxq::core
