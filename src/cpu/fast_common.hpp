#pragma once
// Shared by the fast CPU path's operations (src/cpu/{quantize,qdq,dequantize,layout}.cpp): tiling
// over OpenMP threads, block loads and stores, the per-element helpers of every format.
//
// Work is split into tiles of (one row, up to kTileBlocks blocks) and spread over OpenMP threads;
// every tile is independent, so results do not depend on the thread count. Inside a block the MX
// round-to-nearest-even path is branch-free fp32/int32 code that the compiler vectorises (an AVX2
// clone is selected at run time where the CPU has it):
//   a = |x| * 2^-e                       exact, or an underflow far below the element grid
//   r = (a + C) - C, C = 1.5 * 2^(q+23)  RNE onto the grid of quantum 2^q (q from a's binade)
//   r = min(r, max_elem)                 saturation
// The same per-element arithmetic serves quantize (codes read off the rounding's bits: readoff_mag),
// NVFP4 (nvfp4_encode_rne_readoff, the division by S one IEEE division per element) and stochastic
// rounding (MX in MxFastRange and NVFP4: sr_code_unscaled, in integer arithmetic; the comparison
// words one Philox call per counter, sr_words). The exact scalar codec remains for: blocks whose
// scale lies outside MxFastRange (RNE: rne_mag/code_of, still branch-free; stochastic:
// encode_scaled_sr), INT8 and fp16-output stochastic QDQ, quest's per-block sums off the eight-block
// paths (quest_arg), and dequantize blocks holding NaN/Inf element codes (mx_dequant_bits).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(MXQ_HAVE_OPENMP)
#include <omp.h>
#endif

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"
#include "cpu/fast.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

constexpr std::int64_t kTileBlocks = 64;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MXQ_CLONES
#endif
#define MXQ_INLINE [[gnu::always_inline]] inline

// AVX2 intrinsics paths (x86 with GCC), each taken where the CPU has AVX2 (cpu_has_avx2), with a
// portable fallback beside it: NVFP4 quantize / QDQ / dequantize, quest's block statistics, Philox.
// MXQ_CPU_NO_AVX2=1 in the environment (read once) takes the fallbacks on an AVX2 CPU too: the tests
// run the CPU suites that way (tests/CMakeLists.txt, portable_*), so both paths are held to the bytes.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CPU_AVX2 1
inline bool cpu_has_avx2() {
  static const bool has = [] {
    const char* off = std::getenv("MXQ_CPU_NO_AVX2");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    return static_cast<bool>(__builtin_cpu_supports("avx2"));
  }();
  return has;
}
// AVX-512F (Philox's 64-bit-lane form, philox8_avx512), where the CPU has it and the AVX2 paths are on;
// MXQ_CPU_NO_AVX512=1 takes the AVX2 form instead (fastmath_test compares the forms directly).
inline bool cpu_has_avx512() {
  static const bool has = [] {
    const char* off = std::getenv("MXQ_CPU_NO_AVX512");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    return cpu_has_avx2() && static_cast<bool>(__builtin_cpu_supports("avx512f"));
  }();
  return has;
}
#endif

// Philox4x32-10's constants (core::philox4x32_10): multipliers and key increments.
constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u, kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

template <class F>
void parallel_tiles(std::int64_t rows, std::int64_t nblocks, F&& f) {
  const std::int64_t per_row = (nblocks + kTileBlocks - 1) / kTileBlocks;
  const std::int64_t n = rows * per_row;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (n > 1)
#endif
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t r = t / per_row, b0 = (t % per_row) * kTileBlocks;
    f(r, b0, std::min(nblocks, b0 + kTileBlocks));
  }
}

// ---- loads and stores ----------------------------------------------------------------------------------
// Software prefetch of the source kPrefetchAhead elements past p, one request per 64-byte line of the n
// elements there (the fast paths call it once per step of n elements, so the requests run a fixed
// distance ahead of the loads, into the next tile at a tile's end; past the tensor's end a prefetch
// is a no-op, it never faults). Measured on this project's 2-core Xeon VM, cold 4096 x 4096 bf16 inputs,
// one thread: NVFP4 quantize 9.7 -> 7.1 ms, MXFP4 7.2 -> 6.8 ms; the hardware prefetchers alone leave
// the loads waiting on memory.
constexpr int kPrefetchAhead = 512;
template <class T>
MXQ_INLINE void prefetch_ahead(const T* p, int n) {
  // the address as an integer: past the array's end a pointer could not be formed
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p) + kPrefetchAhead * sizeof(T);
  for (int l = 0; l < n * int(sizeof(T)); l += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + std::uintptr_t(l)), 0, 3);
}
// G is the group size when known at compile time (0: use g). DT is the input dtype.
template <DType DT, int G>
MXQ_INLINE void load_block(const Tensor& x, std::int64_t r, std::int64_t k0, std::int64_t K, int g_rt, float* xf) {
  const int g = G ? G : g_rt;
  const std::int64_t n = std::min<std::int64_t>(g, K - k0);
  const std::int64_t base = r * x.stride() + k0;
  if constexpr (DT == DType::bf16) {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = bf16_to_f32(s[i]);
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? bf16_to_f32(s[i]) : 0.0f;
  } else if constexpr (DT == DType::f32) {
    const float* s = static_cast<const float*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = s[i];
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? s[i] : 0.0f;
  } else {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    for (int i = 0; i < g; ++i) xf[i] = i < n ? f16_to_f32(s[i]) : 0.0f;
  }
}

