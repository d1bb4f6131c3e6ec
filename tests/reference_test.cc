// The CPU reference against an independent block-level oracle and the test vectors of numerics.md.
#include <bit>
#include <cmath>

#include <gtest/gtest.h>

#include "helpers.hpp"
#include "oracle.hpp"

using namespace mxq;
using th::HostTensor;
using th::Quantized;

namespace {

// The MX formats (every format but the last two, NVFP4 and nvfp4_e5m3).
const std::span<const Format> kMx = all_formats().first(all_formats().size() - 2);

// The oracle's E8M0 exponent for the amax rules.
int oracle_scale_exp(ScaleRule rule, double amax, const oracle::Fmt& f) {
  const int emax = oracle::floor_log2(f.maxval);
  int e = 0;
  int ex;
  const double m = std::frexp(amax, &ex);
  switch (rule) {
    case ScaleRule::floor: e = ex - 1 - emax; break;
    case ScaleRule::ceil: e = (m == 0.5 ? ex - 1 : ex) - emax; break;
    case ScaleRule::even: e = oracle::floor_log2(std::ldexp(std::nearbyint(std::ldexp(m, f.mbits + 1)), ex - f.mbits - 1)) - emax; break;
    case ScaleRule::even_fp4: e = ex - 1 + (m >= 0.875 ? 1 : 0) - emax; break;  // significand 2m >= 1.75
    case ScaleRule::rceil:
      e = ex - 1 - oracle::floor_log2(f.maxval) - 2;
      while (amax > std::ldexp(f.maxval, e)) ++e;
      break;
    default: break;
  }
  return std::clamp(e, -127, 127);
}

// Quantizes with the reference and checks every code and scale byte against the oracle.
void check_against_oracle(const HostTensor& x, QuantOptions o) {
  o.backend = Backend::reference;
  Quantized q(o, x.rows, x.cols, true);
  quantize(x.view(), q.out(), o);
  const FormatInfo fi = format_info(o.format);
  const oracle::Fmt& f = oracle::fmt(fi.elem);
  const int g = group_size(o);
  oracle::Mismatches mm("reference vs oracle " + th::name_of(o) + " " + std::string(to_string(x.dtype)) + " [" +
                        std::to_string(x.rows) + ", " + std::to_string(x.cols) + "]");
  for (std::int64_t r = 0; r < x.rows; ++r) {
    for (std::int64_t b = 0; b * g < x.cols; ++b) {
      double amax = 0;
      bool finite = true;
      for (std::int64_t k = b * g; k < std::min<std::int64_t>(x.cols, (b + 1) * g); ++k) {
        const double v = x.get(r, k);
        if (!std::isfinite(v)) finite = false;
        else amax = std::max(amax, std::fabs(v));
      }
      const int e = !finite ? 128 : (amax == 0 ? -127 : oracle_scale_exp(o.rule, amax, f));
      if (q.scale(r, b) != std::uint8_t(e + 127))
        mm.add("scale [" + std::to_string(r) + ", " + std::to_string(b) + "]: got " + std::to_string(q.scale(r, b)) +
               " want " + std::to_string(e + 127) + " (amax " + std::to_string(amax) + ")");
      for (std::int64_t k = b * g; k < std::min<std::int64_t>(x.cols, (b + 1) * g); ++k) {
        const double v = x.get(r, k);
        const std::uint32_t want = !finite ? 0u : oracle::encode(f, std::ldexp(v, -e));
        const bool keep = finite && std::fabs(std::ldexp(v, -e)) < f.maxval;
        const bool got_keep = (q.mask.bytes[r * q.mask.stride + k / 8] >> (k % 8)) & 1;
        if (q.code(r, k) != want)
          mm.add("code [" + std::to_string(r) + ", " + std::to_string(k) + "]: got " + oracle::hex(q.code(r, k)) +
                 " want " + oracle::hex(want) + " (x " + std::to_string(v) + ", amax " + std::to_string(amax) + ", e " +
                 std::to_string(e) + ")");
        if (got_keep != keep) mm.add("clip mask [" + std::to_string(r) + ", " + std::to_string(k) + "]");
      }
    }
  }
  // FP4 rows with odd K: the unused high nibble is zero.
  if (fi.elem_bits == 4 && x.cols % 2)
    for (std::int64_t r = 0; r < x.rows; ++r) EXPECT_EQ(q.codes.bytes[r * q.codes.stride + x.cols / 2] >> 4, 0);

  // Dequantize: element value * 2^e rounded once to the output dtype, saturating.
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    HostTensor y(dt, x.rows, x.cols);
    dequantize(q.in(), y.view(), o);
    oracle::Mismatches md("reference dequantize to " + std::string(to_string(dt)) + " " + th::name_of(o));
    for (std::int64_t r = 0; r < x.rows; ++r)
      for (std::int64_t k = 0; k < x.cols; ++k) {
        const std::uint8_t sb = q.scale(r, k / g);
        const double exact = sb == 0xFF ? NAN : std::ldexp(oracle::decode(f, q.code(r, k)), int(sb) - 127);
        const double lim = dt == DType::f32 ? 3.4028234663852886e38 : (dt == DType::bf16 ? 3.3895313892515355e38 : 65504.0);
        float want = std::isnan(exact) ? NAN : float(std::clamp(exact, -lim, lim));  // double -> f32: RNE
        HostTensor w(dt, 1, 1);
        w.set(0, 0, want);  // f32 -> bf16/f16: RNE (values have <= 8 significant bits: no double rounding)
        if (dt != DType::f32 && std::isfinite(exact) && std::fabs(w.get(0, 0)) > lim) w.set(0, 0, float(std::copysign(lim, exact)));
        const bool ok = std::isnan(exact) ? std::isnan(y.get(r, k)) : y.bits(r, k) == w.bits(0, 0);
        if (!ok) md.add("[" + std::to_string(r) + ", " + std::to_string(k) + "]: got " + std::to_string(y.get(r, k)) + " want " + std::to_string(w.get(0, 0)));
      }
  }
}

}  // namespace

