// Exhaustive tests of the scalar codec against the independent oracle (tests/oracle.hpp).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/codec.hpp"
#include "core/fastmath.hpp"
#include <mxq/ops.hpp>

#include "oracle.hpp"

using namespace mxq;
using namespace mxq::core;

namespace {

constexpr ElemType kElems[] = {ElemType::e2m1, ElemType::e2m3, ElemType::e3m2,
                               ElemType::e4m3, ElemType::e5m2, ElemType::int8};

float bf16f(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t(h) << 16); }

// Checks encode_scaled(x, e) against the oracle for every e that puts x near the element's range
// (saturation, normal, subnormal and underflow), plus the extreme scales.
void check_value(float x, ElemType t, oracle::Mismatches& mm) {
  if (!std::isfinite(x)) return;
  const FloatSpec s = elem_spec(t);
  const oracle::Fmt& f = oracle::fmt(t);
  int lo = -127, hi = 127;
  if (x != 0.0f) {
    const int fl = oracle::floor_log2(std::fabs(double(x)));
    lo = std::max(-127, fl - s.emax - 14);
    hi = std::min(127, fl - s.emax + 3);
  }
  auto one = [&](int e) {
    const std::uint32_t got = encode_scaled(std::bit_cast<std::uint32_t>(x), e, s);
    const std::uint32_t want = oracle::encode(f, std::ldexp(double(x), -e));
    if (got != want)
      mm.add(std::string(f.name) + " x=" + std::to_string(x) + " (" + oracle::hex(std::bit_cast<std::uint32_t>(x)) +
             ") e=" + std::to_string(e) + ": got " + oracle::hex(got) + " want " + oracle::hex(want));
  };
  for (int e = lo; e <= hi; ++e) one(e);
  if (lo > -127) one(-127);
  if (hi < 127) one(127);
}

}  // namespace

TEST(Codec, AllBf16PatternsThroughEveryElementFormat) {
  for (ElemType t : kElems) {
    oracle::Mismatches mm(std::string("bf16 sweep, ") + oracle::fmt(t).name);
    for (std::uint32_t h = 0; h < 65536; ++h) check_value(bf16f(std::uint16_t(h)), t, mm);
  }
}

TEST(Codec, AllFp16PatternsThroughEveryElementFormat) {
  for (ElemType t : kElems) {
    oracle::Mismatches mm(std::string("fp16 sweep, ") + oracle::fmt(t).name);
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const _Float16 hv = std::bit_cast<_Float16>(std::uint16_t(h));
      check_value(static_cast<float>(hv), t, mm);
    }
  }
}

TEST(Codec, Fp32SweepThroughEveryElementFormat) {
  std::mt19937 rng(1234);
  for (ElemType t : kElems) {
    oracle::Mismatches mm(std::string("fp32 sweep, ") + oracle::fmt(t).name);
    for (int i = 0; i < 40000; ++i) check_value(std::bit_cast<float>(std::uint32_t(rng())), t, mm);
    // Values next to every grid point and midpoint (ties and their neighbours) at scale 2^0.
    const oracle::Fmt& f = oracle::fmt(t);
    for (std::size_t c = 0; c + 1 < f.vals.size(); ++c) {
      for (double v : {f.vals[c], 0.5 * (f.vals[c] + f.vals[c + 1])}) {
        const float fv = float(v);
        for (float w : {fv, std::nextafter(fv, 0.0f), std::nextafter(fv, 1e30f)}) {
          check_value(w, t, mm);
          check_value(-w, t, mm);
        }
      }
    }
  }
}

TEST(Codec, E2M1TiesSaturationAndZeros) {
  const FloatSpec s = kE2M1;
  auto enc = [&](float v) { return encode_scaled(std::bit_cast<std::uint32_t>(v), 0, s); };
  // Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
  EXPECT_EQ(enc(0.25f), 0u);
  EXPECT_EQ(enc(0.75f), 2u);   // 1.0
  EXPECT_EQ(enc(1.25f), 2u);   // 1.0
  EXPECT_EQ(enc(1.75f), 4u);   // 2.0
  EXPECT_EQ(enc(2.5f), 4u);    // 2.0
  EXPECT_EQ(enc(3.5f), 6u);    // 4.0
  EXPECT_EQ(enc(5.0f), 6u);    // 4.0
  EXPECT_EQ(enc(std::nextafter(5.0f, 9.f)), 7u);  // just above a tie
  // Saturation from both sides.
  EXPECT_EQ(enc(6.0f), 7u);
  EXPECT_EQ(enc(std::nextafter(6.0f, 0.f)), 7u);
  EXPECT_EQ(enc(7.0f), 7u);  // RNE would give 8: saturates
  EXPECT_EQ(enc(1e30f), 7u);
  EXPECT_EQ(enc(-1e30f), 15u);
  // Signed zeros: -0 and negatives that round to zero keep the sign.
  EXPECT_EQ(enc(0.0f), 0u);
  EXPECT_EQ(enc(-0.0f), 8u);
  EXPECT_EQ(enc(-0.2f), 8u);
  // The smallest fp32 subnormal scaled by 2^127 is 2^-22: rounds to zero.
  EXPECT_EQ(encode_scaled(1u, -127, s), 0u);
}

