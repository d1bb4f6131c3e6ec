// The contracts of core/fastmath.hpp and core/format_traits.hpp ("equals X bit for bit on Y"): each
// helper the fast CPU path and the CUDA kernels share, against the scalar codec, over every input its
// comment allows. (The backends themselves are checked against the reference by quantize_test,
// dequantize_test, qdq_test and layout_test.)
#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "core/e2m1_pack.hpp"
#include "core/fastmath.hpp"
#include "core/format_traits.hpp"
#include "core/problem.hpp"
#include "helpers.hpp"

using namespace mxq;
using th::HostTensor;
using th::Quantized;

namespace {
// check(std::integral_constant<ElemType, ET>{}) for each MX float element type (E2M1, E2M3, E3M2,
// E4M3, E5M2: not INT8).
template <class F>
void for_each_mx_float(F&& check) {
  using mxq::ElemType;
  check(std::integral_constant<ElemType, ElemType::e2m1>{});
  check(std::integral_constant<ElemType, ElemType::e2m3>{});
  check(std::integral_constant<ElemType, ElemType::e3m2>{});
  check(std::integral_constant<ElemType, ElemType::e4m3>{});
  check(std::integral_constant<ElemType, ElemType::e5m2>{});
}
// The bf16 pair path's (code, QDQ bits) of one lane of w, with or without the upper clamp.
template <mxq::ElemType ET>
std::pair<std::uint32_t, std::uint32_t> pair_lane(std::uint32_t w, const mxq::core::MxPair& k, bool clamp, int lane) {
  using namespace mxq::core;
  const std::uint32_t c = clamp ? mx_codes_bf16x2<ET, true>(w, k) : mx_codes_bf16x2<ET, false>(w, k);
  const std::uint32_t q = clamp ? mx_qdq_bf16x2<ET, true>(w, k) : mx_qdq_bf16x2<ET, false>(w, k);
  return {c >> (16 * lane) & 0xFFFFu, q >> (16 * lane) & 0xFFFFu};
}
}  // namespace

// sr_round_unscaled and sr_round_dither (the kernels' stochastic-rounding forms for 32 and for 16 or 8
// random bits, in the unscaled domain) against the scalar codec: every finite bf16 pattern, at every scale of the fast range that puts it near the
// grid (or up to 12 binades above it: saturation), with random words and the words on either side
// of each rounding threshold.
TEST(FastStochastic, UnscaledRoundingMatchesTheCodecForEveryBf16) {
  using namespace mxq::core;
  std::mt19937 rng(9);
  auto check = [&](auto et) {
    constexpr ElemType ET = decltype(et)::value;
    constexpr FloatSpec f = mxq::core::Elem<ET>::spec;
    long bad = 0, n = 0;
    const int elo = MxFastRange<ET>::lo, ehi = MxFastRange<ET>::hi;  // the kernels' fast range
    for (std::uint32_t h = 0; h < 0x8000; ++h) {
      const std::uint32_t xb = h << 16;
      if ((xb & 0x7F800000u) == 0x7F800000u) continue;  // Inf/NaN: never reach the rounding
      const int ex = int((xb >> 23) & 0xFF) - 127;
      // Scales near x's (x up to 12 binades above the top one, as quest can put it), and the smallest.
      std::vector<int> scales{elo};
      for (int e = std::max(elo + 1, ex - f.emax - 12); e <= std::min(ehi, ex - f.emax + 12); ++e) scales.push_back(e);
      for (const int e : scales) {
        // The rounding threshold floor(frac(|x| / Q) * 2^32), in integers: |x| = sig * 2^p.
        const std::uint32_t mant = xb & 0x7FFFFFu, fld = (xb >> 23) & 0xFFu;
        const std::uint64_t sig = fld ? (mant | 0x800000u) : mant;
        const int p = fld ? int(fld) - 150 : -149;
        std::uint64_t thr = 0;
        if (sig) {
          const int E = p + 63 - std::countl_zero(sig);
          const int s = std::max(E, f.emin + e) - f.mbits - p;  // bits of sig below the quantum
          const std::uint64_t rem = s <= 0 ? 0 : s >= 64 ? sig : sig & ((std::uint64_t(1) << s) - 1);
          thr = s <= 0 ? 0 : s <= 32 ? rem << (32 - s) : (s - 32 >= 64 ? 0 : rem >> (s - 32));
        }
        // 32 random bits: sr_round_unscaled; 16 and 8 (sr_word's comparison words): sr_round_dither.
        for (const int B : {32, 16, 8}) {
          const int s = 32 - B;
          const std::uint64_t tb = thr >> s;  // the threshold of the B-bit field
          for (int k = 0; k < 5; ++k) {
            const std::uint32_t r = k == 0 ? 0u : k == 1 ? 0xFFFFFFFFu : k == 2 ? std::uint32_t(rng())
                                  : k == 3 ? std::uint32_t(tb ? tb - 1 : 0) : std::uint32_t(tb);
            const std::uint32_t rnd = sr_word(B == 32 ? r : r & ((1u << B) - 1u), B);
            const float want = mul_rn(decode_f32(encode_scaled_sr<ET>(xb, e, rnd) & ((1u << (f.bits - 1)) - 1u), f), pow2f(e));
            const float got = B == 32 ? sr_round_unscaled<ET>(xb, e, rnd) : sr_round_dither<ET>(xb, e, rnd);
            ++n;
            if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want) && bad++ < 5)
              ADD_FAILURE() << to_string(ET) << " B=" << B << " x=" << std::hex << xb << " e=" << std::dec << e
                            << " rnd=" << std::hex << rnd << std::dec << ": got " << got << " want " << want;
            // the integer form (the CPU fast path's), every B: the code and its value
            const std::uint32_t want_code = encode_scaled_sr<ET>(xb, e, rnd) & ((1u << (f.bits - 1)) - 1u);
            const std::uint32_t code = sr_code_unscaled<ET>(xb, e, rnd), vbits = sr_code_value_bits<ET>(code, e);
            if ((code != want_code || vbits != std::bit_cast<std::uint32_t>(want)) && bad++ < 5)
              ADD_FAILURE() << to_string(ET) << " sr_code_unscaled B=" << B << " x=" << std::hex << xb << " e=" << std::dec
                            << e << " rnd=" << std::hex << rnd << ": code " << code << " want " << want_code << ", value "
                            << vbits << " want " << std::bit_cast<std::uint32_t>(want) << std::dec;
          }
        }
      }
    }
    EXPECT_EQ(bad, 0) << to_string(ET) << ": " << bad << " of " << n;
  };
  for_each_mx_float(check);
}