TEST(Reference, MxFormatsAndRulesAgainstOracle) {
  for (Format fmt : kMx)
    for (ScaleRule rule : amax_rules())
      for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
        if (!rule_refusal(fmt, rule).empty()) continue;  // even_fp4 outside mxfp4 and mxfp8_e4m3 (api_test)
        const HostTensor x = th::llm_like(dt, 3, 97, 17 + int(fmt) * 7 + int(rule));
        check_against_oracle(x, QuantOptions::mx(fmt, rule));
      }
}

TEST(Reference, OtherGroupSizesAndSwizzledLayout) {
  for (int g : {8, 16, 64, 128}) {
    QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
    o.group_size = g;
    check_against_oracle(th::llm_like(DType::bf16, 2, 3 * g + 5, 3), o);
  }
  QuantOptions o = QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor);
  o.scale_layout = ScaleLayout::swizzled;
  check_against_oracle(th::llm_like(DType::bf16, 130, 200, 4), o);  // rows not a multiple of 128, K not of 32
}

TEST(Reference, SpecialBlocksOfNumericsSection7) {
  // One block per row, 32 elements; E2M1, floor vs even.
  HostTensor x(DType::f32, 9, 32);
  for (int r = 0; r < 9; ++r)
    for (int k = 0; k < 32; ++k) x.set(r, k, 0.01f * float(k + 1));
  x.set(0, 5, 4.0f);                           // amax exactly a power of two
  x.set(1, 5, std::nextafter(4.0f, 0.0f));     // just below
  x.set(2, 5, 7.0f);                           // significand 1.75: floor -> e=0, even -> e=1
  for (int k = 0; k < 32; ++k) x.set(3, k, k % 2 ? -0.0f : 0.0f);  // amax 0
  x.set(4, 7, NAN);                            // one NaN
  x.set(5, 9, -INFINITY);                      // one Inf
  x.set(6, 0, 3.3895313892515355e38f);         // max-magnitude bf16
  x.set(7, 3, std::ldexp(1.0f, -140));         // subnormal-only block
  for (int k = 0; k < 32; ++k) x.set(7, k, k == 3 ? std::ldexp(1.0f, -140) : 0.0f);
  x.set(8, 31, 6.0f);
  for (ScaleRule rule : {ScaleRule::floor, ScaleRule::even, ScaleRule::ceil, ScaleRule::rceil})
    check_against_oracle(x, QuantOptions::mx(Format::mxfp4, rule));

  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  o.backend = Backend::reference;
  Quantized q(o, 9, 32);
  quantize(x.view(), q.out(), o);
  EXPECT_EQ(q.scale(0, 0), 127);     // 4 = 2^2 -> e = 0
  EXPECT_EQ(q.scale(1, 0), 126);     // just below 4 -> e = -1
  EXPECT_EQ(q.scale(2, 0), 127);     // 7 -> floor e = 0 (7 saturates to 6)
  EXPECT_EQ(q.code(2, 5), 7u);
  EXPECT_EQ(q.scale(3, 0), 0);       // amax 0 -> 2^-127
  EXPECT_EQ(q.code(3, 1), 8u);       // -0 keeps its sign
  EXPECT_EQ(q.scale(4, 0), 0xFF);    // NaN block
  EXPECT_EQ(q.scale(5, 0), 0xFF);    // Inf block
  EXPECT_EQ(q.code(5, 0), 0u);       // codes of a non-finite block are zero
  EXPECT_EQ(q.scale(6, 0), 127 + 125);  // floor(log2(max bf16)) = 127, minus emax 2
  EXPECT_EQ(q.scale(7, 0), 0);       // 2^-140: floor gives -142, clamped to -127
  QuantOptions oe = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  oe.backend = Backend::reference;
  Quantized qe(oe, 9, 32);
  quantize(x.view(), qe.out(), oe);
  EXPECT_EQ(qe.scale(2, 0), 128);    // even bumps at significand 1.75
  EXPECT_EQ(qe.code(2, 5), 6u);      // 7 / 2 = 3.5 -> 4 (tie to even)

  // QDQ: NaN and Inf blocks come back as NaN everywhere; finite blocks never become Inf.
  HostTensor y(DType::f32, 9, 32);
  qdq(x.view(), y.view(), o);
  for (int k = 0; k < 32; ++k) {
    EXPECT_TRUE(std::isnan(y.get(4, k)));
    EXPECT_TRUE(std::isnan(y.get(5, k)));
    EXPECT_TRUE(std::isfinite(y.get(6, k)));
  }
}

