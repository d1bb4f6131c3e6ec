#pragma once
// Stochastic rounding's comparison words: Philox4x32-10 over counters (AVX-512F, AVX2 or portable; the
// same bits), the fields of a window of elements, and a row's words a window at a time (SrWindow).
#include "cpu/common/tiles.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// Philox4x32-10's constants (core::philox4x32_10): multipliers and key increments.
constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u, kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

#if defined(MXQ_CPU_AVX2)
// Philox4x32-10 (core::philox4x32_10) of counters c0 + c, c = 0, 8, 16, ... below nc rounded down to
// eight, key (ks0, ks1), eight counters in the lanes of AVX2 registers: each 32 x 32 -> 64-bit product
// from two vpmuludq (even and odd lanes), its high and low halves blended back into lane order. Counter
// c's four output words to stream[4 c .. 4 c + 3] (the outputs laid end to end: a 4 x 8 transpose in
// registers, whole 32-byte stores that the readers' loads forward from); returns the counters done.
__attribute__((target("avx2"))) inline int philox8_avx2(std::uint64_t c0, int nc, std::uint32_t ks0, std::uint32_t ks1,
                                                        std::uint32_t* stream) {
  const __m256i vM0 = _mm256_set1_epi64x(kPhiloxM0), vM1 = _mm256_set1_epi64x(kPhiloxM1), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
  auto mulhilo = [](__m256i x, __m256i m, __m256i& hi, __m256i& lo) __attribute__((target("avx2"))) {
    const __m256i ev = _mm256_mul_epu32(x, m), od = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(ev, 32), od, 0xAA);
    lo = _mm256_blend_epi32(ev, _mm256_slli_epi64(od, 32), 0xAA);
  };
  int c = 0;
  for (; c + 8 <= nc; c += 8) {
    const std::uint64_t base = c0 + std::uint64_t(c);
    const std::uint32_t blo = std::uint32_t(base), bhi = std::uint32_t(base >> 32);
    __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(int(blo)), idx);
    // the 64-bit counter's high word: one more in the lanes whose low word wrapped
    const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(int(blo)), sign), _mm256_xor_si256(x0, sign));
    __m256i x1 = _mm256_sub_epi32(_mm256_set1_epi32(int(bhi)), wrapped), x2 = _mm256_setzero_si256(), x3 = _mm256_setzero_si256();
    std::uint32_t k0 = ks0, k1 = ks1;
    for (int r = 0; r < 10; ++r) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo(x0, vM0, hi0, lo0);
      mulhilo(x2, vM1, hi1, lo1);
      const __m256i y0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32(int(k0)));
      const __m256i y2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32(int(k1)));
      x1 = lo1;
      x3 = lo0;
      x0 = y0;
      x2 = y2;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    // transpose: t* pair words of x0/x1 and x2/x3, u* gather counter k and k + 4 (128-bit halves)
    const __m256i t0 = _mm256_unpacklo_epi32(x0, x1), t1 = _mm256_unpackhi_epi32(x0, x1);
    const __m256i t2 = _mm256_unpacklo_epi32(x2, x3), t3 = _mm256_unpackhi_epi32(x2, x3);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* out = reinterpret_cast<__m256i*>(stream + 4 * c);
    _mm256_storeu_si256(out, _mm256_permute2x128_si256(u0, u1, 0x20));      // counters 0, 1
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u2, u3, 0x20));  // 2, 3
    _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u0, u1, 0x31));  // 4, 5
    _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u2, u3, 0x31));  // 6, 7
  }
  return c;
}

