#pragma once
// MXFP4 (E2M1) codes of fp32 values, rounded to nearest even and packed eight to a word in one step
// per element: the quantize fast path for a scale 2^e of MxFastRange<e2m1> (e in [-125, 102]), every
// finite x (above the largest value it saturates, so the rules whose x can exceed 2^(e+3), quest and
// QuTLASS's abs_max, are covered too). fastmath_test proves the packed codes equal to the codec's
// encode_scaled.
//
// The step is the read-off rounding of fastmath.hpp with the code kept in the rounded value's low
// bits: with E the exponent bits of a = min(|x|, 6 2^e) clamped below at e's binade (E_lo), the sum
//   t = a + C,  C = 2^(E + 22) (1 + (c + 2E) 2^-23),  c = -2 E_lo mod 16
// rounds a to nearest even in quanta of a's E2M1 binade (2^(E-128); c + 2E is even, so a tie goes
// to an even count n, as with the plain constant), and t's low mantissa bits hold c + 2E + n, whose
// low nibble is 2 (E - E_lo) + n mod 16: the magnitude code (at most 7). C is built from the
// exponent bits by one shift-add and scaled by 2^22 inside the fma (exact: a power of two).
#include <cstdint>

#include "core/codec.hpp"
#include "core/fastmath.hpp"

namespace mxq::core {

struct E2m1Pack {
  std::uint32_t c;    // -2 E_lo mod 16
  std::uint32_t lo2;  // E_lo's exponent bits | c: the binade floor with c in its low bits
  float maxv;         // 6 * 2^e, the largest value
};

MXQ_HD_HOT E2m1Pack e2m1_pack_consts(int e) {
  const std::uint32_t elo = std::uint32_t(e + 127);
  const std::uint32_t c = (0u - 2u * elo) & 15u;
  return {c, (elo << 23) | c, mul_rn(6.0f, u2f(elo << 23))};
}

// w with x's code pushed on top: w shifted down a nibble, the code (t's low nibble, x's sign as its
// bit 3) in bits 28..31. Eight pushes from any w leave the eight codes in order, the first lowest.
MXQ_HD_HOT std::uint32_t e2m1_push(std::uint32_t w, std::uint32_t x, const E2m1Pack& k) {
  const float a = fminf_nn(fabs_op(u2f(x)), k.maxv);
  const std::uint32_t ym = umax((f2u(a) & 0x7F800000u) | k.c, k.lo2);
  const std::uint32_t cq = ym + (ym >> 22);
  const std::uint32_t t = f2u(fma_rn(u2f(cq), 4194304.0f, a));  // 2^22
#if defined(__CUDA_ARCH__)
  return (x & 0x80000000u) + __funnelshift_l(w, t, 28);
#else
  return (x & 0x80000000u) + ((t << 28) | (w >> 4));
#endif
}

}  // namespace mxq::core