TEST(Reference, DequantizeSaturatesInsteadOfOverflowing) {
  // E5M2, rule ceil, amax = FLT_MAX: e = 128 - 15 = 113 and FLT_MAX * 2^-113 rounds up to 2^15, so
  // the exact dequantized value is 2^128, past every dtype's range: it must saturate, not be Inf.
  HostTensor x(DType::f32, 1, 32);
  for (int k = 0; k < 32; ++k) x.set(0, k, k == 0 ? std::bit_cast<float>(0x7F7FFFFFu) : 1.0f);
  for (Backend be : {Backend::reference, Backend::cpu}) {
    QuantOptions o = QuantOptions::mx(Format::mxfp8_e5m2, ScaleRule::ceil);
    o.backend = be;
    HostTensor y(DType::f32, 1, 32), yb(DType::bf16, 1, 32);
    qdq(x.view(), y.view(), o);
    EXPECT_EQ(y.bits(0, 0), 0x7F7FFFFFu) << to_string(be);
    Quantized q(o, 1, 32);
    quantize(x.view(), q.out(), o);
    dequantize(q.in(), yb.view(), o);
    EXPECT_EQ(yb.bits(0, 0), 0x7F7Fu) << to_string(be);
  }
}

TEST(Reference, SwizzleOffsetsAndRoundTrip) {
  EXPECT_EQ(swizzled_offset(0, 0, 4), 0);
  EXPECT_EQ(swizzled_offset(1, 0, 4), 16);
  EXPECT_EQ(swizzled_offset(32, 0, 4), 4);
  EXPECT_EQ(swizzled_offset(0, 1, 4), 1);
  EXPECT_EQ(swizzled_offset(0, 4, 8), 512);
  EXPECT_EQ(swizzled_offset(128, 0, 8), 1024);
  EXPECT_EQ(swizzled_offset(127, 3, 4), 511);
  for (Backend be : {Backend::reference, Backend::cpu}) {
    for (auto [R, C] : {std::pair{1, 1}, {130, 7}, {256, 8}, {5, 300}}) {
      HostTensor lin(DType::u8, R, C);
      for (std::size_t i = 0; i < lin.bytes.size(); ++i) lin.bytes[i] = std::uint8_t(i * 7 + 3);
      HostTensor sw(DType::u8, (R + 127) / 128 * 128, (C + 3) / 4 * 4), back(DType::u8, R, C);
      swizzle_scales(lin.view(), sw.view(), be);
      // Every byte of the padded layout is either a scale or zero padding; each scale appears once.
      std::vector<int> seen(sw.bytes.size(), 0);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          const auto off = swizzled_offset(r, c, sw.cols);
          ASSERT_EQ(sw.bytes[off], lin.bytes[r * C + c]);
          seen[off]++;
        }
      for (std::size_t i = 0; i < seen.size(); ++i) {
        ASSERT_LE(seen[i], 1);
        if (!seen[i]) ASSERT_EQ(sw.bytes[i], 0) << "padding byte " << i << " not zero";
      }
      unswizzle_scales(sw.view(), back.view(), be);
      EXPECT_EQ(back.bytes, lin.bytes);
    }
  }
}