// philox8_avx2's counters and outputs with AVX-512F, eight counters per register in 64-bit lanes: one
// vpmuludq gives a whole 32 x 32 -> 64-bit product (no even/odd split, no blends), its high half
// moved down by a dword shuffle (vpshufd on the shuffle port, where a shift would share the
// multiplier's); the other halves carry garbage (the low product, XORs), which vpmuludq never reads
// and the stores drop. NG groups of eight counters go through the rounds side by side: a round is a
// chain of a multiply, a shuffle and an XOR, and one group alone leaves the ports idle while it waits
// (measured on a Xeon, 1M counters: 2.4 ns per counter with one group, 1.5 with two).
// NOTE: GCC 12's avx512fintrin.h seeds some intrinsics with an "undefined" register and -Wall then
// warns maybe-uninitialized inside the header: silenced for these functions only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int NG>
__attribute__((target("avx512f"))) MXQ_INLINE void philox_groups_avx512(std::uint64_t c0, std::uint32_t ks0, std::uint32_t ks1,
                                                                        std::uint32_t* stream) {
  const __m512i vM0 = _mm512_set1_epi64(kPhiloxM0), vM1 = _mm512_set1_epi64(kPhiloxM1);
  __m512i x0[NG], x1[NG], x2[NG], x3[NG];
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g) {
    const __m512i ctr =
        _mm512_add_epi64(_mm512_set1_epi64(std::int64_t(c0 + std::uint64_t(8 * g))), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
    x0[g] = ctr;
    x1[g] = _mm512_srli_epi64(ctr, 32);
    x2[g] = x3[g] = _mm512_setzero_si512();
  }
  std::uint32_t k0 = ks0, k1 = ks1;
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const __m512i K0 = _mm512_set1_epi64(k0), K1 = _mm512_set1_epi64(k1);
#pragma GCC unroll 2
    for (int g = 0; g < NG; ++g) {
      const __m512i p0 = _mm512_mul_epu32(x0[g], vM0), p1 = _mm512_mul_epu32(x2[g], vM1);
      const __m512i y0 = _mm512_ternarylogic_epi64(_mm512_shuffle_epi32(p1, _MM_PERM_CDAB), x1[g], K0, 0x96);
      const __m512i y2 = _mm512_ternarylogic_epi64(_mm512_shuffle_epi32(p0, _MM_PERM_CDAB), x3[g], K1, 0x96);
      x1[g] = p1;
      x3[g] = p0;
      x0[g] = y0;
      x2[g] = y2;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  // counter k's words (w0, w1) and (w2, w3) as the two halves of 64-bit lanes a and b, then the lanes
  // interleaved a0 b0 a1 b1 ...: the stream, two 64-byte stores per group
  __m512i* out = reinterpret_cast<__m512i*>(stream);
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g) {
    const __m512i a = _mm512_mask_blend_epi32(0xAAAA, x0[g], _mm512_slli_epi64(x1[g], 32));
    const __m512i b = _mm512_mask_blend_epi32(0xAAAA, x2[g], _mm512_slli_epi64(x3[g], 32));
    _mm512_storeu_si512(out + 2 * g, _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), b));
    _mm512_storeu_si512(out + 2 * g + 1, _mm512_permutex2var_epi64(a, _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), b));
  }
}
// Counters c0 + c for c below nc rounded down to eight: sixteen at a time, then eight; returns the
// counters done.
__attribute__((target("avx512f"))) inline int philox8_avx512(std::uint64_t c0, int nc, std::uint32_t ks0, std::uint32_t ks1,
                                                          std::uint32_t* stream) {
  int c = 0;
  for (; c + 16 <= nc; c += 16) philox_groups_avx512<2>(c0 + std::uint64_t(c), ks0, ks1, stream + 4 * c);
  if (c + 8 <= nc) {
    philox_groups_avx512<1>(c0 + std::uint64_t(c), ks0, ks1, stream + 4 * c);
    c += 8;
  }
  return c;
}
#pragma GCC diagnostic pop
#endif