TEST(Codec, SubnormalInputsScaledUpAreExact) {
  // 2^-127 (fp32 subnormal) times 2^127 is 1.0: code 2 in E2M1; 1.5 * 2^-127 -> 1.5: code 3.
  EXPECT_EQ(encode_scaled(0x00400000u, -127, kE2M1), 2u);
  EXPECT_EQ(encode_scaled(0x00600000u, -127, kE2M1), 3u);
  // E4M3 smallest subnormal 2^-9 from a bf16 subnormal 2^-133 scaled by 2^124.
  EXPECT_EQ(encode_scaled(std::bit_cast<std::uint32_t>(std::ldexp(1.0f, -133)), -124, kE4M3), 1u);
}

TEST(Codec, EncodeF32SpecialsSaturateOrNaN) {
  EXPECT_EQ(encode_f32(0x7F800000u, kE4M3), 0x7Eu);   // +Inf -> 448
  EXPECT_EQ(encode_f32(0xFF800000u, kE5M2), 0xFBu);   // -Inf -> -57344
  EXPECT_EQ(encode_f32(0x7FC00000u, kE4M3), 0x7Fu);   // NaN
  EXPECT_EQ(encode_f32(0x7FC00000u, kE5M2), 0x7Eu);
  EXPECT_EQ(encode_f32(std::bit_cast<std::uint32_t>(448.0f), kE4M3), 0x7Eu);
  EXPECT_EQ(encode_f32(std::bit_cast<std::uint32_t>(464.0f), kE4M3), 0x7Eu);  // tie to 480 would overflow
  EXPECT_EQ(encode_f32(std::bit_cast<std::uint32_t>(1e6f), kE5M2), 0x7Bu);    // no Inf from finite input
}

TEST(Codec, DecodeEveryCode) {
  for (ElemType t : kElems) {
    const FloatSpec s = elem_spec(t);
    const oracle::Fmt& f = oracle::fmt(t);
    oracle::Mismatches mm(std::string("decode ") + f.name);
    for (std::uint32_t c = 0; c < (1u << s.bits); ++c) {
      const double want = oracle::decode(f, c);
      const float got = decode_f32(c, s);
      const bool ok = std::isnan(want) ? !std::isfinite(got) : (double(got) == want && std::signbit(got) == std::signbit(want));
      if (!ok) mm.add(std::string(f.name) + " code " + oracle::hex(c) + ": got " + std::to_string(got) + " want " + std::to_string(want));
    }
  }
  EXPECT_TRUE(std::isinf(decode_f32(0x7C, kE5M2)));
  EXPECT_TRUE(std::isnan(decode_f32(0x7F, kE4M3)));
  EXPECT_EQ(decode_f32(0x80, kINT8), -2.0f);  // -128 decodes although quantize never writes it
}

TEST(Codec, F16ToF32AllPatterns) {
  oracle::Mismatches mm("f16_to_f32");
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float want = static_cast<float>(std::bit_cast<_Float16>(std::uint16_t(h)));
    const float got = f16_to_f32(std::uint16_t(h));
    if (std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(got) && !(std::isnan(want) && std::isnan(got)))
      mm.add("h=" + oracle::hex(h));
  }
}

namespace {
// Independent RNE to bf16 by comparing the two neighbouring bf16 values in double.
std::uint16_t oracle_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t mag = u & 0x7FFFFFFFu;
  const std::uint32_t lo = mag >> 16, hi = lo + 1;
  const double a = std::fabs(double(x));
  const double vl = std::fabs(double(bf16f(std::uint16_t(lo)))), vh = hi >= 0x7F80 ? std::ldexp(1.0, 128) : double(bf16f(std::uint16_t(hi)));
  std::uint32_t r = (a - vl < vh - a) ? lo : ((vh - a < a - vl) ? hi : (lo % 2 == 0 ? lo : hi));
  if (r >= 0x7F80) r = 0x7F7F;  // saturate
  return static_cast<std::uint16_t>(r | (sign >> 16));
}
}  // namespace