TEST(Reference, Nvfp4AgainstOracle) {
  const oracle::Fmt& e2m1 = oracle::fmt(ElemType::e2m1);
  const oracle::Fmt& e4m3 = oracle::fmt(ElemType::e4m3);
  for (DType dt : {DType::bf16, DType::f32, DType::f16}) {
    const HostTensor x = th::llm_like(dt, 5, 83, 23);
    for (bool given : {false, true}) {
      QuantOptions o = QuantOptions::nvfp4(given ? std::optional<float>(1234.5f) : std::nullopt);
      o.backend = Backend::reference;
      Quantized q(o, x.rows, x.cols, true);
      quantize(x.view(), q.out(), o);
      double amax_t = 0;
      for (int r = 0; r < x.rows; ++r)
        for (int k = 0; k < x.cols; ++k) amax_t = std::max(amax_t, double(std::fabs(x.get(r, k))));
      const float S = given ? 1234.5f : float(2688.0f / float(amax_t));
      EXPECT_EQ(q.S, S);
      oracle::Mismatches mm("nvfp4 reference vs oracle");
      for (int r = 0; r < x.rows; ++r)
        for (int b = 0; b * 16 < x.cols; ++b) {
          float amax = 0;
          for (int k = b * 16; k < std::min<int>(x.cols, b * 16 + 16); ++k) amax = std::max(amax, std::fabs(x.get(r, k)));
          const std::uint32_t sc = oracle::encode(e4m3, double((amax * S) / 6.0f));
          if (q.scale(r, b) != sc) mm.add("scale " + std::to_string(r) + "," + std::to_string(b));
          const float s = float(oracle::decode(e4m3, sc));
          const float m = s == 0 ? 0.0f : S / s;
          for (int k = b * 16; k < std::min<int>(x.cols, b * 16 + 16); ++k) {
            const float v = x.get(r, k);
            const std::uint32_t want = v == 0 ? (std::signbit(v) ? 8u : 0u) : oracle::encode(e2m1, double(v * m));
            if (q.code(r, k) != want) mm.add("code " + std::to_string(r) + "," + std::to_string(k));
          }
        }
      // Dequantize with the same S: (e2m1 * s) / S.
      QuantOptions od = o;
      od.tensor_scale = q.S;
      HostTensor y(DType::f32, x.rows, x.cols);
      dequantize(q.in(), y.view(), od);
      for (int r = 0; r < x.rows; ++r)
        for (int k = 0; k < x.cols; ++k) {
          const float want = float(oracle::decode(e2m1, q.code(r, k))) * float(oracle::decode(e4m3, q.scale(r, k / 16))) / q.S;
          ASSERT_EQ(y.get(r, k), want) << r << "," << k;
        }
    }
  }
}

