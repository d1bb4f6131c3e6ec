#pragma once
// E2M1 values from codes: one magnitude's value by a select, and an NVFP4 block's sixteen outputs by
// AVX2's lane permute over its eight possible ones (QDQ and dequantize).
#include "cpu/common/elements.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// e2m1_value (fastmath.hpp) with a select.
MXQ_INLINE float e2m1_value_bf(std::uint32_t mag) {
  return u2f(bsel(mag < 2, mag ? 0x3F000000u : 0u, (((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22)));
}

#if defined(MXQ_CPU_AVX2)
// The sixteen outputs of one NVFP4 block stored to y (DT storage): element i's is t[code & 7] (t the
// block's eight output bits in DT, one per magnitude; vpermd reads each index's low three bits) with
// the code's sign bit an XOR of DT's (RN is symmetric: a negative code's result is the positive one's
// with the sign flipped, zeros and infinities too); NaN everywhere when the block is not finite.
// lo, hi: the codes of elements 0..7 and 8..15, one per 32-bit lane.
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_store16_avx2(__m256i t, __m256i lo, __m256i hi, bool finite, Storage<DT>* y) {
  constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
  const __m256i one = _mm256_set1_epi32(1);
  __m256i a = _mm256_xor_si256(_mm256_permutevar8x32_epi32(t, lo),
                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(lo, 3), one), kSignBit));
  __m256i b = _mm256_xor_si256(_mm256_permutevar8x32_epi32(t, hi),
                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 3), one), kSignBit));
  if (!finite) a = b = _mm256_set1_epi32(int(nan_bits(DT)));
  if constexpr (DT == DType::f32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 8), b);
  } else {  // 16-bit outputs: pack (per 128-bit half), then the quarters back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
}
#endif

}  // namespace
}  // namespace mxq::cpu