// Max of |x| as bits: >= 0x7F800000 means the block holds a NaN or Inf.
template <int G = 0>
MXQ_INLINE std::uint32_t amax_bits(const float* xf, int g_rt) {
  const int g = G ? G : g_rt;
  std::uint32_t m = 0;
  for (int i = 0; i < g; ++i) m = std::max(m, f2u(xf[i]) & 0x7FFFFFFFu);
  return m;
}

template <DType OUT>
MXQ_INLINE void store_out(void* row, std::int64_t k0, std::int64_t n, const std::uint32_t* bits) {
  if constexpr (OUT == DType::f32) {
    std::memcpy(static_cast<std::uint32_t*>(row) + k0, bits, n * 4);
  } else {
    std::uint16_t* d = static_cast<std::uint16_t*>(row) + k0;
    for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<std::uint16_t>(bits[i]);
  }
}

MXQ_INLINE void* row_ptr(const Tensor& t, std::int64_t r) {
  return static_cast<char*>(t.data) + r * t.stride() * dtype_size(t.dtype);
}

// ---- branch-free selects -----------------------------------------------------------------------------------
// c ? a : b on bit patterns, written with masks: GCC keeps a select of floating-point values (and
// the float operations that feed only one side) as control flow under -ftrapping-math, which stops
// the vectoriser; on integers it does not.
MXQ_INLINE std::uint32_t bsel(bool c, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t m = 0u - std::uint32_t(c);
  return (a & m) | (b & ~m);
}

// to_dtype_bits_nonnan (fastmath.hpp) with the infinity case selected instead of returned early.
template <DType OUT>
MXQ_INLINE std::uint32_t to_dtype_bits_nonnan_bf(float v) {
  const std::uint32_t b = f2u(v), sign = b >> 31, mag = b & 0x7FFFFFFFu;
  constexpr int sb = OUT == DType::f32 ? 31 : 15;
  const std::uint32_t inf = OUT == DType::f32 ? b : ((sign << 15) | (OUT == DType::bf16 ? 0x7F80u : 0x7C00u));
  return bsel(mag == 0x7F800000u, inf, out_mag_bits<OUT>(u2f(mag)) | (sign << sb));
}

// nvfp4_product (fastmath.hpp) with its zero case a select on bits (a float select stays a branch and
// stops the vectoriser).
MXQ_INLINE std::uint32_t nvfp4_product_bits_bf(std::uint32_t xbits, float m) {
  return bsel((xbits & 0x7FFFFFFFu) == 0, xbits, f2u(mul_rn(u2f(xbits), m)));
}

// nvfp4_encode_rne_readoff (fastmath.hpp) with its saturating min written as a select.
MXQ_INLINE std::uint32_t nvfp4_code_rne_bf(std::uint32_t xbits, float m) {
  constexpr std::uint32_t lo = 127u << 23, kC = rne_const_bits<1>();
  const float prod = u2f(nvfp4_product_bits_bf(xbits & 0x7FFFFFFFu, m));
  const float a = u2f(bsel(prod < 6.0f, f2u(prod), 0x40C00000u));
  const std::uint32_t be = umax(f2u(a) & 0x7F800000u, lo), cb = be + kC;
  return readoff_mag<1>(f2u(add_rn(a, u2f(cb))), be, cb, lo) | ((xbits >> 31) << 3);
}