// NVFP4 under rule quest (QuTLASS's fusedQuantizeNv method "quest"), both CPU backends: worked blocks
// (scale bytes and codes computed by hand from the definition: the E4M3 rounding of sigma *
// 2.92247856 / 6 + 1e-8, elements E2M1(x * RN(1/s)), tensor scale 1), then random blocks against a
// float64 oracle of the statistic, away from E4M3 rounding boundaries (where fp32 and float64 agree).
TEST(Reference, Nvfp4QuestWorkedBlocksAndOracle) {
  const oracle::Fmt& e2m1 = oracle::fmt(ElemType::e2m1);
  const oracle::Fmt& e4m3 = oracle::fmt(ElemType::e4m3);
  struct Worked {
    float v[16];
    std::uint8_t scale;
    const char* codes;  // element 0 first, hex
  };
  std::vector<Worked> worked;
  {
    Worked a{}, b{}, c{}, d{}, z{};
    for (int i = 0; i < 16; ++i) {
      a.v[i] = float(i) - 7.5f;                                     // sigma^2 = 21.25 -> t = 2.2453 -> 2.25
      b.v[i] = (i % 2 ? -1.0f : 1.0f) * float(i + 1) / 10.0f;       // t = 0.4698 -> 0.46875
      c.v[i] = i % 2 ? -1000.0f : 1000.0f;                          // t = 487.08 -> 448 (saturated)
      d.v[i] = i % 2 ? -0.001f : 0.001f;                            // t = 4.9e-4 <= 2^-10 -> scale 0
      z.v[i] = 0.0f;
    }
    a.scale = 0x41, a.codes = "ddccba9801234455";
    b.scale = 0x2F, b.codes = "091a2b3b4c4d5d5d";
    c.scale = 0x7E, c.codes = "4c4c4c4c4c4c4c4c";
    d.scale = 0x00, d.codes = "0808080808080808";
    z.scale = 0x00, z.codes = "0000000000000000";
    worked = {a, b, c, d, z};
  }
  for (Backend be : {Backend::reference, Backend::cpu}) {
    HostTensor x(DType::f32, std::int64_t(worked.size()), 16);
    for (std::size_t r = 0; r < worked.size(); ++r)
      for (int i = 0; i < 16; ++i) x.set(std::int64_t(r), i, worked[r].v[i]);
    QuantOptions o = QuantOptions::nvfp4();
    o.rule = ScaleRule::quest;
    o.backend = be;
    Quantized q(o, x.rows, x.cols);
    quantize(x.view(), q.out(), o);
    EXPECT_EQ(q.S, 1.0f);
    for (std::size_t r = 0; r < worked.size(); ++r) {
      EXPECT_EQ(q.scale(std::int64_t(r), 0), worked[r].scale) << to_string(be) << " block " << r;
      for (int i = 0; i < 16; ++i) {
        const char h = worked[r].codes[i];
        const std::uint32_t want = std::uint32_t(h <= '9' ? h - '0' : h - 'a' + 10);
        EXPECT_EQ(q.code(std::int64_t(r), i), want) << to_string(be) << " block " << r << " element " << i;
      }
    }
    // dequantize: code * s (tensor scale 1; no tensor_scale option needed)
    QuantOptions od = o;
    HostTensor y(DType::f32, x.rows, x.cols);
    dequantize(q.in(), y.view(), od);
    for (std::int64_t r = 0; r < x.rows; ++r)
      for (int k = 0; k < 16; ++k)
        ASSERT_EQ(y.get(r, k), float(oracle::decode(e2m1, q.code(r, k)) * oracle::decode(e4m3, q.scale(r, 0)))) << r << "," << k;

    // LLM-like rows: every block's scale against the float64 statistic where t is not within 1e-5
    // (relative) of an E4M3 rounding boundary, and every element code against E2M1(v * RN(1/s)).
    const HostTensor xl = th::llm_like(DType::bf16, 7, 16 * 40, 31);
    Quantized ql(o, xl.rows, xl.cols);
    quantize(xl.view(), ql.out(), o);
    oracle::Mismatches mm(std::string("nvfp4 quest ") + std::string(to_string(be)) + " vs float64 oracle");
    int compared = 0;
    for (int r = 0; r < xl.rows; ++r)
      for (int b = 0; b < xl.cols / 16; ++b) {
        double s1 = 0, s2 = 0;
        for (int k = 16 * b; k < 16 * b + 16; ++k) s1 += xl.get(r, k);
        const double mean = s1 / 16;
        for (int k = 16 * b; k < 16 * b + 16; ++k) s2 += (xl.get(r, k) - mean) * (xl.get(r, k) - mean);
        const double t = std::sqrt(s2 / 16) * 2.92247856 / 6 + 1e-8;
        const std::uint32_t sc = oracle::encode(e4m3, t);
        if (oracle::encode(e4m3, t * (1 + 1e-5)) != sc || oracle::encode(e4m3, t * (1 - 1e-5)) != sc) continue;
        ++compared;
        if (ql.scale(r, b) != sc) mm.add("scale " + std::to_string(r) + "," + std::to_string(b));
        const float sv = float(oracle::decode(e4m3, sc));
        const float m = sv == 0 ? 0.0f : 1.0f / sv;
        for (int k = 16 * b; k < 16 * b + 16; ++k) {
          const float v = xl.get(r, k);
          const std::uint32_t want = v == 0 || m == 0 ? (std::signbit(v) ? 8u : 0u) : oracle::encode(e2m1, double(v * m));
          if (ql.code(r, k) != want) mm.add("code " + std::to_string(r) + "," + std::to_string(k));
        }
      }
    EXPECT_GT(compared, 200);
  }
}