// The NVFP4 stochastic rounding of the kernels: x * m rounded once in fp32, then sr_round_unscaled /
// sr_round_dither onto E2M1 at e = 0 and e2m1_code_of_grid, against nvfp4_encode_sr. Any fp32 product
// can reach the rounding here (not only bf16 patterns): 2^18 random magnitudes spread over every
// binade from the subnormals to Inf, each with random words and those on either side of the threshold.
TEST(FastStochastic, Nvfp4RoundingOfAnyProductMatchesTheCodec) {
  using namespace mxq::core;
  std::mt19937 rng(11);
  long bad = 0, n = 0;
  for (int i = 0; i < (1 << 18); ++i) {
    const std::uint32_t fld = i < 64 ? std::uint32_t(i % 2 ? 255 : 0) : rng() % 140 == 0 ? rng() % 256 : 100 + rng() % 32;
    std::uint32_t vb = (fld << 23) | (rng() & 0x7FFFFFu) | (rng() & 0x80000000u);
    if (fld == 255) vb &= 0xFF800000u;  // Inf, not NaN (a NaN block never reaches the rounding)
    const std::uint32_t a = vb & 0x7FFFFFFFu;
    for (const int B : {32, 16, 8}) {
      // The threshold by the scalar codec itself (rounding up is monotone in the word): the smallest
      // field that rounds down, found by bisection.
      const std::uint64_t top = std::uint64_t(1) << B;
      const std::uint32_t down = nvfp4_encode_sr(vb, 1.0f, 0xFFFFFFFFu);
      std::uint64_t lo = 0, hi = top;  // the answer is in [lo, hi]
      while (lo < hi) {
        const std::uint64_t mid = (lo + hi) / 2;
        if (nvfp4_encode_sr(vb, 1.0f, sr_word(std::uint32_t(mid), B)) == down) hi = mid;
        else lo = mid + 1;
      }
      for (int k = 0; k < 6; ++k) {
        std::uint32_t r = rng();
        if (B != 32) r &= std::uint32_t(top - 1);
        if (k == 0) r = 0;
        if (k == 1) r = std::uint32_t(top - 1);
        if (k == 3 && lo > 0) r = std::uint32_t(lo - 1);
        if (k == 4 && lo < top) r = std::uint32_t(lo);
        const std::uint32_t rnd = sr_word(r, B);
        const std::uint32_t want = nvfp4_encode_sr(vb, 1.0f, rnd);
        const float g = B == 32 ? sr_round_unscaled<ElemType::e2m1>(vb, 0, rnd) : sr_round_dither<ElemType::e2m1>(vb, 0, rnd);
        const std::uint32_t got = e2m1_code_of_grid(g) | ((vb >> 31) << 3);
        ++n;
        if (got != want && bad++ < 5)
          ADD_FAILURE() << "B=" << B << " v=" << std::hex << vb << " rnd=" << rnd << std::dec << ": got code " << got
                        << " want " << want << " (|v| " << u2f(a) << ")";
        const std::uint32_t got_int = sr_code_unscaled<ElemType::e2m1>(vb, 0, rnd) | ((vb >> 31) << 3);
        if (got_int != want && bad++ < 5)
          ADD_FAILURE() << "sr_code_unscaled B=" << B << " v=" << std::hex << vb << " rnd=" << rnd << std::dec
                        << ": got code " << got_int << " want " << want << " (|v| " << u2f(a) << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// nvfp4_encode_rne_readoff (the kernels' NVFP4 quantize) against nvfp4_encode_rne: every finite bf16
// pattern under multipliers from 0 and denormal to FLT_MAX and Inf (products that underflow, saturate
// and overflow to infinity) and 200 random ones.
// The kernels' amax scale rules as constants (core::amax_rule / amax_rule_exp) against the codec's
// mx_scale_exp: every MX element format x floor, ceil, even, rceil; every subnormal pattern and every
// significand of the binade [1, 2), and every 61st significand of a spread of other binades (the bump
// depends on the significand only, the offset on the binade only). Fails when a constant is off by one.
TEST(FastScaleRules, AmaxRuleConstantsMatchTheCodecForEverySignificand) {
  using namespace mxq::core;
  long bad = 0, n = 0;
  std::string first;
  auto check = [&](auto et) {
    constexpr ElemType ET = decltype(et)::value;
    constexpr FloatSpec f = Elem<ET>::spec;
    for (ScaleRule r : mxq::amax_rules()) {
      const AmaxRule k = amax_rule(r, f);
      for (std::uint32_t ex : {0u, 1u, 2u, 60u, 127u, 128u, 200u, 253u, 254u}) {
        const std::int64_t step = ex == 0 || ex == 127 ? 1 : 61;
#pragma omp parallel for reduction(+ : bad, n) schedule(static)
        for (std::int64_t m = ex == 0 ? 1 : 0; m < (1 << 23); m += step) {
          const std::uint32_t a = (ex << 23) | std::uint32_t(m);
          const int want = mx_scale_exp(r, u2f(a), 0.0f, f), got = amax_rule_exp<f.mbits>(k, a);
          ++n;
          if (want != got) {
            ++bad;
#pragma omp critical
            if (first.size() < 800)
              first += std::string(to_string(ET)) + "/" + std::string(to_string(r)) + " amax bits " + std::to_string(a) +
                       ": codec " + std::to_string(want) + ", constants " + std::to_string(got) + "\n";
          }
        }
      }
    }
  };
  check(std::integral_constant<ElemType, ElemType::e2m1>{});
  check(std::integral_constant<ElemType, ElemType::e2m3>{});
  check(std::integral_constant<ElemType, ElemType::e3m2>{});
  check(std::integral_constant<ElemType, ElemType::e4m3>{});
  check(std::integral_constant<ElemType, ElemType::e5m2>{});
  check(std::integral_constant<ElemType, ElemType::int8>{});
  EXPECT_EQ(bad, 0) << bad << " of " << n << " mismatches; first:\n" << first;
  EXPECT_GT(n, 6L * 4 * 2 * ((1 << 23) - 1));
}

TEST(FastNvfp4, ReadOffCodeMatchesTheEncoderForEveryBf16) {
  using namespace mxq::core;
  std::mt19937 rng(5);
  // INFINITY: S / s past fp32's range (a huge tensor scale over a small block scale), where a zero
  // element must still give code 0 (0 * Inf is NaN)
  std::vector<float> ms = {0.0f, 1.0f, 1e-30f, 1e30f, 3.4e38f, 1e-45f, INFINITY};
  for (int k = 0; k < 200; ++k) ms.push_back(std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(rng() % 60) - 30));
  long bad = 0, n = 0;
  for (const float m : ms)
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
      const std::uint32_t xb = h << 16;
      if ((xb & 0x7F800000u) == 0x7F800000u) continue;  // NaN/Inf blocks never reach the encoder
      const std::uint32_t want = nvfp4_encode_rne(xb, m), got = nvfp4_encode_rne_readoff(xb, m);
      ++n;
      if (got != want && bad++ < 5)
        ADD_FAILURE() << "x=" << std::hex << xb << " m=" << m << ": got " << got << " want " << want;
    }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// e4m3_code_rne_sat (the kernels' NVFP4 block-scale code) against encode_f32: every fp32 pattern
// of the binades that round onto E4M3's grid or saturate at its edges (2^-11 .. 2^10: below, the code
// is 0; above, 0x7E), every 4096th pattern elsewhere, and +Inf.
TEST(FastNvfp4, ScaleCodeMatchesTheEncoderForEveryFp32InTheGridsRange) {
  using namespace mxq::core;
  long bad = 0, n = 0;
#pragma omp parallel for reduction(+ : bad, n) schedule(dynamic)
  for (int ex = 0; ex < 255; ++ex) {
    const std::uint32_t step = ex >= 127 - 11 && ex <= 127 + 10 ? 1u : 4096u;
    for (std::uint32_t mant = 0; mant < (1u << 23); mant += step) {
      const std::uint32_t b = (std::uint32_t(ex) << 23) | mant;
      const std::uint32_t want = encode_f32(b, spec_e4m3()), got = e4m3_code_rne_sat(u2f(b));
      ++n;
      if (got != want) {
#pragma omp critical
        if (bad < 5) ADD_FAILURE() << "y bits " << std::hex << b << ": got " << got << " want " << want;
        ++bad;
      }
    }
  }
  EXPECT_EQ(e4m3_code_rne_sat(u2f(0x7F800000u)), encode_f32(0x7F800000u, spec_e4m3()));
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// nvfp4_scale_code_fast (the kernels' NVFP4 block-scale code, the division by 6 by a multiplication
// and one fma correction) against the reference's e4m3 code of RN(v / 6): every fp32 v from +0 to
// +Inf. The quotients themselves must agree wherever they are normal numbers (div6_rn_normal's
// contract). Without the correction it fails (703 M quotients and 15 codes differ); the correction
// also repairs a reciprocal two ulps off.
TEST(FastNvfp4, ScaleCodeWithoutDivisionMatchesTheDivisionForEveryFp32) {
  using namespace mxq::core;
  long bad = 0, bad_q = 0, n = 0;
#pragma omp parallel for reduction(+ : bad, bad_q, n) schedule(static)
  for (std::int64_t i = 0; i <= 0x7F800000LL; ++i) {
    const std::uint32_t b = std::uint32_t(i);
    const float v = u2f(b), q = div6_rn_normal(v), want_q = div_rn(v, 6.0f);
    ++n;
    if (f2u(q) == f2u(want_q)) continue;
    const std::uint32_t got = nvfp4_scale_code_fast(v), want = e4m3_code_rne_sat(want_q);
    const bool normal_quotient = want_q >= 0x1p-126f && b != 0x7F800000u;
    if (got != want || normal_quotient) {
#pragma omp critical
      if (bad + bad_q < 5)
        ADD_FAILURE() << "v bits " << std::hex << b << ": quotient " << f2u(q) << " want " << f2u(want_q) << ", code " << got
                      << " want " << want;
      if (got != want) ++bad;
      else ++bad_q;
    }
  }
  EXPECT_EQ(nvfp4_scale_code_fast(u2f(0x7F800000u)), 0x7Eu);  // +Inf saturates to 448
  EXPECT_EQ(nvfp4_scale_code_fast(0.0f), 0u);
  EXPECT_EQ(bad, 0) << bad << " codes of " << n;
  EXPECT_EQ(bad_q, 0) << bad_q << " normal quotients of " << n;
}

// mx_codes_bf16x2 / mx_qdq_bf16x2 (the kernels' bf16 MX path, two elements per word) against the
// reference encoder and decode: every finite bf16 pattern in either lane, every scale of the fast
// range, each MX float format; without the upper clamp on the inputs the amax rules allow (|x| below
// 2^(emax + 1 + e)), with it on all.
TEST(FastBf16Pairs, CodesAndQdqMatchTheReferenceForEveryBf16AndScale) {
  using namespace mxq::core;
  long bad = 0, n = 0;
  auto check = [&](auto et) {
    constexpr ElemType ET = decltype(et)::value;
    constexpr FloatSpec f = Elem<ET>::spec;
    constexpr int lo_e = MxFastRange<ET>::lo, hi_e = MxFastRange<ET>::hi;
#pragma omp parallel for reduction(+ : bad, n) schedule(dynamic)
    for (int e = lo_e; e <= hi_e; ++e) {
      const MxPair k = mx_pair<ET>(e);
      const std::uint32_t bound = std::uint32_t(f.emax + 1 + e + 127) << 23;  // 2^(emax + 1 + e)
      for (std::uint32_t h = 0; h < 0x10000; ++h) {
        if ((h & 0x7F80u) == 0x7F80u) continue;  // NaN/Inf blocks take another path
        const std::uint32_t partner = (h * 40503u + 0x3F80u) & 0xFFFFu;  // any finite lane beside it
        const std::uint32_t p2 = (partner & 0x7F80u) == 0x7F80u ? 0x3F80u : partner;
        // the amax rules' lanes are both below the bound
        const std::uint32_t p2_in = std::min(p2 & 0x7FFFu, (bound >> 16) - 1u) | (p2 & 0x8000u);
        for (int lane = 0; lane < 2; ++lane) {
          const std::uint32_t code = encode_scaled(h << 16, e, f);
          const std::uint32_t q = mx_dequant_bits(code, std::uint8_t(e + kE8M0Bias), f, mxq::DType::bf16);
          const bool in_range = ((h << 16) & 0x7FFFFFFFu) < bound;
          for (int clamp = 0; clamp < 2; ++clamp) {
            if (!clamp && !in_range) continue;
            const std::uint32_t other = clamp ? p2 : p2_in;
            const std::uint32_t w = lane ? (h << 16) | other : (other << 16) | h;
            const auto [gc, gq] = pair_lane<ET>(w, k, clamp, lane);
            ++n;
            if (gc != code || gq != q) {
#pragma omp critical
              if (bad < 5)
                ADD_FAILURE() << "format " << int(ET) << " e=" << e << " x=" << std::hex << h << " lane " << lane << " clamp " << clamp
                              << ": code " << gc << " want " << code << ", qdq " << gq << " want " << q;
              ++bad;
            }
          }
        }
      }
    }
  };
  for_each_mx_float(check);
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// rto_bf16x2 then mx_codes_bf16x2 / mx_qdq_bf16x2 (the rotated kernels' path for an fp32 chunk)
// against the reference on the fp32 value itself: every finite bf16 pattern with each kind of dropped
// low half (the smallest, just below and at the bf16 midpoint, just above it, the largest, and a mix),
// at both ends of each format's fast range and a stride of scales between, with and without the upper
// clamp. Subnormal fp32 inputs are included (the bf16 patterns with exponent bits 0).
TEST(FastBf16Pairs, RoundToOddThenPairsMatchTheFp32Reference) {
  using namespace mxq::core;
  long bad = 0, n = 0;
  const std::uint32_t lows[] = {0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x5A5Au};
  auto check = [&](auto et) {
    constexpr ElemType ET = decltype(et)::value;
    constexpr FloatSpec f = Elem<ET>::spec;
    constexpr int lo_e = MxFastRange<ET>::lo, hi_e = MxFastRange<ET>::hi;
    std::vector<int> es;
    for (int e = lo_e; e <= hi_e; ++e)
      if (e < lo_e + 8 || e > hi_e - 8 || (e - lo_e) % 9 == 0) es.push_back(e);
#pragma omp parallel for reduction(+ : bad, n) schedule(dynamic)
    for (int ei = 0; ei < int(es.size()); ++ei) {
      const int e = es[ei];
      const MxPair k = mx_pair<ET>(e);
      const std::uint32_t bound = std::uint32_t(f.emax + 1 + e + 127) << 23;  // 2^(emax + 1 + e)
      for (std::uint32_t h = 0; h < 0x10000; ++h) {
        if ((h & 0x7F80u) == 0x7F80u) continue;  // NaN/Inf blocks take another path
        for (const std::uint32_t low : lows) {
          const std::uint32_t x = (h << 16) | low;
          const std::uint32_t code = encode_scaled(x, e, f);
          const std::uint32_t q = mx_dequant_bits(code, std::uint8_t(e + kE8M0Bias), f, mxq::DType::bf16);
          const bool in_range = (x & 0x7FFFFFFFu) < bound;
          const std::uint32_t other = 0x3F80u;  // 1.0 beside it, below every bound of the range
          const std::uint32_t w = rto_bf16x2(x, other << 16);
          for (int clamp = 0; clamp < 2; ++clamp) {
            if (!clamp && !in_range) continue;
            const auto [gc, gq] = pair_lane<ET>(w, k, clamp, 0);
            ++n;
            if (gc != code || gq != q) {
#pragma omp critical
              if (bad < 5)
                ADD_FAILURE() << "format " << int(ET) << " e=" << e << " x=" << std::hex << x << " (rto " << (w & 0xFFFFu)
                              << ") clamp " << clamp << ": code " << gc << " want " << code << ", qdq " << gq << " want " << q;
              ++bad;
            }
          }
        }
      }
    }
  };
  for_each_mx_float(check);
  EXPECT_EQ(bad, 0) << bad << " of " << n;
  // round to odd itself: exact halves kept, dropped bits leave the last bit set, NaN stays NaN
  EXPECT_EQ(rto_bf16x2(0x3F800000u, 0xBF800000u), 0xBF803F80u);
  EXPECT_EQ(rto_bf16x2(0x3F800001u, 0x3F81FFFFu), 0x3F813F81u);
  EXPECT_EQ(rto_bf16x2(0x7F800001u, 0x80000000u), 0x80007F81u);
  EXPECT_EQ(rto_bf16x2(0xFF800000u, 0x00000001u), 0x0001FF80u);
}

// e2m1_push (core/e2m1_pack.hpp) against the codec's encode_scaled, at every scale of the fast range:
// every bf16 magnitude pattern from 2^(e-6) up, each with six kinds of dropped low half (exact, just
// above, just below and at a bf16 midpoint, the largest, a mix: every E2M1 tie and its neighbours are
// among them), both signs, infinities, zeros and fp32 subnormals; then, at three scales, every fp32
// with |x| in [2^(e-5), 2^(e+3)) (the amax rules' range), pushed eight at a time so that the words'
// nibble order is checked too.
TEST(FastE2m1Pack, PushedCodesMatchTheCodec) {
  using namespace mxq::core;
  constexpr FloatSpec f = Elem<ElemType::e2m1>::spec;
  constexpr int lo_e = MxFastRange<ElemType::e2m1>::lo, hi_e = MxFastRange<ElemType::e2m1>::hi;
  static_assert(lo_e == -125 && hi_e == 102);
  long bad = 0, n = 0;
  // (bad is counted at the call sites: inside the parallel loops it is each thread's own copy)
  auto report = [](int e, std::uint32_t x, std::uint32_t got, std::uint32_t want) {
#pragma omp critical
    ADD_FAILURE() << "e=" << e << " x=" << std::hex << x << ": code " << got << " want " << want;
  };
  const std::uint32_t lows[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu};
#pragma omp parallel for reduction(+ : bad, n) schedule(dynamic)
  for (int e = lo_e; e <= hi_e; ++e) {
    const E2m1Pack k = e2m1_pack_consts(e);
    auto one = [&](std::uint32_t x) {
      const std::uint32_t got = e2m1_push(0x12345678u, x, k) >> 28, want = encode_scaled(x, e, f);
      ++n;
      if (got != want && bad++ < 5) report(e, x, got, want);
    };
    const std::uint32_t from = std::uint32_t(std::max(e + 127 - 6, 1)) << 23;
    for (std::uint32_t h = from >> 16; h <= 0x7F80u; ++h)
      for (std::uint32_t low : lows) {
        if (h == 0x7F80u && low) continue;  // NaN
        for (std::uint32_t sign : {0u, 0x80000000u}) one(sign | (h << 16) | low);
      }
    for (std::uint32_t x : {0u, 1u, 0x3FFFFFu, 0x7FFFFFu, 0x800000u, 0x1234567u}) {
      one(x);
      one(x | 0x80000000u);
    }
  }
  // Every fp32 in the amax rules' range at three scales, eight codes to a word.
  for (int e : {lo_e, 0, hi_e}) {
    const E2m1Pack k = e2m1_pack_consts(e);
    const std::uint32_t b0 = std::uint32_t(std::max(e + 127 - 5, 0)) << 23, b1 = std::uint32_t(e + 127 + 3) << 23;
#pragma omp parallel for reduction(+ : bad, n) schedule(static)
    for (long long w0 = 0; w0 < 2LL * (b1 - b0); w0 += 8) {
      std::uint32_t w = 0, want = 0, xs[8];
      for (int i = 0; i < 8; ++i) {
        const long long j = w0 + i;
        xs[i] = (j & 1 ? 0x80000000u : 0u) | (b0 + std::uint32_t(j >> 1));
        w = e2m1_push(w, xs[i], k);
        want |= encode_scaled(xs[i], e, f) << (4 * i);
      }
      n += 8;
      if (w != want && bad++ < 5) report(e, xs[0], w, want);
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// NVFP4's element codes by e2m1_push at scale 1 on the product nvfp4_product(x, m) (the kernels'
// nvfp4_push_codes) against nvfp4_encode_rne(x, m): every finite bf16 pattern with four kinds of low
// half (a NaN/Inf x makes a NaN/Inf block, whose codes are zeroed), under multipliers from 0 and the
// smallest subnormal to FLT_MAX and +Inf.
TEST(FastE2m1Pack, Nvfp4ProductCodesMatchTheEncoder) {
  using namespace mxq::core;
  const E2m1Pack k = e2m1_pack_consts(0);
  const float ms[] = {0.0f, u2f(1u), 1e-30f, 0x1p-20f, 0.013392857f, 0.7f, 1.0f, 1.5f, 1.0f / 3.0f, 1234.5f, 3.3e5f, 1e30f,
                      u2f(0x7F7FFFFFu), u2f(0x7F800000u)};
  long bad = 0, n = 0;
#pragma omp parallel for reduction(+ : bad, n) schedule(dynamic)
  for (int h = 0; h < 0x10000; ++h) {
    if ((h & 0x7F80) == 0x7F80) continue;  // NaN and +-Inf: their blocks' codes are zeroed
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x8000u, 0xFFFFu}) {
      const std::uint32_t x = (std::uint32_t(h) << 16) | low;
      for (float m : ms) {
        const std::uint32_t got = e2m1_push(0u, f2u(nvfp4_product(x, m)), k) >> 28, want = nvfp4_encode_rne(x, m);
        ++n;
        if (got != want) {
#pragma omp critical
          if (bad < 5) ADD_FAILURE() << "x=" << std::hex << x << " m=" << m << ": code " << got << " want " << want;
          ++bad;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// nvfp4_bf16_table (the kernels' NVFP4 bf16 outputs from two divisions) against the reference
// decode: every E4M3 block scale that is not NaN (0 and the subnormals included) under S at the ends
// of recip_div's range and at random significands across it.
TEST(FastNvfp4, Bf16TableFromTwoDivisionsMatchesTheDecode) {
  using namespace mxq::core;
  std::mt19937 rng(7);
  std::vector<float> ss = {kRecipDivMinS, kRecipDivMaxS, 1.0f, 448.0f * 6.0f, 1.0f / 3.0f, 0x1.fffffep31f, 0x1.000002p-32f};
  for (int k = 0; k < 3000; ++k) ss.push_back(std::ldexp(1.0f + float(rng() & 0x7FFFFF) * 0x1p-23f, int(rng() % 64) - 32));
  long bad = 0, n = 0;
  for (const float S : ss)
    for (std::uint32_t sc = 0; sc < 0x7F; ++sc) {
      std::uint32_t t[4];
      nvfp4_bf16_table(decode_f32(sc, spec_e4m3()), S, div_rn(1.0f, S), t);
      for (std::uint32_t m = 0; m < 8; ++m) {
        const std::uint32_t want = f32_to_dtype_bits(nvfp4_decode(m, sc, S), mxq::DType::bf16);
        const std::uint32_t got = (t[m / 2] >> (16 * (m % 2))) & 0xFFFFu;
        ++n;
        if (got != want && bad++ < 5)
          ADD_FAILURE() << "S=" << S << " scale code " << sc << " m=" << m << ": got " << std::hex << got << " want " << want;
      }
    }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// e4m3_bf16_hi (the kernels' MXFP8 dequantize to bf16) against mx_dequant_bits: every code that is
// not NaN under every scale of its range.
TEST(FastE4m3, Bf16DequantMatchesTheReferenceForEveryCodeAndScale) {
  using namespace mxq::core;
  long bad = 0, n = 0;
  for (int e = -117; e <= 119; ++e)
    for (std::uint32_t code = 0; code < 256; ++code) {
      if ((code & 0x7Fu) == 0x7Fu) continue;
      const std::uint32_t want = mx_dequant_bits(code, std::uint8_t(e + kE8M0Bias), Elem<ElemType::e4m3>::spec, mxq::DType::bf16);
      const std::uint32_t got = e4m3_bf16_hi(code, pow2f(e), pow2f(e + 1)) >> 16;
      ++n;
      if (got != want && bad++ < 5)
        ADD_FAILURE() << "code=" << std::hex << code << std::dec << " e=" << e << ": got " << std::hex << got << " want " << want;
    }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

// to_dtype_bits_nonnan (the CUDA rotated dequantize's output rounding) is f32_to_dtype_bits off NaN:
// every 97th fp32 pattern (every residue of the low bits, every exponent) and the neighbourhood of
// every bf16 / fp16 rounding boundary's sign, for the three output dtypes.
TEST(FastOutput, NonNanRoundingMatchesTheCodec) {
  auto check = [](std::uint32_t u, long& bad) {
    const float v = mxq::core::u2f(u);
    if (v != v) return;
    const std::uint32_t b16 = mxq::core::to_dtype_bits_nonnan<mxq::DType::bf16>(v),
                        h16 = mxq::core::to_dtype_bits_nonnan<mxq::DType::f16>(v),
                        f32 = mxq::core::to_dtype_bits_nonnan<mxq::DType::f32>(v);
    if (b16 != mxq::core::f32_to_dtype_bits(v, mxq::DType::bf16) || h16 != mxq::core::f32_to_dtype_bits(v, mxq::DType::f16) ||
        f32 != mxq::core::f32_to_dtype_bits(v, mxq::DType::f32)) {
      if (bad++ < 5) ADD_FAILURE() << std::hex << "fp32 0x" << u << ": bf16 0x" << b16 << " f16 0x" << h16 << " f32 0x" << f32;
    }
  };
  long bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (std::int64_t i = 0; i < (std::int64_t(1) << 32) / 97; ++i) check(std::uint32_t(i * 97), bad);
  for (std::uint32_t e = 0; e < 512; ++e)  // each sign and exponent: the patterns around the halfway bits
    for (std::uint32_t m : {0x0u, 0x1000u, 0x7FFFu, 0x8000u, 0x8001u, 0x18000u, 0xFFFFu, 0x7FFFFFu, 0x3FFFFFu, 0x400000u, 0xFFFu, 0x1FFFu})
      check((e << 23) | m, bad);
  EXPECT_EQ(bad, 0);
}

// The fast CPU path's quest statistics (src/cpu/common/reductions.hpp): quest_arg_direct and, where the CPU
// has AVX2, quest_args8_avx2 (eight blocks in vector lanes), and core::quest_arg's compile-time-size
// form give core::quest_arg's fp32 bits (runtime size) for every block, at G = 32 (MX quest) and G = 16
// (NVFP4 quest): random blocks over many magnitudes, constant blocks (sigma 0: the 1e-8 term alone), a
// single non-zero element, tiny and huge values, sums that overflow (NaN / Inf statistics); bf16 and
// fp32 storage.
#include "cpu/common/elements.hpp"
#include "cpu/common/reductions.hpp"
#include "cpu/common/sr_words.hpp"

template <int G>
void check_quest_statistics() {
  std::mt19937 rng(21 + G);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto block = [&](int kind, float* v) {
    const float scale = std::ldexp(1.0f, int(rng() % 200) - 100);
    const int one = int(rng() % G);
    for (int i = 0; i < G; ++i) {
      switch (kind) {
        case 0: v[i] = nd(rng) * scale; break;
        case 1: v[i] = scale; break;  // constant
        case 2: v[i] = i == one ? scale : 0.0f; break;
        case 3: v[i] = ((one % 2 ? i : i / 2) % 2 ? -3.0e38f : 3.0e38f); break;  // sums overflow: +-Inf, or NaN
        default: v[i] = nd(rng) * scale * (rng() % 7 == 0 ? 300.0f : 1.0f); break;  // outliers
      }
    }
  };
  auto same = [](float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (a != a && b != b); };
  long bad = 0, n = 0;
  for (int rep = 0; rep < 4000; ++rep) {
    alignas(64) float v[8 * G];
    for (int j = 0; j < 8; ++j) block(int(rng() % 5), v + G * j);
    std::uint16_t b16[8 * G];
    for (int i = 0; i < 8 * G; ++i) {
      b16[i] = mxq::f32_to_bf16(v[i]);
      if (!std::isfinite(mxq::bf16_to_f32(b16[i]))) b16[i] = 0x3F80;
    }
    float vb[8 * G];
    for (int i = 0; i < 8 * G; ++i) vb[i] = mxq::bf16_to_f32(b16[i]);
    for (int dt = 0; dt < 2; ++dt) {
      const float* src = dt ? v : vb;
      float want[8], fixed[8], direct[8], lanes[8] = {}, lanes2[8] = {}, lanes512[8] = {};
      for (int j = 0; j < 8; ++j) {
        want[j] = mxq::core::quest_arg(src + G * j, G);
        fixed[j] = mxq::core::quest_arg<G>(src + G * j);
        direct[j] = dt ? mxq::cpu::quest_arg_direct<DType::f32, G>(reinterpret_cast<const std::uint32_t*>(v) + G * j)
                       : mxq::cpu::quest_arg_direct<DType::bf16, G>(b16 + G * j);
      }
#if defined(MXQ_CPU_AVX2)
      // the dispatching form, and each SIMD form directly (AVX2's, and AVX-512's where the CPU has it)
      const bool avx2 = mxq::cpu::cpu_has_avx2(), avx512 = mxq::cpu::cpu_has_avx512();
      const std::uint32_t* v32 = reinterpret_cast<const std::uint32_t*>(v);
      if (avx2) {
        if (dt) mxq::cpu::quest_args8_avx2<DType::f32, G>(v32, lanes);
        else mxq::cpu::quest_args8_avx2<DType::bf16, G>(b16, lanes);
        if (dt) mxq::cpu::quest_args8_avx2_form<DType::f32, G>(v32, lanes2);
        else mxq::cpu::quest_args8_avx2_form<DType::bf16, G>(b16, lanes2);
      }
      if (avx512) {
        if (dt) mxq::cpu::quest_args8_avx512<DType::f32, G>(v32, lanes512);
        else mxq::cpu::quest_args8_avx512<DType::bf16, G>(b16, lanes512);
      }
#else
      const bool avx2 = false, avx512 = false;
      float lanes2[8] = {}, lanes512[8] = {};
#endif
      for (int j = 0; j < 8; ++j) {
        ++n;
        const bool ok = same(fixed[j], want[j]) && same(direct[j], want[j]) &&
                        (!avx2 || (same(lanes[j], want[j]) && same(lanes2[j], want[j]))) && (!avx512 || same(lanes512[j], want[j]));
        if (!ok && bad++ < 5)
          ADD_FAILURE() << "G " << G << (dt ? " f32" : " bf16") << " block " << j << ": want " << want[j] << " fixed "
                        << fixed[j] << " direct " << direct[j] << " dispatched " << lanes[j] << " avx2 " << lanes2[j]
                        << " avx512 " << lanes512[j];
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}
TEST(FastQuest, BlockStatisticsMatchTheCodec) {
  check_quest_statistics<32>();
  check_quest_statistics<16>();
}

// The fast path's stochastic-rounding words (sr_words: Philox eight counters at a time in AVX2 lanes
// where the CPU has it, the fields read off the outputs laid end to end) against core::sr_bits one
// element at a time: every field width, windows of 1..256 elements at every alignment, and counters
// whose low word wraps inside a group of eight (the 64-bit counter's carry into its high word).
TEST(FastStochastic, ComparisonWordsMatchTheCodec) {
  std::mt19937_64 rng(33);
  long bad = 0, n = 0;
  for (int B : {32, 16, 8}) {
    const int lp = B == 8 ? 4 : (B == 16 ? 3 : 2);
    // the last three windows cross 2^64 (the element index wraps: its words restart at counter 0)
    std::vector<std::uint64_t> starts = {0, 12345, (std::uint64_t(1) << (32 + lp)) - 37,
                                         (std::uint64_t(0xFFFFFFFF) << (32 + lp)) - 5, ~std::uint64_t(0) - 300,
                                         ~std::uint64_t(0) - 100, ~std::uint64_t(0) - 4, ~std::uint64_t(0)};
    for (int k = 0; k < 40; ++k) starts.push_back(rng());
    for (std::uint64_t j0 : starts)
      for (int len : {1, 7, 32, 100, 256}) {
        const std::uint64_t seed = rng();
        std::uint32_t rnd[256];
        mxq::cpu::sr_words(seed, j0, len, B, rnd);
        for (int i = 0; i < len; ++i, ++n)
          if (rnd[i] != mxq::core::sr_bits(seed, j0 + std::uint64_t(i), B) && bad++ < 5)
            ADD_FAILURE() << "B " << B << " j " << (j0 + std::uint64_t(i)) << ": got " << std::hex << rnd[i] << " want "
                          << mxq::core::sr_bits(seed, j0 + std::uint64_t(i), B);
      }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n;
}

#if defined(MXQ_CPU_AVX2)
// Each SIMD form of Philox (philox8_avx2; philox8_avx512 where the CPU has AVX-512F, which sr_words
// takes first, so the one above covers only that one here) against core::philox4x32_10 per counter:
// random counters and keys, counters whose low word wraps inside a group of eight, and the last
// counters below 2^64.
TEST(FastStochastic, PhiloxFormsMatchTheCodec) {
  std::mt19937_64 rng(35);
  std::vector<std::uint64_t> starts = {0, (std::uint64_t(1) << 32) - 3, (std::uint64_t(7) << 32) - 8, ~std::uint64_t(0) - 15,
                                       ~std::uint64_t(0) - 4};
  for (int k = 0; k < 40; ++k) starts.push_back(rng());
  using Form = int (*)(std::uint64_t, int, std::uint32_t, std::uint32_t, std::uint32_t*);
  std::vector<std::pair<const char*, Form>> forms;
  if (mxq::cpu::cpu_has_avx2()) forms.push_back({"avx2", &mxq::cpu::philox8_avx2});
  if (mxq::cpu::cpu_has_avx512()) forms.push_back({"avx512", &mxq::cpu::philox8_avx512});
  if (forms.empty()) GTEST_SKIP() << "no AVX2 on this CPU (or MXQ_CPU_NO_AVX2 set)";
  long bad = 0;
  for (const auto& [name, form] : forms)
    for (std::uint64_t c0 : starts) {
      const std::uint64_t seed = rng();
      const std::uint32_t k0 = std::uint32_t(seed), k1 = std::uint32_t(seed >> 32);
      for (const int nc : {19, 31}) {  // whole groups of eight: 16 (the AVX-512 form's pair of groups), 24 (and one more)
        std::uint32_t stream[4 * 32];  // counter c's words at 4 c .. 4 c + 3
        const int done = nc / 8 * 8;
        EXPECT_EQ(form(c0, nc, k0, k1, stream), done) << name;
        for (int c = 0; c < done; ++c) {
          const std::uint64_t cc = c0 + std::uint64_t(c);
          const mxq::core::U32x4 e = mxq::core::philox4x32_10(mxq::core::U32x4{{std::uint32_t(cc), std::uint32_t(cc >> 32), 0u, 0u}}, k0, k1);
          for (int j = 0; j < 4; ++j)
            if (stream[4 * c + j] != e.v[j] && bad++ < 5)
              ADD_FAILURE() << name << " counter " << cc << " word " << j << ": got " << std::hex << stream[4 * c + j] << " want " << e.v[j];
        }
      }
    }
  EXPECT_EQ(bad, 0);
}

// The SIMD forms of sr_code_unscaled (sr_mags8_avx2; sr_mags16_avx512 where the CPU has AVX-512F),
// which the NVFP4 and MX stochastic-rounding paths use, against core::sr_code_unscaled lane by lane:
// every element format but INT8, scale exponents across MxFastRange (the ends included), every
// exponent field 0..255 (255 read as +Inf: an NVFP4 product can overflow), mantissas 0, 1, the
// largest and random ones, and comparison words at the threshold, just below it, 0, ~0 and random.
template <ElemType ET>
__attribute__((target("avx2"))) void sr_mags_avx2_lanes(const std::uint32_t* a, int lo, const std::uint32_t* w, std::uint32_t* out) {
  const __m256i r = mxq::cpu::sr_mags8_avx2<ET>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), _mm256_set1_epi32(lo),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
}
template <ElemType ET>
__attribute__((target("avx512f"))) void sr_mags_avx512_lanes(const std::uint32_t* a, int lo, const std::uint32_t* w, std::uint32_t* out) {
  _mm512_storeu_si512(out, mxq::cpu::sr_mags16_avx512<ET>(_mm512_loadu_si512(a), _mm512_set1_epi32(lo), _mm512_loadu_si512(w)));
}
template <ElemType ET>
long sr_mags_mismatches(std::mt19937& rng) {
  constexpr core::FloatSpec f = core::Elem<ET>::spec;
  const bool avx512 = mxq::cpu::cpu_has_avx512();
  long bad = 0;
  std::vector<int> es = {core::MxFastRange<ET>::lo, core::MxFastRange<ET>::hi, 0};
  for (int k = 0; k < 6; ++k) es.push_back(core::MxFastRange<ET>::lo + int(rng() % std::uint32_t(core::MxFastRange<ET>::hi - core::MxFastRange<ET>::lo + 1)));
  for (int e : es) {
    const int lo = f.emin + e + 127;
    for (std::uint32_t fld = 0; fld < 256; ++fld) {
      alignas(64) std::uint32_t a[16], w[16], o8[16], o16[16];
      for (int rep = 0; rep < 2; ++rep) {
        for (int i = 0; i < 16; ++i) {
          const std::uint32_t m = fld == 255 ? 0u : (i == 0 ? 0u : (i == 1 ? 1u : (i == 2 ? 0x7FFFFFu : std::uint32_t(rng()) & 0x7FFFFFu)));
          a[i] = (fld << 23) | m;
          // the word: at the threshold, just below, 0, ~0 or random (the threshold from the codec:
          // the smallest word that does not round up, found from the codec's result at word 0 and ~0)
          const std::uint32_t up0 = core::sr_code_unscaled<ET>(a[i], e, 0u), upmax = core::sr_code_unscaled<ET>(a[i], e, ~0u);
          std::uint32_t word = std::uint32_t(rng());
          if (up0 != upmax) {  // a threshold exists: binary search it
            std::uint32_t lo_w = 0, hi_w = ~0u;
            while (hi_w - lo_w > 1) {
              const std::uint32_t mid = lo_w + (hi_w - lo_w) / 2;
              (core::sr_code_unscaled<ET>(a[i], e, mid) == up0 ? lo_w : hi_w) = mid;
            }
            const int pick = (i + rep) % 4;
            word = pick == 0 ? hi_w : (pick == 1 ? lo_w : (pick == 2 ? 0u : ~0u));
          }
          w[i] = word;
        }
        sr_mags_avx2_lanes<ET>(a, lo, w, o8);
        sr_mags_avx2_lanes<ET>(a + 8, lo, w + 8, o8 + 8);
        if (avx512) sr_mags_avx512_lanes<ET>(a, lo, w, o16);
        for (int i = 0; i < 16; ++i) {
          const std::uint32_t want = core::sr_code_unscaled<ET>(a[i], e, w[i]);
          for (int form = 0; form < (avx512 ? 2 : 1); ++form) {
            const std::uint32_t got = form ? o16[i] : o8[i];
            if (got != want && bad++ < 5)
              ADD_FAILURE() << (form ? "avx512" : "avx2") << " " << to_string(ET) << " e " << e << " x bits " << std::hex << a[i]
                            << " word " << w[i] << ": got " << got << " want " << want;
          }
        }
      }
    }
  }
  return bad;
}
TEST(FastStochastic, SimdCodeFormsMatchTheCodec) {
  if (!mxq::cpu::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU (or MXQ_CPU_NO_AVX2 set)";
  std::mt19937 rng(41);
  EXPECT_EQ(sr_mags_mismatches<ElemType::e2m1>(rng), 0);
  EXPECT_EQ(sr_mags_mismatches<ElemType::e2m3>(rng), 0);
  EXPECT_EQ(sr_mags_mismatches<ElemType::e3m2>(rng), 0);
  EXPECT_EQ(sr_mags_mismatches<ElemType::e4m3>(rng), 0);
  EXPECT_EQ(sr_mags_mismatches<ElemType::e5m2>(rng), 0);
}
#endif