// e2m1_value (fastmath.hpp) with a select.
MXQ_INLINE float e2m1_value_bf(std::uint32_t mag) {
  return u2f(bsel(mag < 2, mag ? 0x3F000000u : 0u, (((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22)));
}

// ---- stochastic rounding: the comparison words of a block ----------------------------------------------
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

// ---- per-element helpers of the fast paths ------------------------------------------------------------------
// A magnitude code with its sign: sign-magnitude, or two's complement for INT8 (no -0), as signed_code.
template <ElemType ET>
MXQ_INLINE std::uint32_t sign_code(std::uint32_t mag, std::uint32_t sign) {
  constexpr FloatSpec f = Elem<ET>::spec;
  if constexpr (f.twos_complement) {
    const std::uint32_t neg = 0u - sign;
    return ((mag ^ neg) + sign) & 0xFFu;
  } else {
    return mag | (sign << (f.bits - 1));
  }
}

// The binades an element of a block scaled by 2^e (e in MxFastRange) is clamped to when rounded in
// the unscaled domain: lo that of the smallest normal element, hi one past the largest.
struct MxBinades {
  std::uint32_t lo, hi;
};
template <ElemType ET>
MXQ_INLINE MxBinades mx_binades(int e) {
  constexpr FloatSpec f = Elem<ET>::spec;
  return {std::uint32_t(f.emin + e + 127) << 23, std::uint32_t(f.emax + 1 + e + 127) << 23};
}
// The RNE code of one element with magnitude bits xa and sign bit `sign` under those binades, read
// off the rounding's bits (readoff_mag) and saturated at the largest code.
template <ElemType ET>
MXQ_INLINE std::uint32_t mx_code_rne_fast(std::uint32_t xa, std::uint32_t sign, MxBinades bn) {
  constexpr FloatSpec f = Elem<ET>::spec;
  constexpr std::uint32_t kC = rne_const_bits<f.mbits>();
  const std::uint32_t be = umin(umax(xa & 0x7F800000u, bn.lo), bn.hi), cb = be + kC;
  const std::uint32_t t = f2u(add_rn(u2f(xa), u2f(cb)));
  return sign_code<ET>(umin(readoff_mag<f.mbits>(t, be, cb, bn.lo), f.maxcode), sign);
}

// Element codes of one finite MX block (scale exponent e in [-127, 127]) from its staged fp32 values
// (after the QuTLASS rule's 3x): encode_scaled's result, rounded to nearest even or stochastically
// with the comparison words rnd. In MxFastRange the rounding is done in the unscaled domain and the
// code read off the rounding's bits (readoff_mag, as the CUDA kernels do; the binade clamped above at
// emax + 1 + e so that quest's and the QuTLASS rule's elements past the scaled maximum saturate);
// elsewhere by rne_mag / code_of, or encode_scaled_sr.
template <ElemType ET, int G>
MXQ_INLINE void mx_block_codes(int g_rt, const float* xf, int e, bool sr, const std::uint32_t* rnd,
                               std::uint32_t* codes) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const int g = G ? G : g_rt;
  if (MxFastRange<ET>::contains(e)) {
    const MxBinades bn = mx_binades<ET>(e);
    if (!sr) {
      for (int i = 0; i < g; ++i) {
        const std::uint32_t xb = f2u(xf[i]);
        codes[i] = mx_code_rne_fast<ET>(xb & 0x7FFFFFFFu, xb >> 31, bn);
      }
      return;
    }
    if constexpr (!f.twos_complement) {
      for (int i = 0; i < g; ++i) {  // the integer form (fastmath_test)
        const std::uint32_t xb = f2u(xf[i]);
        codes[i] = sign_code<ET>(sr_code_unscaled<ET>(xb, e, rnd[i]), xb >> 31);
      }
      return;
    }
  }
  if (!sr) {
    const float inv = pow2f(-e);
    for (int i = 0; i < g; ++i) codes[i] = code_of<ET>(rne_mag<ET>(xf[i], inv), f2u(xf[i]) >> 31);
  } else {
    for (int i = 0; i < g; ++i) codes[i] = encode_scaled_sr<ET>(f2u(xf[i]), e, rnd[i]);
  }
}

// NVFP4 per-call tables: for every E4M3 scale byte its value (NaN codes: 0) and the element multiplier
// nvfp4_multiplier (0 for a zero scale).
struct NvTables {
  float sval[256], m[256];
};
inline NvTables make_nv_tables(float S) {
  NvTables t{};
  for (int c = 0; c < 256; ++c) {
    const bool nan = (c & 0x7F) == kE4M3NaN;
    t.sval[c] = nan ? 0.0f : decode_f32(std::uint32_t(c), kE4M3);
    t.m[c] = (nan || c > 0x7F) ? 0.0f : nvfp4_multiplier(std::uint32_t(c), S);
  }
  return t;
}

// The scale codes of eight full NVFP4 blocks of bf16/fp32 storage (128 elements): each block's amax
// and nvfp4_block_scale_code (e4m3_code_rne_sat of amax * S / 6), a step at a time across the eight
// blocks so that each step vectorises (the division among them). ok[j]: all ones where block j is
// finite, else 0 (a NaN or Inf: the NaN scale); sc[j]: the code, 0 where not finite.
template <DType DT>
MXQ_INLINE void nvfp4_scale_codes8(const Storage<DT>* s, float S, std::uint32_t* sc, std::uint32_t* ok) {
  alignas(64) std::uint32_t xb[128], am[8];
  for (int i = 0; i < 128; ++i)
    xb[i] = (DT == DType::f32 ? std::uint32_t(s[i]) : std::uint32_t(s[i]) << 16) & 0x7FFFFFFFu;
  for (int j = 0; j < 8; ++j) {
    std::uint32_t a = 0;
    for (int i = 0; i < 16; ++i) a = std::max(a, xb[16 * j + i]);
    am[j] = a;
  }
  for (int j = 0; j < 8; ++j) sc[j] = e4m3_code_rne_sat(div_rn(mul_rn(u2f(am[j]), S), 6.0f));
  for (int j = 0; j < 8; ++j) {
    ok[j] = 0u - std::uint32_t(am[j] < 0x7F800000u);
    sc[j] &= ok[j];
  }
}

// The quest rule's argument (core::quest_arg) of one full block of G elements straight from bf16/fp32
// storage (the values exact in fp32): the same operations in the same order.
template <DType DT, int G>
MXQ_INLINE float quest_arg_direct(const Storage<DT>* s) {
  alignas(64) float v[G];
  for (int i = 0; i < G; ++i) v[i] = u2f(DT == DType::f32 ? std::uint32_t(s[i]) : std::uint32_t(s[i]) << 16);
  return quest_arg<G>(v);
}

// ---- NVFP4 outputs by AVX2's lane permute, NVFP4 and quest blocks in AVX2 lanes ------------------------
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

// Eight (AVX2) or sixteen (AVX-512F) elements of bf16/fp32 storage from p as their fp32 bits (bf16:
// the high half, an exact widening).
template <DType DT>
MXQ_INLINE __attribute__((target("avx2"))) __m256i load8_bits_avx2(const Storage<DT>* p) {
  if constexpr (DT == DType::f32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  else return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <DType DT>
MXQ_INLINE __attribute__((target("avx512f"))) __m512i load16_bits_avx512(const Storage<DT>* p) {
  if constexpr (DT == DType::f32) return _mm512_loadu_si512(p);
  else return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
#pragma GCC diagnostic pop

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

// Eight full NVFP4 blocks (128 elements of bf16/fp32 storage), RNE, in AVX2 registers: the arithmetic
// of nvfp4_scale_codes8 and nvfp4_code_rne_bf (the same IEEE operations, one lane per block or per
// element, so the same bits). Out: sc, the eight scale codes (0 where a block is not finite); ok, all
// ones where the block is finite; codes[2 j], codes[2 j + 1], the sign-magnitude codes of block j's
// elements 0..7 and 8..15 (garbage where the block is not finite: callers mask with ok).
// QUEST: the rule quest's scale codes instead (nvfp4_quest_scale_code_fast of quest_arg, S = 1 in the
// tables); a block whose statistic is NaN is not finite either.
struct Nvfp4Chunk {
  __m256i sc, ok, codes[16];
  alignas(32) float m8[8];  // the blocks' multipliers
};
// The element codes of nvfp4_chunk_codes_avx2 (nvfp4_code_rne_bf(x, m): the readoff of min(|x| m, 6),
// the sign at bit 3), block j's multiplier c.m8[j]. ZERO: some multiplier is infinite (S / s overflows:
// a tensor scale near FLT_MAX), where a zero element must stay 0 (nvfp4_product: 0 * Inf would be NaN,
// then 6); with finite multipliers the product of a zero is 0 anyway, and the test is left out.
template <DType DT, bool ZERO>
__attribute__((target("avx2"))) inline void nvfp4_elements_avx2(const Storage<DT>* s, Nvfp4Chunk& c) {
  constexpr std::uint32_t lo = 127u << 23, kC = rne_const_bits<1>();
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF), vlo = _mm256_set1_epi32(int(lo)), vkC = _mm256_set1_epi32(int(kC)),
                vexp = _mm256_set1_epi32(0x7F800000), vsub = _mm256_set1_epi32(int(lo >> 22)), eight = _mm256_set1_epi32(8);
  const __m256 six = _mm256_set1_ps(6.0f);
  for (int j = 0; j < 8; ++j) {
    const __m256 m = _mm256_set1_ps(c.m8[j]);
    for (int h = 0; h < 2; ++h) {
      const __m256i xb = load8_bits_avx2<DT>(s + 16 * j + 8 * h);
      const __m256i xm = _mm256_and_si256(xb, magmask);
      __m256 prod = _mm256_mul_ps(_mm256_castsi256_ps(xm), m);
      if constexpr (ZERO) prod = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(xm, _mm256_setzero_si256())), prod);
      const __m256 a = _mm256_min_ps(prod, six);
      const __m256i be = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), vexp), vlo);
      const __m256i cb = _mm256_add_epi32(be, vkC);
      const __m256i t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(cb)));
      const __m256i mag = _mm256_sub_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(be, 22)), _mm256_add_epi32(cb, vsub));
      c.codes[2 * j + h] = _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(xb, 28), eight));
    }
  }
}