TEST(Codec, F32ToBf16AndF16RoundAndSaturate) {
  std::mt19937 rng(99);
  oracle::Mismatches mb("f32_to_bf16_sat"), mh("f32_to_f16_sat");
  auto check = [&](std::uint32_t u) {
    const float x = std::bit_cast<float>(u);
    if (!std::isfinite(x)) return;
    if (f32_to_bf16_sat(u) != oracle_bf16(x)) mb.add("x=" + oracle::hex(u));
    _Float16 h = static_cast<_Float16>(x);
    std::uint16_t hb = std::bit_cast<std::uint16_t>(h);
    if ((hb & 0x7FFF) == 0x7C00) hb = static_cast<std::uint16_t>((hb & 0x8000) | 0x7BFF);  // saturate
    if (f32_to_f16_sat(u) != hb) mh.add("x=" + oracle::hex(u));
  };
  for (int i = 0; i < 2000000; ++i) check(rng());
  // Every bf16 value and its midpoints to the next, and the fp16 range boundaries.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    check(h << 16);
    check((h << 16) | 0x8000u);
    check((h << 16) | 0x8001u);
    check((h << 16) | 0x7FFFu);
  }
  for (std::uint32_t u = 0x33000000u; u < 0x33800000u; u += 0x1001) check(u);  // around fp16 subnormal min
  for (std::uint32_t u = 0x477FE000u; u < 0x47800100u; ++u) check(u);          // around 65504..65536
  EXPECT_EQ(f32_to_bf16_sat(0x7F7FFFFFu), 0x7F7Fu);  // FLT_MAX saturates instead of becoming Inf
  EXPECT_EQ(f32_to_f16_sat(std::bit_cast<std::uint32_t>(1e9f)), 0x7BFFu);
}

TEST(Codec, ScaleRulesAgainstExactFormulas) {
  const auto rules = mxq::amax_rules();
  for (ElemType t : kElems) {
    const FloatSpec s = elem_spec(t);
    const oracle::Fmt& f = oracle::fmt(t);
    const int emax = oracle::floor_log2(f.maxval);
    for (ScaleRule rule : rules) {
      oracle::Mismatches mm(std::string("scale rule ") + std::string(to_string(rule)) + " " + f.name);
      auto check = [&](float amax) {
        const double a = amax;
        int want = 0;
        switch (rule) {
          case ScaleRule::floor: want = oracle::floor_log2(a) - emax; break;
          case ScaleRule::ceil: {
            int ex;
            const double m = std::frexp(a, &ex);  // a = m * 2^ex; a power of two has m == 0.5
            want = (m == 0.5 ? ex - 1 : ex) - emax;
            break;
          }
          case ScaleRule::even: {
            int ex;
            const double m = std::frexp(a, &ex);             // a = m * 2^ex, m in [0.5, 1)
            const double r = std::nearbyint(std::ldexp(m, f.mbits + 1));  // RNE to mbits+1 significant bits
            want = oracle::floor_log2(std::ldexp(r, ex - f.mbits - 1)) - emax;
            break;
          }
          case ScaleRule::even_fp4: {
            // compressed-tensors' formula: amax plus a quarter of its binade, then its power of two
            const int fl = oracle::floor_log2(a);
            want = oracle::floor_log2(a + std::ldexp(1.0, fl - 2)) - emax;
            break;
          }
          case ScaleRule::rceil: {
            int e = oracle::floor_log2(a) - oracle::floor_log2(f.maxval) - 2;
            while (a > std::ldexp(f.maxval, e)) ++e;  // smallest e with amax <= max * 2^e
            want = e;
            break;
          }
          default: break;
        }
        want = std::clamp(want, -127, 127);
        const int got = mx_scale_exp(rule, amax, 0.0f, s);
        if (got != want)
          mm.add("amax=" + std::to_string(amax) + " (" + oracle::hex(std::bit_cast<std::uint32_t>(amax)) + "): got " +
                 std::to_string(got) + " want " + std::to_string(want));
      };
      for (std::uint32_t h = 1; h < 0x7F80; ++h) check(bf16f(std::uint16_t(h)));  // every positive finite bf16
      for (std::uint32_t u = 1; u < 0x00800000u; u = u * 3 + 1) check(std::bit_cast<float>(u));  // fp32 subnormals
      check(std::bit_cast<float>(0x7F7FFFFFu));
    }
  }
  // Floor and even differ exactly at significand 1.75 for E2M1.
  EXPECT_EQ(mx_scale_exp(ScaleRule::floor, 7.0f, 0, kE2M1), 0);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even, 7.0f, 0, kE2M1), 1);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even, 6.99f, 0, kE2M1), 0);
  // even_fp4 rounds at E2M1's width for every element: for E4M3, amax 448 = 1.75 * 2^8 bumps (even,
  // at E4M3's 3 mantissa bits, keeps 448); 1.9375 * 2^8 bumps under both; just below 1.75 under neither.
  EXPECT_EQ(mx_scale_exp(ScaleRule::even_fp4, 448.0f, 0, kE4M3), 1);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even, 448.0f, 0, kE4M3), 0);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even_fp4, 496.0f, 0, kE4M3), 1);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even, 496.0f, 0, kE4M3), 1);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even_fp4, std::nextafter(448.0f, 0.f), 0, kE4M3), 0);
  EXPECT_EQ(mx_scale_exp(ScaleRule::even_fp4, 7.0f, 0, kE2M1), mx_scale_exp(ScaleRule::even, 7.0f, 0, kE2M1));
  // rceil: amax 6 -> 0; amax just above 6 -> 1.
  EXPECT_EQ(mx_scale_exp(ScaleRule::rceil, 6.0f, 0, kE2M1), 0);
  EXPECT_EQ(mx_scale_exp(ScaleRule::rceil, std::nextafter(6.0f, 7.f), 0, kE2M1), 1);
  // Clamping at 2^127 and 2^-127.
  EXPECT_EQ(mx_scale_exp(ScaleRule::ceil, std::bit_cast<float>(0x7F7FFFFFu), 0, kINT8), 127);
  EXPECT_EQ(mx_scale_exp(ScaleRule::floor, std::bit_cast<float>(1u), 0, kE2M1), -127);
}

