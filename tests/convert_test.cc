// The public conversions (mxq/convert.hpp) against formulations of their own: bf16 and fp16 -> fp32
// over every pattern (an ldexp decode, and the compiler's _Float16 conversion), fp32 -> bf16 on every
// tie and its neighbours in every binade, a sweep of the fp32 patterns, and the edge cases by value.
// Nothing here calls the library's codec.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <mxq/convert.hpp>

namespace {

std::string hex(std::uint32_t u) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08X", u);
  return b;
}

// The value of a binary float with `mbits` fraction bits and an exponent field of `ebits` bits, from
// its fields (NaN for every NaN, the sign of zero kept).
double decode(std::uint32_t bits, int ebits, int mbits) {
  const std::uint32_t sign = bits >> (ebits + mbits), e = (bits >> mbits) & ((1u << ebits) - 1),
                      m = bits & ((1u << mbits) - 1);
  const int bias = (1 << (ebits - 1)) - 1;
  double v;
  if (e == (1u << ebits) - 1) v = m ? NAN : INFINITY;
  else if (e == 0) v = std::ldexp(double(m), 1 - bias - mbits);
  else v = std::ldexp(double(m | (1u << mbits)), int(e) - bias - mbits);
  return sign ? -v : v;
}

// fp32 -> bf16 as the IEEE rule reads: the nearer of the two bf16 values around |x|, the even one on
// a tie; past the largest finite value the next one up is 2^128 (the rounding of an unbounded
// exponent), which then becomes Inf. A NaN: the rule convert.hpp documents.
std::uint16_t want_bf16(std::uint32_t u) {
  const float x = std::bit_cast<float>(u);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7F80u);
  const std::uint32_t lo = mag >> 16, hi = lo + 1;
  const double d = std::fabs(double(x)), vlo = decode(lo, 8, 7), vhi = hi == 0x7F80u ? std::ldexp(1.0, 128) : decode(hi, 8, 7);
  const std::uint32_t r = d - vlo < vhi - d ? lo : d - vlo > vhi - d ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | r);
}

static_assert(mxq::f32_to_bf16(1.0f) == 0x3F80 && mxq::bf16_to_f32(0x3F80) == 1.0f && mxq::f16_to_f32(0x3C00) == 1.0f,
              "the conversions are constexpr");

TEST(Convert, Bf16ToF32EveryPattern) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = mxq::bf16_to_f32(std::uint16_t(h));
    const double want = decode(h, 8, 7);
    if (std::isnan(want)) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got), h << 16) << "bf16 " << hex(h) << ": a NaN keeps sign and payload";
    } else {
      ASSERT_EQ(double(got), want) << "bf16 " << hex(h);
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "bf16 " << hex(h);
    }
  }
}

TEST(Convert, F16ToF32EveryPattern) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = mxq::f16_to_f32(std::uint16_t(h));
    const double want = decode(h, 5, 10);
    const std::uint32_t gb = std::bit_cast<std::uint32_t>(got);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "f16 " << hex(h);
      ASSERT_EQ(gb >> 31, h >> 15) << "f16 " << hex(h) << ": sign";
      ASSERT_EQ((gb >> 13) & 0x3FFu, h & 0x3FFu) << "f16 " << hex(h) << ": quiet bit and payload";
      ASSERT_EQ(gb & 0x1FFFu, 0u) << "f16 " << hex(h);
    } else {
      ASSERT_EQ(double(got), want) << "f16 " << hex(h);
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "f16 " << hex(h);
      // and the compiler's own conversion
      ASSERT_EQ(gb, std::bit_cast<std::uint32_t>(static_cast<float>(std::bit_cast<_Float16>(std::uint16_t(h)))))
          << "f16 " << hex(h);
    }
  }
}