// quest's statistics (G = 16) of n chunks of eight blocks with AVX-512F, chunk ch's to qa[8 ch ..
// 8 ch + 7]: one call for a tile's chunks, whose AVX2 code then reads them (the AVX-512 form called once
// per chunk from inside that code measured slower than the inlined AVX2 form; the same bits either way).
template <DType DT>
__attribute__((target("avx512f"))) inline void nvfp4_quest_stats_avx512(const Storage<DT>* s, std::int64_t n, float* qa) {
  for (std::int64_t ch = 0; ch < n; ++ch) _mm256_storeu_ps(qa + 8 * ch, quest_args8_avx512<DT, 16>(s + 128 * ch));
}
// For the chunk loops: QUEST's statistics of a tile's n <= kTileBlocks / 8 chunks into buf where the CPU
// has AVX-512F (buf returned), else nullptr (the chunk code computes them with AVX2).
template <DType DT, bool QUEST>
inline const float* nvfp4_quest_stats(const Storage<DT>* s, std::int64_t n, float (&buf)[kTileBlocks]) {
  if constexpr (QUEST) {
    if (cpu_has_avx512() && n <= kTileBlocks / 8) {
      nvfp4_quest_stats_avx512<DT>(s, n, buf);
      return buf;
    }
  }
  return nullptr;
}