// rnd[i] = sr_bits(seed, j0 + i, B) for i < n (n <= 256), with one Philox call per counter instead of
// one per element: 128 / B consecutive elements share a call (codec.hpp's sr_bits). Philox4x32-10 is
// written out over an array of counters (philox4x32_10's rounds) so that the compiler can vectorise it;
// element j's field is bits [(j % (128 / B)) B, + B) of its counter's 128 bits, i.e. bit offset
// (j - first counter's first element) B of the calls' outputs laid end to end.
// (sr_words_span: indices j0 .. j0 + n - 1 that do not wrap past 2^64; sr_words_b splits those that do.)
template <int B>
MXQ_INLINE void sr_words_span(std::uint64_t seed, std::uint64_t j0, int n, std::uint32_t* rnd) {
  constexpr int lp = B == 8 ? 4 : (B == 16 ? 3 : 2);
  const std::uint64_t c0 = j0 >> lp;
  const int nc = int(((j0 + std::uint64_t(n) - 1) >> lp) - c0) + 1;  // <= 256 / 4 + 1
  // The calls' outputs laid end to end (word-major, least significant field first) are the fields in
  // element order: field i of the stream is the B bits at bit offset i B, i.e. (little-endian) the
  // i-th 8-, 16- or 32-bit unit.
  alignas(64) std::uint32_t stream[4 * 72];
  const std::uint32_t ks0 = std::uint32_t(seed), ks1 = std::uint32_t(seed >> 32);
  int c = 0;
#if defined(MXQ_CPU_AVX2)
  if (cpu_has_avx512()) c = philox8_avx512(c0, nc, ks0, ks1, stream);  // whole groups of eight counters
  else if (cpu_has_avx2()) c = philox8_avx2(c0, nc, ks0, ks1, stream);
#endif
  for (; c < nc; ++c) {
    const std::uint64_t cc = c0 + std::uint64_t(c);
    std::uint32_t x0 = std::uint32_t(cc), x1 = std::uint32_t(cc >> 32), x2 = 0, x3 = 0, k0 = ks0, k1 = ks1;
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
      const std::uint64_t p0 = std::uint64_t(kPhiloxM0) * x0, p1 = std::uint64_t(kPhiloxM1) * x2;
      const std::uint32_t y0 = std::uint32_t(p1 >> 32) ^ x1 ^ k0, y2 = std::uint32_t(p0 >> 32) ^ x3 ^ k1;
      x1 = std::uint32_t(p1);
      x3 = std::uint32_t(p0);
      x0 = y0;
      x2 = y2;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    stream[4 * c] = x0;
    stream[4 * c + 1] = x1;
    stream[4 * c + 2] = x2;
    stream[4 * c + 3] = x3;
  }
  // the block's window of the stream as comparison words (sr_word)
  const std::size_t off = std::size_t(j0 - (c0 << lp));
  static_assert(std::endian::native == std::endian::little, "the field stream is read as little-endian units");
  if constexpr (B == 32) {
    std::memcpy(rnd, stream + off, std::size_t(n) * 4);
  } else {
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(stream) + off * (B / 8);
    for (int i = 0; i < n; ++i) {
      std::uint32_t u;
      if constexpr (B == 16) {
        std::uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        u = h;
      } else {
        u = bytes[i];
      }
      rnd[i] = (u << (32 - B)) | ((1u << (32 - B)) - 1u);
    }
  }
}
template <int B>
MXQ_INLINE void sr_words_b(std::uint64_t seed, std::uint64_t j0, int n, std::uint32_t* rnd) {
  if (j0 + std::uint64_t(n) - 1 >= j0) return sr_words_span<B>(seed, j0, n, rnd);
  // the element index (taken mod 2^64) wraps inside the window: the words after it restart at counter 0
  const int n1 = int(std::uint64_t(0) - j0);
  sr_words_span<B>(seed, j0, n1, rnd);
  sr_words_span<B>(seed, 0, n - n1, rnd + n1);
}
MXQ_INLINE void sr_words(std::uint64_t seed, std::uint64_t j0, int n, int B, std::uint32_t* rnd) {
  if (B == 8) sr_words_b<8>(seed, j0, n, rnd);
  else if (B == 16) sr_words_b<16>(seed, j0, n, rnd);
  else sr_words_b<32>(seed, j0, n, rnd);
}

// The comparison words of one row's blocks for a tile, generated 256 elements at a time (whole groups
// of eight Philox counters for every field width) instead of one block's at a time (a block of 32
// elements at 8 or 16 bits is two or four counters: the scalar form). The same words as
// sr_words(seed, offset + r K + k0, g, B) for each block.
class SrWindow {
 public:
  SrWindow(const Problem& p, std::int64_t r)
      : seed_(p.opt.seed), base_(p.opt.offset + std::uint64_t(r * p.K)), K_(p.K), bits_(p.sr_bits) {}
  // The words of the row's elements k0 .. k0 + g - 1 (g <= 256; a last partial block's words past K
  // included, as sr_words gives them). A window ends at the row's end where the blocks allow.
  const std::uint32_t* at(std::int64_t k0, int g) {
    if (k0_ < 0 || k0 < k0_ || k0 + g > k0_ + len_) {
      k0_ = k0;
      len_ = int(std::max<std::int64_t>(g, std::min<std::int64_t>(256, K_ - k0)));
      sr_words(seed_, base_ + std::uint64_t(k0), len_, bits_, w_);
    }
    return w_ + (k0 - k0_);
  }

 private:
  alignas(64) std::uint32_t w_[256];
  std::uint64_t seed_, base_;
  std::int64_t K_;
  int bits_, len_ = 0;
  std::int64_t k0_ = -1;
};

}  // namespace
}  // namespace mxq::cpu