TEST(Convert, F32ToBf16TiesAndNeighboursInEveryBinade) {
  // Every upper half (sign, exponent, the 7 kept bits) with the lower halves around the tie and the
  // ends, plus a few random ones: every tie both ways, every carry into the next binade, the
  // subnormals, the largest finite value, Inf and every NaN class.
  std::mt19937 rng(5);
  long checked = 0;
  for (std::uint32_t top = 0; top < 0x10000u; ++top)
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x3FFFu, 0x7FFEu, 0x7FFFu, 0x8000u, 0x8001u, 0xC000u, 0xFFFEu, 0xFFFFu,
                              std::uint32_t(rng() & 0xFFFFu), std::uint32_t(rng() & 0xFFFFu)}) {
      const std::uint32_t u = (top << 16) | low;
      ASSERT_EQ(mxq::f32_to_bf16(std::bit_cast<float>(u)), want_bf16(u)) << "fp32 " << hex(u);
      ++checked;
    }
  EXPECT_EQ(checked, 12L * 65536);
}

TEST(Convert, F32ToBf16Sweep) {
  // About 4.3 million fp32 patterns spread over the whole range (an odd stride visits every residue).
  std::uint32_t u = 0;
  for (long i = 0; i < (1L << 32) / 1009; ++i, u += 1009)
    ASSERT_EQ(mxq::f32_to_bf16(std::bit_cast<float>(u)), want_bf16(u)) << "fp32 " << hex(u);
}

TEST(Convert, F32ToBf16EdgeCases) {
  const struct {
    std::uint32_t in;
    std::uint16_t out;
    const char* what;
  } cases[] = {
      {0x3F800000u, 0x3F80, "1"},
      {0x3F808000u, 0x3F80, "tie, the lower neighbour even"},
      {0x3F818000u, 0x3F82, "tie, the lower neighbour odd"},
      {0x3F808001u, 0x3F81, "just past the tie"},
      {0x3F807FFFu, 0x3F80, "just before the tie"},
      {0x3FFF8000u, 0x4000, "tie carrying into the next binade"},
      {0x7F7F0000u, 0x7F7F, "largest finite bf16"},
      {0x7F7F7FFFu, 0x7F7F, "below the largest's half ulp"},
      {0x7F7F8000u, 0x7F80, "the largest's half ulp: a tie to even, Inf"},
      {0x7F7FFFFFu, 0x7F80, "FLT_MAX: Inf"},
      {0xFF7FFFFFu, 0xFF80, "-FLT_MAX: -Inf"},
      {0x7F800000u, 0x7F80, "Inf"},
      {0xFF800000u, 0xFF80, "-Inf"},
      {0x7FC00000u, 0x7FC0, "quiet NaN"},
      {0xFFC00000u, 0xFFC0, "negative quiet NaN"},
      {0x7F800001u, 0x7FC0, "signalling NaN, payload in the low bits only (the bare trick: Inf)"},
      {0x7FFFFFFFu, 0x7FFF, "NaN, all ones (the bare trick: -0)"},
      {0xFFFFFFFFu, 0xFFFF, "negative NaN, all ones"},
      {0x7FA00000u, 0x7FE0, "signalling NaN with an upper payload: made quiet, payload kept"},
      {0x00000000u, 0x0000, "+0"},
      {0x80000000u, 0x8000, "-0"},
      {0x00000001u, 0x0000, "smallest subnormal"},
      {0x80000001u, 0x8000, "smallest negative subnormal: -0"},
      {0x00008000u, 0x0000, "subnormal tie, lower even"},
      {0x00018000u, 0x0002, "subnormal tie, lower odd"},
      {0x00008001u, 0x0001, "subnormal past the tie"},
      {0x007FFFFFu, 0x0080, "largest subnormal: the smallest normal"},
      {0x807FFFFFu, 0x8080, "largest negative subnormal"},
      {0x00800000u, 0x0080, "smallest normal"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(mxq::f32_to_bf16(std::bit_cast<float>(c.in)), c.out) << hex(c.in) << ": " << c.what;
    EXPECT_EQ(want_bf16(c.in), c.out) << "the test's own rule, " << hex(c.in) << ": " << c.what;
  }
}

TEST(Convert, Bf16RoundTrip) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const std::uint16_t back = mxq::f32_to_bf16(mxq::bf16_to_f32(std::uint16_t(h)));
    const bool nan = (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu);
    ASSERT_EQ(back, nan ? (h | 0x40u) : h) << "bf16 " << hex(h);
  }
}

}  // namespace