// In two steps: the scale codes, ok and multipliers (nvfp4_chunk_scales_avx2), then the element codes
// (nvfp4_chunk_codes_avx2): a caller can take the next chunk's scales, a long chain of dependent
// operations (quest: two divisions and a square root), before this chunk's elements.
// QUEST: the eight statistics from qa where given (nvfp4_quest_stats_avx512), else computed here.
template <DType DT, bool QUEST = false>
__attribute__((target("avx2"))) inline void nvfp4_chunk_scales_avx2(const Storage<DT>* s, float S, const float* mtab, Nvfp4Chunk& c,
                                                                    const float* qa = nullptr) {
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i am;  // the blocks' amax bits, one lane per block
  if constexpr (DT == DType::bf16) {
    // one block per register (16 bf16), magnitudes compared as 16-bit integers; the eight horizontal
    // maxima folded together: halves across registers, then within 64 and 32 bits
    __m256i v[8];
    const __m256i m16 = _mm256_set1_epi16(0x7FFF);
    for (int j = 0; j < 8; ++j) v[j] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j)), m16);
    __m256i a[4];
    for (int j = 0; j < 4; ++j)  // lane 0: block 2j's halves' max; lane 1: block 2j + 1's
      a[j] = _mm256_max_epu16(_mm256_permute2x128_si256(v[2 * j], v[2 * j + 1], 0x20),
                              _mm256_permute2x128_si256(v[2 * j], v[2 * j + 1], 0x31));
    __m256i b[2];
    for (int j = 0; j < 2; ++j) {  // 64-bit lanes: blocks 4j, 4j + 2, 4j + 1, 4j + 3
      __m256i t = _mm256_max_epu16(_mm256_unpacklo_epi64(a[2 * j], a[2 * j + 1]), _mm256_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
      t = _mm256_max_epu16(t, _mm256_srli_epi64(t, 32));
      t = _mm256_max_epu16(t, _mm256_srli_epi64(t, 16));
      b[j] = _mm256_and_si256(t, _mm256_set1_epi64x(0xFFFF));
    }
    // 32-bit lanes: blocks 0, 4, 2, 6, 1, 5, 3, 7 -> 0..7, as fp32 bits
    const __m256i mixed = _mm256_or_si256(b[0], _mm256_slli_epi64(b[1], 32));
    am = _mm256_slli_epi32(_mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)), 16);
  } else {
    alignas(32) std::uint32_t a8[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i lo = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j)), magmask);
      const __m256i hi = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * j + 8)), magmask);
      __m256i t = _mm256_max_epu32(lo, hi);
      t = _mm256_max_epu32(t, _mm256_permute2x128_si256(t, t, 0x01));
      t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0x4E));
      t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0xB1));
      a8[j] = std::uint32_t(_mm256_cvtsi256_si32(t));
    }
    am = _mm256_load_si256(reinterpret_cast<const __m256i*>(a8));
  }
  // scale codes: e4m3_code_rne_sat(amax * S / 6) (quest: of its statistic), read off the rounding
  {
    __m256 y;
    if constexpr (QUEST)
      y = qa ? _mm256_loadu_ps(qa) : quest_args8_avx2_form<DT, 16>(s);
    else
      y = _mm256_div_ps(_mm256_mul_ps(_mm256_castsi256_ps(am), _mm256_set1_ps(S)), _mm256_set1_ps(6.0f));
    const __m256 a = _mm256_min_ps(y, _mm256_set1_ps(448.0f));  // NaN y (a block not finite): 448
    constexpr std::uint32_t lo = 121u << 23, kC = rne_const_bits<3>();
    const __m256i be = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000)), _mm256_set1_epi32(int(lo)));
    const __m256i cb = _mm256_add_epi32(be, _mm256_set1_epi32(int(kC)));
    const __m256i t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(cb)));
    const __m256i code = _mm256_sub_epi32(_mm256_add_epi32(t, _mm256_srli_epi32(be, 20)), _mm256_add_epi32(cb, _mm256_set1_epi32(int(lo >> 20))));
    c.ok = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), am);
    if constexpr (QUEST) c.ok = _mm256_and_si256(c.ok, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q)));
    c.sc = _mm256_and_si256(code, c.ok);
  }
  _mm256_store_ps(c.m8, _mm256_i32gather_ps(mtab, c.sc, 4));
}
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_chunk_codes_avx2(const Storage<DT>* s, Nvfp4Chunk& c) {
  // some block's multiplier infinite: zero elements need their test (nvfp4_elements_avx2)
  const __m256 minf = _mm256_cmp_ps(_mm256_load_ps(c.m8), _mm256_set1_ps(INFINITY), _CMP_EQ_OQ);
  if (_mm256_movemask_ps(minf) != 0)
    nvfp4_elements_avx2<DT, true>(s, c);
  else
    nvfp4_elements_avx2<DT, false>(s, c);
}