TEST(Codec, QuestAndAbsmaxArguments) {
  // The quest argument follows the documented pairwise order; compare with a recursive formulation.
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::function<float(const float*, int)> S = [&](const float* v, int n) -> float {
    return n == 1 ? v[0] : S(v, n / 2) + S(v + n / 2, n / 2);
  };
  for (int g : {2, 8, 16, 32, 64, 128, 256}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> x(g), d(g);
      const float scale = std::ldexp(1.0f, int(rng() % 40) - 20);
      for (auto& v : x) v = nd(rng) * scale;
      const float mean = S(x.data(), g) / float(g);
      for (int i = 0; i < g; ++i) {
        const float di = x[i] - mean;
        d[i] = di * di;
      }
      const float sigma = std::sqrt(S(d.data(), g) / float(g));
      const float t = sigma * 2.92247856f / 6.0f + 1e-8f;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(quest_arg(x.data(), g)), std::bit_cast<std::uint32_t>(t)) << "g=" << g;
      ASSERT_EQ(mx_scale_exp(ScaleRule::quest, 1.0f, t, kE2M1), std::clamp(oracle::floor_log2(t), -127, 127));
    }
  }
  EXPECT_EQ(mx_scale_exp(ScaleRule::qutlass_absmax, 4.0f, 0, kE2M1), 2);
  EXPECT_EQ(mx_scale_exp(ScaleRule::qutlass_absmax, 1e-9f, 0, kE2M1), oracle::floor_log2(double(1e-9f + 1e-8f)));
}

TEST(Codec, Nvfp4BlockArithmetic) {
  // S = 2688 / amax; special cases.
  EXPECT_EQ(nvfp4_encode_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(INFINITY), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(NAN), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(std::bit_cast<float>(1u)), std::bit_cast<float>(0x7F7FFFFFu));  // clamped
  const oracle::Fmt& e4m3 = oracle::fmt(ElemType::e4m3);
  const oracle::Fmt& e2m1 = oracle::fmt(ElemType::e2m1);
  std::mt19937 rng(5);
  oracle::Mismatches mm("nvfp4 block");
  for (int i = 0; i < 200000; ++i) {
    const float amax_t = std::ldexp(float(rng() % 1000 + 1), int(rng() % 60) - 40);
    const float S = nvfp4_encode_scale(amax_t);
    const float amax_b = amax_t * float(rng() % 1001) / 1000.0f;
    const float tt = (amax_b * S) / 6.0f;
    const std::uint32_t want_sc = oracle::encode(e4m3, double(tt));
    const std::uint32_t sc = nvfp4_block_scale_code(amax_b, S);
    if (sc != want_sc) mm.add("block scale amax_b=" + std::to_string(amax_b));
    const float s = float(oracle::decode(e4m3, want_sc));
    const float m = s == 0.0f ? 0.0f : S / s;
    const float x = amax_b * (float(int(rng() % 2001) - 1000) / 1000.0f);
    const std::uint32_t want = x == 0.0f ? (std::signbit(x) ? 8u : 0u) : oracle::encode(e2m1, double(x * m));
    if (nvfp4_encode(std::bit_cast<std::uint32_t>(x), m) != want) mm.add("element x=" + std::to_string(x));
    const float dq = float(oracle::decode(e2m1, want)) * s / S;
    if (std::bit_cast<std::uint32_t>(nvfp4_decode(want, want_sc, S)) != std::bit_cast<std::uint32_t>(dq) &&
        !(dq == 0.0f && nvfp4_decode(want, want_sc, S) == 0.0f))
      mm.add("decode x=" + std::to_string(x));
  }
  EXPECT_EQ(nvfp4_block_scale_code(1e30f, 1e30f), 0x7Eu);  // overflow saturates to 448
  EXPECT_TRUE(std::isnan(nvfp4_decode(3, kE4M3NaN, 1.0f)));
}

