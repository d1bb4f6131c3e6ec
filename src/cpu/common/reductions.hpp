#pragma once
// Reductions over a block: the amax of a staged block, and the quest rule's statistic (core::quest_arg)
// of one block or of eight blocks in vector lanes (AVX2, AVX-512F), in pairwise_sum's fixed order.
#include "cpu/common/vector_io.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// Max of |x| as bits: >= 0x7F800000 means the block holds a NaN or Inf.
template <int G = 0>
MXQ_INLINE std::uint32_t amax_bits(const float* xf, int g_rt) {
  const int g = G ? G : g_rt;
  std::uint32_t m = 0;
  for (int i = 0; i < g; ++i) m = std::max(m, f2u(xf[i]) & 0x7FFFFFFFu);
  return m;
}

// The quest rule's argument (core::quest_arg) of one full block of G elements straight from bf16/fp32
// storage (the values exact in fp32): the same operations in the same order.
template <DType DT, int G>
MXQ_INLINE float quest_arg_direct(const Storage<DT>* s) {
  alignas(64) float v[G];
  for (int i = 0; i < G; ++i) v[i] = u2f(DT == DType::f32 ? std::uint32_t(s[i]) : std::uint32_t(s[i]) << 16);
  return quest_arg<G>(v);
}

#if defined(MXQ_CPU_AVX2)
// The eight vectors' 8 x 8 transpose (element i of vector j to element j of vector i).
MXQ_INLINE __attribute__((target("avx2"))) void transpose8_avx2(__m256 (&r)[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
    r[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
  }
}
// b[0..N) -> their sum in core::pairwise_sum's order, S(b, N) = S(b, N/2) + S(b + N/2, N/2), written as
// a recursion with constant indices: a loop over the levels (whose inner bound depends on the outer
// variable) kept the vectors in memory, a store and a load per addition (measured 2.5x slower).
template <int N>
MXQ_INLINE __attribute__((target("avx2"))) __m256 pairwise_avx2(const __m256* b) {
  if constexpr (N == 1)
    return b[0];
  else
    return _mm256_add_ps(pairwise_avx2<N / 2>(b), pairwise_avx2<N / 2>(b + N / 2));
}
// The quest statistic from the sum of squared deviations ss, per lane: sigma = sqrt(ss / g), then
// sigma * 2.92247856 / 6 + 1e-8, each operation rounded on its own (core::quest_arg); both SIMD forms'.
MXQ_INLINE __attribute__((target("avx2"))) __m256 quest_of_squares_avx2(__m256 ss, __m256 g) {
  const __m256 sigma = _mm256_sqrt_ps(_mm256_div_ps(ss, g));
  return _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(sigma, _mm256_set1_ps(2.92247856f)), _mm256_set1_ps(6.0f)), _mm256_set1_ps(1e-8f));
}
// quest_arg (core::quest_arg) of eight full blocks of G (16 or 32) elements of bf16/fp32 storage, one
// vector lane per block: the values transposed so that vector i holds element i of every block, then the
// same operations in the same order (pairwise_sum's tree, IEEE division and square root).
template <DType DT, int G = 32>
__attribute__((target("avx2"))) inline __m256 quest_args8_avx2_form(const Storage<DT>* s) {
  static_assert(G == 16 || G == 32);
  __m256 v[G];
#pragma GCC unroll 4
  for (int c = 0; c < G / 8; ++c) {  // elements 8c .. 8c + 7 of the eight blocks
    __m256 r[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const Storage<DT>* p = s + G * j + 8 * c;
      r[j] = _mm256_castsi256_ps(load8_bits_avx2<DT>(p));
    }
    transpose8_avx2(r);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) v[8 * c + i] = r[i];
  }
  const __m256 g = _mm256_set1_ps(float(G));
  const __m256 mean = _mm256_div_ps(pairwise_avx2<G>(v), g);
  __m256 t[G];
#pragma GCC unroll 32
  for (int i = 0; i < G; ++i) {
    const __m256 d = _mm256_sub_ps(v[i], mean);
    t[i] = _mm256_mul_ps(d, d);
  }
  return quest_of_squares_avx2(pairwise_avx2<G>(t), g);
}