// sr_code_unscaled<ET> of eight magnitudes' fp32 bits a (sign bit clear) in the binades of vlo = f.emin
// + e + 127 (one value per lane: e may differ by lane) with the comparison words w, every shift count
// as there (variable shifts of 32 or more give 0, which its clamps stand for; every intermediate stays
// below 2^31).
template <ElemType ET>
__attribute__((target("avx2"))) inline __m256i sr_mags8_avx2(__m256i a, __m256i vlo, __m256i w) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256(), v32 = _mm256_set1_epi32(32);
  const __m256i fld = _mm256_srli_epi32(a, 23);
  const __m256i E = _mm256_max_epi32(fld, one);
  const __m256i sig =
      _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)), _mm256_andnot_si256(_mm256_cmpeq_epi32(fld, zero), _mm256_set1_epi32(0x800000)));
  const __m256i up = _mm256_max_epi32(_mm256_sub_epi32(E, vlo), zero);
  const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(23 - f.mbits), _mm256_max_epi32(_mm256_sub_epi32(vlo, E), zero));
  const __m256i t = _mm256_add_epi32(_mm256_slli_epi32(up, f.mbits), _mm256_srlv_epi32(sig, sh));
  const __m256i rem = _mm256_and_si256(sig, _mm256_sub_epi32(_mm256_sllv_epi32(one, sh), one));
  const __m256i thr = _mm256_or_si256(_mm256_sllv_epi32(rem, _mm256_sub_epi32(v32, sh)), _mm256_srlv_epi32(rem, _mm256_sub_epi32(sh, v32)));
  const __m256i flip = _mm256_set1_epi32(int(0x80000000u));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_xor_si256(thr, flip), _mm256_xor_si256(w, flip));  // w < thr, unsigned
  return _mm256_min_epu32(_mm256_sub_epi32(t, below), _mm256_set1_epi32(int(f.maxcode)));
}