// recip_div (the GPU's NVFP4 dequantize without a division per element) against div_rn: every
// significand that an E2M1 magnitude times an E4M3 block scale can have, against every one of the
// 2^23 significands of S. In recip_div's S range nothing leaves the normal range, so powers of two
// scale every step exactly and this covers every (a, S) the kernels use it for; random values over
// the whole range check that argument.
TEST(Codec, RecipDivExhaustive) {
  std::vector<std::uint32_t> sigs;  // distinct significands (mantissa bits) of the products
  for (std::uint32_t m = 1; m <= 7; ++m)
    for (std::uint32_t sc = 1; sc <= 0x7E; ++sc) {
      const float a = decode_f32(m, kE2M1) * decode_f32(sc, kE4M3);
      const std::uint32_t mant = std::bit_cast<std::uint32_t>(a) & 0x7FFFFFu;
      if (std::find(sigs.begin(), sigs.end(), mant) == sigs.end()) sigs.push_back(mant);
    }
  ASSERT_GE(sigs.size(), 8u);
  ASSERT_LE(sigs.size(), 16u);
  oracle::Mismatches mm("recip_div");
  for (const std::uint32_t mant : sigs) {
    const float a = std::bit_cast<float>(0x3F800000u | mant);
    std::uint64_t bad = 0;
    for (std::uint32_t sm = 0; sm < (1u << 23); ++sm) {
      const float S = std::bit_cast<float>(0x3F800000u | sm);
      const float got = recip_div(a, S, div_rn(1.0f, S)), want = div_rn(a, S);
      if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want) && bad++ < 4)
        mm.add("a=" + oracle::hex(std::bit_cast<std::uint32_t>(a)) + " S=" + oracle::hex(std::bit_cast<std::uint32_t>(S)) +
               ": got " + oracle::hex(std::bit_cast<std::uint32_t>(got)) + " want " + oracle::hex(std::bit_cast<std::uint32_t>(want)));
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 2000000; ++i) {
    const float S = std::ldexp(1.0f + float(rng() & 0x7FFFFF) * 0x1p-23f, int(rng() % 64) - 32);
    const float a = decode_f32(rng() % 8, kE2M1) * decode_f32(rng() % 0x7F, kE4M3);
    ASSERT_TRUE(recip_div_ok(S));
    const float got = recip_div(a, S, div_rn(1.0f, S)), want = div_rn(a, S);
    if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want))
      mm.add("random a=" + std::to_string(a) + " S=" + oracle::hex(std::bit_cast<std::uint32_t>(S)));
  }
  EXPECT_FALSE(recip_div_ok(0x1p-33f));
  EXPECT_FALSE(recip_div_ok(0x1p33f));
}