TEST(Reference, QdqIsDequantizeOfQuantizeInEveryDtype) {
  for (Format fmt : {Format::mxfp4, Format::mxfp8_e4m3, Format::nvfp4})
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const HostTensor x = th::llm_like(dt, 4, 70, 31);
      QuantOptions o = fmt == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(fmt, ScaleRule::even);
      o.backend = Backend::reference;
      Quantized q(o, 4, 70);
      quantize(x.view(), q.out(), o);
      QuantOptions od = o;
      if (fmt == Format::nvfp4) od.tensor_scale = q.S;
      HostTensor y1(dt, 4, 70), y2(dt, 4, 70);
      dequantize(q.in(), y1.view(), od);
      qdq(x.view(), y2.view(), o);
      th::expect_same_bytes(y1, y2, "qdq vs dequantize(quantize) " + th::name_of(o));
      // In place.
      HostTensor z = x;
      qdq(z.view(), z.view(), o);
      th::expect_same_bytes(z, y2, "in-place qdq " + th::name_of(o));
    }
}

TEST(Reference, StochasticRoundingUsesTheLogicalIndex) {
  // Quantizing the two halves of a tensor with offsets equal to their first element's index gives the
  // same codes as quantizing the whole tensor: the random stream is keyed by position, not by call.
  const HostTensor x = th::llm_like(DType::bf16, 6, 64, 8);
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  o.rounding = Rounding::stochastic;
  o.seed = 0x1234567890ull;
  o.backend = Backend::reference;
  Quantized whole(o, 6, 64);
  quantize(x.view(), whole.out(), o);
  HostTensor top = x, bottom = x;
  Quantized q1(o, 3, 64), q2(o, 3, 64);
  quantize(Tensor::of(x.bytes.data(), DType::bf16, 3, 64), q1.out(), o);
  QuantOptions o2 = o;
  o2.offset = 3 * 64;
  quantize(Tensor::of(x.bytes.data() + 3 * 64 * 2, DType::bf16, 3, 64), q2.out(), o2);
  for (int r = 0; r < 6; ++r)
    for (int k = 0; k < 64; ++k) ASSERT_EQ(whole.code(r, k), r < 3 ? q1.code(r, k) : q2.code(r - 3, k)) << r << "," << k;
  // A different seed changes some codes.
  QuantOptions o3 = o;
  o3.seed = 99;
  Quantized q3(o3, 6, 64);
  quantize(x.view(), q3.out(), o3);
  EXPECT_NE(q3.codes.bytes, whole.codes.bytes);
}