// The element codes of a chunk rounded stochastically (the staged path's integer form of
// nvfp4_encode_sr: sr_code_unscaled<e2m1>(|x| m, 0, rnd) with the sign at bit 3; |x| = 0 stays 0 where
// m is infinite, as nvfp4_product), block j's multiplier c.m8[j], the chunk's 128 comparison words
// rnd; eight lanes per step, every shift count as sr_code_unscaled's (variable shifts of 32 or more
// give 0, which its clamps stand for). Garbage where a block is not finite (callers mask with ok).
template <DType DT>
__attribute__((target("avx2"))) inline void nvfp4_chunk_codes_sr_avx2(const Storage<DT>* s, Nvfp4Chunk& c, const std::uint32_t* rnd) {
  constexpr FloatSpec f = Elem<ElemType::e2m1>::spec;
  constexpr int lo = f.emin + 127;  // e = 0
  const __m256i magmask = _mm256_set1_epi32(0x7FFFFFFF), vlo = _mm256_set1_epi32(lo), zero = _mm256_setzero_si256(),
                eight = _mm256_set1_epi32(8);
  for (int j = 0; j < 8; ++j) {
    const __m256 m = _mm256_set1_ps(c.m8[j]);
    for (int h = 0; h < 2; ++h) {
      const __m256i xb = load8_bits_avx2<DT>(s + 16 * j + 8 * h);
      const __m256i xm = _mm256_and_si256(xb, magmask);
      const __m256i xz = _mm256_cmpeq_epi32(xm, zero);
      const __m256i p = _mm256_andnot_si256(xz, _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(xm), m)));  // |x| m, 0 stays 0
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rnd + 16 * j + 8 * h));
      c.codes[2 * j + h] = _mm256_or_si256(sr_mags8_avx2<ElemType::e2m1>(p, vlo, w), _mm256_and_si256(_mm256_srli_epi32(xb, 28), eight));
    }
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// sr_mags8_avx2 with AVX-512F: sixteen lanes, the same operations.
template <ElemType ET>
MXQ_INLINE __attribute__((target("avx512f"))) __m512i sr_mags16_avx512(__m512i a, __m512i vlo, __m512i w) {
  constexpr FloatSpec f = Elem<ET>::spec;
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), v32 = _mm512_set1_epi32(32);
  const __m512i fld = _mm512_srli_epi32(a, 23);
  const __m512i E = _mm512_max_epi32(fld, one);
  const __m512i mant = _mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF));
  const __m512i sig = _mm512_mask_or_epi32(mant, _mm512_test_epi32_mask(fld, fld), mant, _mm512_set1_epi32(0x800000));
  const __m512i up = _mm512_max_epi32(_mm512_sub_epi32(E, vlo), zero);
  const __m512i sh = _mm512_add_epi32(_mm512_set1_epi32(23 - f.mbits), _mm512_max_epi32(_mm512_sub_epi32(vlo, E), zero));
  const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(up, f.mbits), _mm512_srlv_epi32(sig, sh));
  const __m512i rem = _mm512_and_si512(sig, _mm512_sub_epi32(_mm512_sllv_epi32(one, sh), one));
  const __m512i thr = _mm512_or_si512(_mm512_sllv_epi32(rem, _mm512_sub_epi32(v32, sh)), _mm512_srlv_epi32(rem, _mm512_sub_epi32(sh, v32)));
  const __mmask16 below = _mm512_cmplt_epu32_mask(w, thr);
  return _mm512_min_epu32(_mm512_mask_add_epi32(t, below, t, one), _mm512_set1_epi32(int(f.maxcode)));
}

// One full MX block of 32 (bf16/fp32) for the AVX-512F stochastic-rounding runs (quantize and QDQ):
// its elements' fp32 bits xb and magnitudes a, and its scale exponent e, the rule's of the block amax
// (the staged path's mx_scale_exp). False where the block is zero, not finite or scaled outside
// MxFastRange, which those runs leave to the staged path.
template <ElemType ET, DType DT>
MXQ_INLINE __attribute__((target("avx512f"))) bool mx_sr_block_avx512(ScaleRule rule, const Storage<DT>* s, __m512i (&xb)[2],
                                                                      __m512i (&a)[2], int& e) {
  for (int h = 0; h < 2; ++h) {
    xb[h] = load16_bits_avx512<DT>(s + 16 * h);
    a[h] = _mm512_and_si512(xb[h], _mm512_set1_epi32(0x7FFFFFFF));
  }
  const std::uint32_t am = _mm512_reduce_max_epu32(_mm512_max_epu32(a[0], a[1]));
  if (am == 0 || am >= 0x7F800000u) return false;
  e = mx_scale_exp(rule, u2f(am), 0.0f, Elem<ET>::spec);
  return MxFastRange<ET>::contains(e);
}

// nvfp4_chunk_codes_sr_avx2 with AVX-512F, one block (sixteen lanes) per step: the same operations.
template <DType DT>
__attribute__((target("avx512f"))) inline void nvfp4_chunk_codes_sr_avx512(const Storage<DT>* s, Nvfp4Chunk& c, const std::uint32_t* rnd) {
  constexpr FloatSpec f = Elem<ElemType::e2m1>::spec;
  const __m512i vlo = _mm512_set1_epi32(f.emin + 127);
  for (int j = 0; j < 8; ++j) {
    const __m512i xb = load16_bits_avx512<DT>(s + 16 * j);
    const __m512i xm = _mm512_and_si512(xb, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 nz = _mm512_test_epi32_mask(xm, xm);  // |x| m, 0 stays 0 (m may be infinite)
    const __m512i a = _mm512_maskz_mov_epi32(nz, _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(xm), _mm512_set1_ps(c.m8[j]))));
    const __m512i mag = sr_mags16_avx512<ElemType::e2m1>(a, vlo, _mm512_loadu_si512(rnd + 16 * j));
    const __m512i code = _mm512_or_si512(mag, _mm512_and_si512(_mm512_srli_epi32(xb, 28), _mm512_set1_epi32(8)));
    c.codes[2 * j] = _mm512_castsi512_si256(code);
    c.codes[2 * j + 1] = _mm512_extracti64x4_epi64(code, 1);
  }
}
#pragma GCC diagnostic pop