TEST(Codec, PhiloxKnownAnswers) {
  // Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
  auto run = [](U32x4 c, std::uint32_t k0, std::uint32_t k1) { return philox4x32_10(c, k0, k1); };
  U32x4 r = run({{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = run({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = run({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Codec, StochasticRoundingThresholdIsExact) {
  // For random values and the documented comparison, rnd = t-1 rounds up and rnd = t rounds down.
  std::mt19937 rng(11);
  for (ElemType t : kElems) {
    const FloatSpec s = elem_spec(t);
    const oracle::Fmt& f = oracle::fmt(t);
    oracle::Mismatches mm(std::string("stochastic ") + f.name);
    for (int i = 0; i < 20000; ++i) {
      const float x = std::bit_cast<float>(std::uint32_t((rng() & 0x807FFFFFu) | (std::uint32_t(120 + rng() % 20) << 23)));
      for (int e : {-4, -1, 0, 2, 6}) {
        const double v = std::ldexp(double(x), -e);
        for (std::uint32_t rnd : {0u, 1u, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFFu, std::uint32_t(rng())}) {
          const std::uint32_t got = encode_scaled(std::bit_cast<std::uint32_t>(x), e, s, true, rnd);
          const std::uint32_t want = oracle::encode_sr(f, v, rnd);
          if (got != want) mm.add(std::string(f.name) + " x=" + std::to_string(x) + " e=" + std::to_string(e) + " rnd=" + oracle::hex(rnd));
        }
      }
    }
  }
}

TEST(Codec, StochasticRoundingIsUnbiased) {
  // The mean of N stochastic roundings of v is within 6 standard errors of v: the standard error of
  // a Bernoulli(p) mean over N draws, times the grid step, is step * sqrt(p (1 - p) / N).
  const int N = 1 << 20;
  for (ElemType t : {ElemType::e2m1, ElemType::e4m3, ElemType::int8}) {
    const FloatSpec s = elem_spec(t);
    for (float v : {0.3f, 1.1f, 2.6f, 0.013f, -1.37f}) {
      if (std::fabs(v) >= oracle::fmt(t).maxval) continue;  // saturates: nothing random
      double sum = 0;
      for (int j = 0; j < N; ++j)
        sum += decode_f32(encode_scaled(std::bit_cast<std::uint32_t>(v), 0, s, true, sr_bits(42, std::uint64_t(j))), s);
      const double mean = sum / N;
      const oracle::Fmt& f = oracle::fmt(t);
      const auto hi = std::upper_bound(f.vals.begin(), f.vals.end(), std::fabs(double(v)));
      const double step = *hi - *(hi - 1);
      const double p = (std::fabs(double(v)) - *(hi - 1)) / step;
      const double se = step * std::sqrt(p * (1 - p) / N);
      EXPECT_NEAR(mean, double(v), 6 * se + 1e-12) << f.name << " v=" << v;
    }
  }
}

// The random words of 16 and 8 bits per element: field j % (128 / B) of Philox at counter j / (128 / B),
// bits [f * B, f * B + B) of the 128 (word-major, low bits first), as the word's B high bits with the
// low 32 - B bits set; 32 bits: word j % 4 of counter j / 4. Computed here from the 128-bit output.
TEST(Codec, RandomWordsOfEachWidth) {
  const std::uint64_t seed = 0x0123456789ABCDEFull;
  for (int B : {8, 16, 32}) {
    const std::uint64_t per = 128 / B;
    for (std::uint64_t j : {0ull, 1ull, 3ull, 4ull, 7ull, 8ull, 15ull, 16ull, 17ull, 12345ull, (1ull << 40) + 5, ~0ull}) {
      const std::uint64_t c = j / per, f = j % per;
      const U32x4 r = philox4x32_10(U32x4{{std::uint32_t(c), std::uint32_t(c >> 32), 0u, 0u}}, std::uint32_t(seed),
                                    std::uint32_t(seed >> 32));
      // the 128 bits as one little-endian integer, field f
      unsigned __int128 all = 0;
      for (int w = 3; w >= 0; --w) all = (all << 32) | r.v[w];
      const std::uint32_t field = std::uint32_t((all >> (f * B)) & ((unsigned __int128)1 << B) - 1);
      const std::uint32_t want = B == 32 ? field : (field << (32 - B)) | ((1u << (32 - B)) - 1u);
      EXPECT_EQ(sr_bits(seed, j, B), want) << "B=" << B << " j=" << j;
    }
  }
  EXPECT_EQ(sr_bits(seed, 5), sr_bits(seed, 5, 32));
}

TEST(Codec, FewerRandomBitsTruncateTheFraction) {
  // With B random bits, rnd < t holds for exactly floor(t / 2^(32-B)) of the 2^B words: a rounding
  // fraction that is a multiple of 2^-B is exact, any other is truncated to B bits.
  for (int B : {8, 16}) {
    const std::uint32_t low = (1u << (32 - B)) - 1u;
    for (std::uint64_t t : {0ull, 1ull, 0xFFFFFFull, 0x1000000ull, 0x1000001ull, 0x80000000ull, 0xFFFFFFFFull, 0x100000000ull}) {
      std::uint64_t ups = 0;
      for (std::uint32_t r = 0; r < (1u << B); ++r) ups += std::uint64_t((std::uint64_t(r) << (32 - B)) | low) < t;
      EXPECT_EQ(ups, t >> (32 - B)) << "B=" << B << " t=" << t;
    }
  }
}

TEST(Codec, StochasticRoundingWithFewerBitsIsUnbiasedOnItsGrid) {
  // Values whose rounding fraction is a multiple of 2^-B round up with probability exactly that
  // fraction (mean within 6 standard errors); others are biased toward zero by less than 2^-B of a step.
  const int N = 1 << 20;
  for (int B : {8, 16}) {
    for (ElemType t : {ElemType::e2m1, ElemType::e4m3}) {
      const FloatSpec s = elem_spec(t);
      const oracle::Fmt& f = oracle::fmt(t);
      // 1.25 = 1 + 1/4 of e2m1's step 1 at [1, 2) ... : fractions 1/4 and 3/8 (exact in 8 bits); 0.3 / 1.1: not
      for (float v : {1.25f, 2.75f, 0.3f, 1.1f, -1.375f}) {
        double sum = 0;
        for (int j = 0; j < N; ++j)
          sum += decode_f32(encode_scaled(std::bit_cast<std::uint32_t>(v), 0, s, true, sr_bits(7, std::uint64_t(j), B)), s);
        const double mean = sum / N, a = std::fabs(double(v));
        const auto hi = std::upper_bound(f.vals.begin(), f.vals.end(), a);
        const double step = *hi - *(hi - 1), p = (a - *(hi - 1)) / step;
        const double se = step * std::sqrt(p * (1 - p) / N);
        const double pt = std::floor(p * std::ldexp(1.0, B)) / std::ldexp(1.0, B);  // the truncated fraction
        const double want = std::copysign(*(hi - 1) + pt * step, double(v));
        EXPECT_NEAR(mean, want, 6 * se + 1e-12) << f.name << " B=" << B << " v=" << v;
        EXPECT_LE(std::fabs(double(v) - want), step * std::ldexp(1.0, -B)) << f.name << " B=" << B << " v=" << v;
        if (p * std::ldexp(1.0, B) == std::floor(p * std::ldexp(1.0, B)))
          EXPECT_NEAR(mean, double(v), 6 * se + 1e-12) << "exact on the 2^-B grid: " << f.name << " B=" << B << " v=" << v;
      }
    }
  }
}

// The kernels' 32-bit rounding equals the 64-bit definition on every fp32 significand width, every
// exponent offset that reaches any branch, every element format, both rounding modes.
TEST(Codec, RoundMagnitude32MatchesRoundMagnitude) {
  using namespace mxq::core;
  std::mt19937 rng(17);
  const FloatSpec specs[] = {kE2M1, kE2M3, kE3M2, kE4M3, kE5M2, kINT8};
  long checked = 0;
  for (const FloatSpec& f : specs) {
    for (int exp = -240; exp <= 40; ++exp) {
      for (int k = 0; k < 400; ++k) {
        std::uint32_t sig = rng() & 0xFFFFFFu;
        if (k % 4 == 0) sig |= 0x800000u;            // normal significands
        if (k % 7 == 0) sig &= ~((1u << (rng() % 24)) - 1u);  // short ones (exact and tie cases)
        if (sig == 0) sig = 1;
        const std::uint32_t rnd = k % 3 == 0 ? rng() : (k % 3 == 1 ? 0u : 0xFFFFFFFFu);
        for (bool sr : {false, true}) {
          const std::uint32_t a = round_magnitude(sig, exp, f, sr, rnd), b = round_magnitude32(sig, exp, f, sr, rnd);
          ASSERT_EQ(a, b) << "sig " << sig << " exp " << exp << " sr " << sr << " rnd " << rnd << " mbits " << f.mbits;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 600000);
}

// ---- UE5M3 (nvfp4_e5m3's block scale), against values written out from docs/numerics.md -----------------
namespace {
// The UE5M3 value of a byte from its definition (not the codec): e = b >> 3, m = b & 7, bias 15.
double ue5m3_value(int b) {
  const int e = b >> 3, m = b & 7;
  return e == 0 ? m * std::ldexp(1.0, -17) : std::ldexp(1.0 + m / 8.0, e - 15);
}
// Nearest UE5M3 code to v >= 0 among 0x00..0xFE (ties to the even code), found by search.
std::uint32_t ue5m3_nearest(double v) {
  if (std::isnan(v) || v >= ue5m3_value(0xFE)) return 0xFE;
  int lo = 0;
  while (lo < 0xFE && ue5m3_value(lo + 1) <= v) ++lo;
  if (ue5m3_value(lo) == v || lo == 0xFE) return std::uint32_t(lo);
  const double dl = v - ue5m3_value(lo), dh = ue5m3_value(lo + 1) - v;
  if (dl < dh) return std::uint32_t(lo);
  if (dh < dl) return std::uint32_t(lo + 1);
  return std::uint32_t((lo & 1) ? lo + 1 : lo);
}
}  // namespace

TEST(Codec, Ue5m3EveryByteDecodesAndReencodes) {
  for (int b = 0; b < 256; ++b) {
    const double want = ue5m3_value(b);
    ASSERT_EQ(double(ue5m3_decode(std::uint32_t(b))), want) << "byte " << b;
    // 6 * s is exact in fp32 (at most 6 significant bits), so amax = 6 * s gives s back, except 0xFF,
    // which a quantizer never writes (saturates at 0xFE = 114688).
    const float amax = float(6.0 * want);
    ASSERT_EQ(ue5m3_block_scale_code(amax), std::uint32_t(b == 0xFF ? 0xFE : b)) << "byte " << b;
    if (b < 0xFF) ASSERT_GT(ue5m3_value(b + 1), want) << "byte " << b;  // strictly increasing
  }
  EXPECT_EQ(ue5m3_decode(0xFE), 114688.0f);
  EXPECT_EQ(ue5m3_decode(0xFF), 122880.0f);
  EXPECT_EQ(ue5m3_decode(0x01), std::ldexp(1.0f, -17));
  EXPECT_EQ(ue5m3_decode(0x08), std::ldexp(1.0f, -14));
}

TEST(Codec, Ue5m3ScaleCodeMatchesNearestSearch) {
  // v = fp32(amax / 6) is what both the plugin and mxq round; the oracle rounds it by search.
  auto check = [](float amax) {
    const float v = amax / 6.0f;
    const std::uint32_t got = ue5m3_block_scale_code(amax);
    const std::uint32_t want = ue5m3_nearest(double(v));
    if (got != want) ADD_FAILURE() << "amax " << amax << " (0x" << std::hex << std::bit_cast<std::uint32_t>(amax)
                                   << ") got 0x" << got << " want 0x" << want;
    return got == want;
  };
  // Pattern classes: zero, fp32 subnormals, every grid value, midpoint and their fp32 neighbours,
  // the saturation region, FLT_MAX, Inf and NaN.
  check(0.0f);
  check(std::numeric_limits<float>::denorm_min());
  check(std::numeric_limits<float>::max());
  check(std::numeric_limits<float>::infinity());
  check(std::numeric_limits<float>::quiet_NaN());
  check(std::bit_cast<float>(0x7F800001u));
  for (int b = 0; b < 256; ++b) {
    const double vs[] = {ue5m3_value(b), b < 255 ? (ue5m3_value(b) + ue5m3_value(b + 1)) / 2 : 118784.0 + 4096.0};
    for (double v : vs) {
      const float a = float(v * 6.0);  // exact: v has at most 5 significant bits
      ASSERT_EQ(double(a) / 6.0, v);
      for (float x : {a, std::nextafter(a, 0.0f), std::nextafter(a, INFINITY)}) ASSERT_TRUE(check(x));
    }
  }
  // A strided sweep of every positive fp32 exponent and mantissa class.
  int bad = 0;
  for (std::uint64_t u = 0; u < 0x7F800000u && bad < 10; u += 4099) bad += !check(std::bit_cast<float>(std::uint32_t(u)));
  EXPECT_EQ(bad, 0);
}

TEST(Codec, Nvfp4E5m3ElementsAndZeroScale) {
  // s = 1: x / 1 rounds onto E2M1 with its ties; zero scale: +0 whatever the sign.
  const std::uint32_t one = 0x78;  // e = 15, m = 0
  ASSERT_EQ(ue5m3_decode(one), 1.0f);
  const struct { float x; std::uint32_t code; } cases[] = {
      {0.25f, 0x0}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4}, {2.5f, 0x4}, {3.5f, 0x6}, {5.0f, 0x6},
      {7.0f, 0x7}, {INFINITY, 0x7}, {-0.0f, 0x8}, {-0.1f, 0x8}, {-6.0f, 0xF}};
  for (const auto& c : cases) EXPECT_EQ(nvfp4_e5m3_encode(std::bit_cast<std::uint32_t>(c.x), one), c.code) << c.x;
  EXPECT_EQ(nvfp4_e5m3_encode(std::bit_cast<std::uint32_t>(-3.0f), 0x00), 0u);
  // A division, not a reciprocal multiply: s = 1.125 (0x79), x = 3 * 1.125 -> 3 exactly.
  EXPECT_EQ(nvfp4_e5m3_encode(std::bit_cast<std::uint32_t>(3.375f), 0x79), 0x5u);
  EXPECT_EQ(nvfp4_e5m3_decode(0xF, 0xFE), -688128.0f);
  EXPECT_EQ(nvfp4_e5m3_decode(0x1, 0x01), std::ldexp(1.0f, -18));
}