// NOTE: GCC 12's avx512fintrin.h warns (maybe-)uninitialized inside some intrinsics: silenced here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// The same eight statistics with AVX-512F: each register holds two elements of every block, element i
// in its low half and element i + 8 (G = 16: of the block; G = 32: of each 16-element half) in its high
// half, so that the first level of pairwise_sum's tree below the top is the halves' addition and every
// level under it runs on sixteen lanes at once; the transposes are 8 x 8 in both halves at once. The same
// IEEE operations on the same operands in the same tree, so the same bits (fastmath_test FastQuest).
template <int N>
MXQ_INLINE __attribute__((target("avx512f"))) __m512 pairwise_avx512(const __m512* b) {
  if constexpr (N == 1)
    return b[0];
  else
    return _mm512_add_ps(pairwise_avx512<N / 2>(b), pairwise_avx512<N / 2>(b + N / 2));
}
// transpose8_avx2 in each 256-bit half of eight registers at once.
MXQ_INLINE __attribute__((target("avx512f"))) void transpose8x2_avx512(__m512 (&r)[8]) {
  __m512 t[8], u[8];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  // permute2f128's 0x20 and 0x31 per half: 128-bit lanes (x0, y0 | x2, y2) and (x1, y1 | x3, y3)
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_permutex2var_ps(u[k], lo, u[k + 4]);
    r[k + 4] = _mm512_permutex2var_ps(u[k], hi, u[k + 4]);
  }
}
// The sum of H parts' values in pairwise_sum's order: each part's halves' sums, then the parts in order.
MXQ_INLINE __attribute__((target("avx512f"))) __m256 halves_sum_avx512(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
template <int H>
MXQ_INLINE __attribute__((target("avx512f"))) __m256 quest_sum_avx512(const __m512 (&w)[H][8]) {
  const __m256 a = halves_sum_avx512(pairwise_avx512<8>(w[0]));
  if constexpr (H == 1)
    return a;
  else
    return _mm256_add_ps(a, halves_sum_avx512(pairwise_avx512<8>(w[1])));
}
template <DType DT, int G = 32>
__attribute__((target("avx512f"))) inline __m256 quest_args8_avx512(const Storage<DT>* s) {
  static_assert(G == 16 || G == 32);
  constexpr int H = G / 16;  // 16-element parts per block
  __m512 v[H][8];             // part h: register i holds elements 16 h + i (low) and 16 h + 8 + i (high)
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const Storage<DT>* p = s + G * j + 16 * h;
      v[h][j] = _mm512_castsi512_ps(load16_bits_avx512<DT>(p));
    }
    transpose8x2_avx512(v[h]);
  }
  const __m256 g = _mm256_set1_ps(float(G));
  const __m256 mean = _mm256_div_ps(quest_sum_avx512<H>(v), g);
  const __m512 mz = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(mean)), _mm256_castps_pd(mean), 1));
  __m512 t[H][8];
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512 d = _mm512_sub_ps(v[h][i], mz);
      t[h][i] = _mm512_mul_ps(d, d);
    }
  return quest_of_squares_avx2(quest_sum_avx512<H>(t), g);
}
template <DType DT, int G = 32>
__attribute__((target("avx512f"))) inline void quest_args8_avx512(const Storage<DT>* s, float* qa) {
  _mm256_storeu_ps(qa, quest_args8_avx512<DT, G>(s));
}
#pragma GCC diagnostic pop
template <DType DT, int G = 32>
__attribute__((target("avx2"))) inline void quest_args8_avx2_form(const Storage<DT>* s, float* qa) {
  _mm256_storeu_ps(qa, quest_args8_avx2_form<DT, G>(s));
}

// quest_args8 in the widest form the CPU has (AVX-512F, else AVX2; the same bits).
template <DType DT, int G = 32>
__attribute__((target("avx2"))) inline __m256 quest_args8_avx2(const Storage<DT>* s) {
  if (cpu_has_avx512()) return quest_args8_avx512<DT, G>(s);
  return quest_args8_avx2_form<DT, G>(s);
}
template <DType DT, int G = 32>
__attribute__((target("avx2"))) inline void quest_args8_avx2(const Storage<DT>* s, float* qa) {
  _mm256_storeu_ps(qa, quest_args8_avx2<DT, G>(s));
}
#endif

}  // namespace
}  // namespace mxq::cpu