// Chunk ch of n consecutive chunks from s, taken in order ch = 0, 1, ..., n - 1: its scales and element
// codes, with the next chunk's scales computed before this one's elements, so that the scales' chain
// of dependent operations (quest: two divisions and a square root) overlaps the elements' work.
// c: the two chunks in flight (the caller's, kept across the calls).
template <DType DT, bool QUEST>
__attribute__((target("avx2"))) inline Nvfp4Chunk& nvfp4_chunk_in_order_avx2(const Storage<DT>* s, std::int64_t ch,
                                                                              std::int64_t n, float S, const float* mtab,
                                                                              Nvfp4Chunk (&c)[2], const float* qa = nullptr) {
  if (ch == 0) nvfp4_chunk_scales_avx2<DT, QUEST>(s, S, mtab, c[0], qa);
  prefetch_ahead(s + 128 * ch, 128);
  if (ch + 1 < n) nvfp4_chunk_scales_avx2<DT, QUEST>(s + 128 * (ch + 1), S, mtab, c[(ch + 1) & 1], qa ? qa + 8 * (ch + 1) : nullptr);
  Nvfp4Chunk& cur = c[ch & 1];
  nvfp4_chunk_codes_avx2<DT>(s + 128 * ch, cur);
  return cur;
}

// The packed FP4 bytes of one chunk's 128 codes (element 2i low nibble, 2i + 1 high), zero codes where
// a block is not finite, to d (64 bytes); its eight scale bytes (the NaN code where not finite) to sb.
__attribute__((target("avx2"))) inline void nvfp4_pack_chunk_avx2(const Nvfp4Chunk& c, std::uint8_t* d, std::uint8_t* sb) {
  alignas(32) std::uint32_t ok[8], sc[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ok), c.ok);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc), c.sc);
  for (int j = 0; j < 8; ++j) sb[j] = static_cast<std::uint8_t>(bsel(ok[j] != 0, sc[j], kE4M3NaN));
  const __m256i pair = _mm256_set1_epi32(1 | (16 << 16));  // (lo, hi) 16-bit -> lo + 16 hi
  for (int q = 0; q < 2; ++q) {  // four blocks: 32 bytes
    __m256i P[4];
    for (int k = 0; k < 4; ++k) {
      const int j = 4 * q + k;
      const __m256i keep = _mm256_set1_epi32(ok[j] ? -1 : 0);
      const __m256i e16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(c.codes[2 * j], keep),
                                                                       _mm256_and_si256(c.codes[2 * j + 1], keep)), 0xD8);
      P[k] = _mm256_madd_epi16(e16, pair);  // 32-bit lanes: the block's eight bytes in order
    }
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(P[0], P[1]), _mm256_packus_epi32(P[2], P[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 32 * q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}
#endif

// ---- scale bytes of consecutive blocks ------------------------------------------------------------------
// sb[0..n) to the scale bytes (r, b), ..., (r, b + n - 1) by contiguous runs: a linear row at once, a
// swizzled one four columns at a time (contiguous in the 128 x 4 tiles). dequantize.cpp reads them by
// the same runs, written out there.
MXQ_INLINE void store_scales(const Problem& p, std::uint8_t* scales, std::int64_t stride, std::int64_t r, std::int64_t b,
                             const std::uint8_t* sb, std::int64_t n) {
  if (p.opt.scale_layout == ScaleLayout::linear) return (void)std::memcpy(scales + r * stride + b, sb, std::size_t(n));
  for (std::int64_t j = 0; j < n;) {
    const std::int64_t k = ((b + j) % 4 == 0 && j + 4 <= n) ? 4 : 1;
    std::memcpy(scales + p.scale_offset(r, b + j, stride), sb + j, std::size_t(k));
    j += k;
  }
}

// ---- dispatch: runtime enums -> template parameters ------------------------------------------------------------

// Group size 32 (every MX format's default) and, for E2M1, 16 (NVFP4's) are compiled with a constant
// trip count; others run the same code with a runtime count.
template <ElemType ET, class F>
void dispatch_group(int g, F&& f) {
  if (g == 32) return f(std::integral_constant<int, 32>{});
  if constexpr (ET == ElemType::e2m1)
    if (g == 16) return f(std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 0>{});
}

}  // namespace
}  // namespace mxq::cpu
