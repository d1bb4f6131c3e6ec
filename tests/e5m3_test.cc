// nvfp4_e5m3 (NVFP4 with UE5M3 block scales, the vllm-qdq-plugin's format; docs/numerics.md) on every
// backend (the reference too) against an independent formulation of its definition: UE5M3 values enumerated
// from the bits, amax / 6 and x / s exact in double, nearest values found by search (oracle.hpp's E2M1), the
// output converted as the plugin's cast does (fp16 overflow to Inf). Every bf16 and fp16 pattern alone in a
// block and beside block maxima across the scale range, every scale byte with every code, the special blocks
// with bytes written out by hand, and the options the format refuses.
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "grid.hpp"
#include "oracle.hpp"

using namespace mxq;

namespace {

// ---- the oracle -------------------------------------------------------------------------------------------
double ue5m3_value(int b) {
  const int e = b >> 3, m = b & 7;
  return e == 0 ? std::ldexp(double(m), -17) : std::ldexp(1.0 + m / 8.0, e - 15);
}
const std::vector<double>& ue5m3_values() {
  static const std::vector<double> v = [] {
    std::vector<double> t;
    for (int b = 0; b < 256; ++b) t.push_back(ue5m3_value(b));
    return t;
  }();
  return v;
}
// RNE of v >= 0 onto the UE5M3 grid, saturating at 0xFE (114688); NaN gives 0xFE (the plugin's clamp).
int ue5m3_nearest(double v) {
  const std::vector<double>& t = ue5m3_values();
  if (std::isnan(v) || v >= t[0xFE]) return 0xFE;
  const int hi = int(std::upper_bound(t.begin(), t.begin() + 0xFF, v) - t.begin());  // first value > v
  const int lo = hi - 1;
  const double dl = v - t[lo], dh = t[hi] - v;
  return dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
}

// Bits of an exact value v (finite, or +-Inf) in dtype t as the plugin's cast gives them: the value is exact in
// every dtype here, except that fp16 overflows to Inf.
std::uint32_t out_bits(double v, DType t) {
  if (t == DType::f32) return std::bit_cast<std::uint32_t>(float(v));
  if (t == DType::bf16) return std::bit_cast<std::uint32_t>(float(v)) >> 16;  // exact: at most 6 significant bits
  if (std::fabs(v) > 65504.0) return v < 0 ? 0xFC00u : 0x7C00u;
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(v));
}
std::uint32_t nan_of(DType t) { return t == DType::f32 ? 0x7FC00000u : t == DType::bf16 ? 0x7FC0u : 0x7E00u; }

struct BlockWant {
  int scale;
  std::vector<std::uint32_t> codes, qdq;  // per element of the block (padding excluded)
};
// The definition, for a block of values (double, NaN/Inf allowed) of an input dtype, output dtype t.
BlockWant oracle_block(const std::vector<double>& x, DType t) {
  const oracle::Fmt& e2m1 = oracle::fmt(ElemType::e2m1);
  double amax = 0.0;  // zero padding takes part: amax >= 0
  bool nan = false;
  for (double v : x) {
    if (std::isnan(v)) nan = true;
    else amax = std::max(amax, std::fabs(v));
  }
  BlockWant w;
  w.scale = nan ? 0xFE : ue5m3_nearest(amax / 6.0);
  const double s = ue5m3_value(w.scale);
  for (double v : x) {
    if (std::isnan(v)) {
      w.codes.push_back(0);
      w.qdq.push_back(nan_of(t));
      continue;
    }
    const std::uint32_t c = s == 0.0 ? 0u : oracle::encode(e2m1, v / s);  // x / s exact enough: see docs
    w.codes.push_back(c);
    w.qdq.push_back(out_bits(oracle::decode(e2m1, c) * s, t));
  }
  return w;
}

double value_of(DType t, std::uint16_t bits) {
  return t == DType::bf16 ? double(bf16_to_f32(bits)) : double(f16_to_f32(bits));
}

// x (bf16 or fp16, dense, K a multiple of g) on backend b: quantize (codes, scales) and QDQ against the oracle
// block by block; the first mismatches printed with coordinates, block amax and both values.
void expect_matches_oracle(Backend b, const th::HostTensor& x, int g, const std::string& what) {
  const QuantOptions o = QuantOptions::nvfp4_e5m3(g);
  th::Scalar workspace(b);
  th::Placed xb(b, x);
  th::PlacedQuantized q(b, o, x.rows, x.cols);
  quantize(xb.view(), q.out(), th::on(b, o, workspace));
  th::Placed y(b, th::HostTensor(x.dtype, x.rows, x.cols));
  qdq(xb.view(), y.view(), th::on(b, o, workspace));
  const th::HostTensor codes = q.codes.get(), scales = q.scales.get(), mask = q.mask.get(), yq = y.get();
  oracle::Mismatches bad_scale(what + ": scale bytes"), bad_code(what + ": codes"), bad_qdq(what + ": qdq"),
      bad_mask(what + ": clip mask");
  std::vector<double> blk(g);
  for (std::int64_t r = 0; r < x.rows; ++r)
    for (std::int64_t k0 = 0; k0 < x.cols; k0 += g) {
      double amax = 0;
      for (int i = 0; i < g; ++i) {
        blk[i] = value_of(x.dtype, std::uint16_t(x.bits(r, k0 + i)));
        if (!std::isnan(blk[i])) amax = std::max(amax, std::fabs(blk[i]));
      }
      const BlockWant w = oracle_block(blk, x.dtype);
      const std::string where = "[" + std::to_string(r) + ", " + std::to_string(k0) + "] amax " + std::to_string(amax);
      const int sb = scales.bytes[std::size_t(r * scales.stride + k0 / g)];
      if (sb != w.scale) bad_scale.add(where + ": scale " + oracle::hex(sb) + ", want " + oracle::hex(w.scale));
      const double s = ue5m3_value(w.scale);
      for (int i = 0; i < g; ++i) {
        const std::int64_t k = k0 + i;
        const std::uint8_t cb = codes.bytes[std::size_t(r * codes.stride + k / 2)];
        const std::uint32_t c = k % 2 ? cb >> 4 : cb & 0xF;
        const std::string at = where + " x[" + std::to_string(k) + "] = " + std::to_string(blk[i]);
        if (c != w.codes[i]) bad_code.add(at + ": code " + oracle::hex(c) + ", want " + oracle::hex(w.codes[i]));
        if (yq.bits(r, k) != w.qdq[i])
          bad_qdq.add(at + ": qdq " + oracle::hex(yq.bits(r, k)) + " (" + std::to_string(yq.get(r, k)) + "), want " +
                      oracle::hex(w.qdq[i]));
        const bool kept = std::isfinite(blk[i]) && (s == 0.0 || std::fabs(blk[i] / s) < 6.0);
        const bool got_kept = (mask.bytes[std::size_t(r * mask.stride + k / 8)] >> (k % 8)) & 1u;
        if (got_kept != kept) bad_mask.add(at + ": mask bit " + std::to_string(got_kept));
      }
    }
}

// Every pattern of a 16-bit dtype alone in a block (the rest +0), row p = pattern p.
th::HostTensor every_pattern_alone(DType t, int g) {
  th::HostTensor x(t, 65536, g);
  std::fill(x.bytes.begin(), x.bytes.end(), 0);
  for (std::uint32_t p = 0; p < 65536; ++p) std::memcpy(&x.bytes[std::size_t(p) * g * 2], &p, 2);
  return x;
}
// Every pattern beside block maxima: row p holds pattern p in each of its 8 blocks, at a position moving with the
// block, and in each block a maximum from 63 values spaced evenly in log2 from 2^-20 to 1.7 * 2^20 (to 65504 in
// fp16) at another position, the other elements spread below it (so the patterns meet every scale binade, ties
// of x / s included).
th::HostTensor every_pattern_with_maxima(DType t, int g) {
  const int blocks = 8;
  th::HostTensor x(t, 65536, std::int64_t(g) * blocks);
  const double top = t == DType::f16 ? 65504.0 : 1.7 * 1048576.0;
  for (std::uint32_t p = 0; p < 65536; ++p)
    for (int j = 0; j < blocks; ++j) {
      const int a = int((p * blocks + std::uint32_t(j)) % 63);
      const double amax = std::exp2(-20.0 + (std::log2(top) + 20.0) * a / 62.0);
      const int at = int((p + std::uint32_t(j)) % std::uint32_t(g)), am = (at + 5) % g;
      for (int i = 0; i < g; ++i) {
        const std::int64_t k = std::int64_t(j) * g + i;
        if (i == at) std::memcpy(&x.bytes[std::size_t((std::int64_t(p) * x.cols + k) * 2)], &p, 2);
        else if (i == am) x.set(p, k, float(amax));
        else x.set(p, k, float(amax * ((i * 7 + j) % 13) / 13.0 * ((i + j) % 2 ? -1 : 1)));
      }
    }
  return x;
}

class E5m3 : public testing::TestWithParam<Backend> {};

TEST_P(E5m3, EveryBf16AndFp16PatternAloneInABlockMatchesTheDefinition) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  for (DType t : {DType::bf16, DType::f16})
    for (int g : {16, 32})
      expect_matches_oracle(b, every_pattern_alone(t, g), g, std::string(to_string(t)) + " alone, g" + std::to_string(g));
}

TEST_P(E5m3, EveryBf16AndFp16PatternBesideBlockMaximaMatchesTheDefinition) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  for (DType t : {DType::bf16, DType::f16})
    for (int g : {16, 32})
      expect_matches_oracle(b, every_pattern_with_maxima(t, g), g,
                            std::string(to_string(t)) + " beside maxima, g" + std::to_string(g));
}

// dequantize: every scale byte (0xFF too: 122880, never written by quantize) with every code in every position,
// to each output dtype (fp16: Inf past 65504).
TEST_P(E5m3, DequantizeEveryScaleByteAndCode) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  const oracle::Fmt& e2m1 = oracle::fmt(ElemType::e2m1);
  const std::int64_t R = 256, K = 64;  // row r: scale byte r; element k: code (k + r) % 16
  for (int g : {16, 32}) {
    const QuantOptions o = QuantOptions::nvfp4_e5m3(g);
    th::Quantized hq(o, R, K);
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t k = 0; k < K; k += 2)
        hq.codes.bytes[std::size_t(r * (K / 2) + k / 2)] = std::uint8_t(((k + r) % 16) | (((k + 1 + r) % 16) << 4));
      for (std::int64_t c = 0; c < K / g; ++c) hq.scales.bytes[std::size_t(r * (K / g) + c)] = std::uint8_t(r);
    }
    th::Placed codes(b, hq.codes), scales(b, hq.scales);
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      th::Placed y(b, th::HostTensor(t, R, K));
      QuantOptions ob = o;
      ob.backend = b;
      dequantize(QuantizedIn{codes.view(), scales.view()}, y.view(), ob);
      const th::HostTensor got = y.get();
      oracle::Mismatches bad("dequantize g" + std::to_string(g) + " to " + std::string(to_string(t)));
      for (std::int64_t r = 0; r < R; ++r)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::uint32_t c = std::uint32_t((k + r) % 16);
          const double v = oracle::decode(e2m1, c) * ue5m3_value(int(r));
          if (got.bits(r, k) != out_bits(v, t))
            bad.add("[" + std::to_string(r) + ", " + std::to_string(k) + "] scale " + oracle::hex(r) + " code " + oracle::hex(c) +
                    ": " + oracle::hex(got.bits(r, k)) + ", want " + oracle::hex(out_bits(v, t)) + " (" + std::to_string(v) + ")");
        }
    }
  }
}

// The four conventions, and worked blocks, with bytes written out by hand (docs/numerics.md):
//   block 0: 1, -0.5, 3, 6, then zeros: amax / 6 = 1 -> scale 0x78 (e 15, m 0); codes 2, 9, 5, 7
//   block 1: -0 and +0 only: scale 0x00, every code +0 (a zero scale drops the sign), QDQ +0
//   block 2: 6 * 2^-18 (v = 2^-18, the tie between 0 and 2^-17, goes to the even 0) and -2^-20: scale 0,
//            codes +0
//   block 3: NaN, 1, -2, +Inf: scale 0xFE (114688; a NaN amax saturates); codes 0 (NaN: no code), 0
//            (1 / 114688 rounds to 0), 0x8 (-0), 0x7 (Inf saturates at 6); QDQ NaN, +0, -0, 688128
//   block 4: 65504 (fp16's largest) and 1000: 65504 / 6 -> 11264 = 1.375 * 2^13 (0xE3); 65504 / 11264 = 5.8
//            -> 6 (0x7), QDQ 67584: Inf in fp16 (the plugin's cast), exact in bf16; 1000 / 11264 -> 0
//   block 5: -7e-6 alone: 7e-6 / 6 is below 2^-18, half the smallest scale: scale 0, code +0, QDQ +0
TEST_P(E5m3, SpecialBlocksKnownAnswers) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  const int g = 16;
  for (DType t : {DType::bf16, DType::f16, DType::f32}) {
    th::HostTensor x(t, 1, 6 * g);
    for (std::int64_t k = 0; k < x.cols; ++k) x.set(0, k, 0.0f);
    const float v0[] = {1.0f, -0.5f, 3.0f, 6.0f};
    for (int i = 0; i < 4; ++i) x.set(0, i, v0[i]);
    x.set(0, g + 0, -0.0f);
    x.set(0, g + 5, -0.0f);
    x.set(0, 2 * g + 0, std::ldexp(6.0f, -18));
    x.set(0, 2 * g + 1, -std::ldexp(1.0f, -20));
    const float v3[] = {NAN, 1.0f, -2.0f, INFINITY};
    for (int i = 0; i < 4; ++i) x.set(0, 3 * g + i, v3[i]);
    x.set(0, 4 * g + 0, 65504.0f);
    x.set(0, 4 * g + 1, 1000.0f);
    x.set(0, 5 * g + 3, -7e-6f);
    const QuantOptions o = QuantOptions::nvfp4_e5m3(g);
    th::Scalar ws(b);
    th::Placed xb(b, x);
    th::PlacedQuantized q(b, o, 1, x.cols);
    quantize(xb.view(), q.out(), th::on(b, o, ws));
    th::Placed y(b, th::HostTensor(t, 1, x.cols));
    qdq(xb.view(), y.view(), th::on(b, o, ws));
    const th::HostTensor codes = q.codes.get(), scales = q.scales.get(), yq = y.get();
    SCOPED_TRACE(std::string(to_string(t)));
    const auto code = [&](std::int64_t k) { return k % 2 ? codes.bytes[k / 2] >> 4 : codes.bytes[k / 2] & 0xF; };
    EXPECT_EQ(scales.bytes[0], 0x78);
    EXPECT_EQ(code(0), 2);
    EXPECT_EQ(code(1), 9);
    EXPECT_EQ(code(2), 5);
    EXPECT_EQ(code(3), 7);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(yq.get(0, i), v0[i]);
    for (int j : {1, 2, 5}) {
      EXPECT_EQ(scales.bytes[j], 0x00) << "block " << j;
      for (int i = 0; i < g; ++i) {
        EXPECT_EQ(code(j * g + i), 0) << "block " << j << " element " << i;
        EXPECT_EQ(yq.bits(0, j * g + i), 0u) << "block " << j << " element " << i << ": +0";
      }
    }
    EXPECT_EQ(scales.bytes[3], 0xFE);
    EXPECT_EQ(code(3 * g + 0), 0);
    EXPECT_EQ(code(3 * g + 1), 0);
    EXPECT_EQ(code(3 * g + 2), 0x8);
    EXPECT_EQ(code(3 * g + 3), 0x7);
    EXPECT_EQ(yq.bits(0, 3 * g), nan_of(t));
    EXPECT_EQ(yq.bits(0, 3 * g + 1), 0u);
    EXPECT_EQ(yq.bits(0, 3 * g + 2), t == DType::f32 ? 0x80000000u : 0x8000u);
    EXPECT_EQ(yq.bits(0, 3 * g + 3), out_bits(688128.0, t));  // Inf in fp16
    if (t == DType::f16) EXPECT_EQ(yq.bits(0, 3 * g + 3), 0x7C00u);
    // block 4 in fp16 and wider: 65504 is fp16's largest value
    EXPECT_EQ(scales.bytes[4], 0xE3);
    EXPECT_EQ(code(4 * g + 0), 0x7);
    EXPECT_EQ(code(4 * g + 1), 0x0);
    EXPECT_EQ(yq.bits(0, 4 * g), out_bits(67584.0, t));
    if (t == DType::f16) EXPECT_EQ(yq.bits(0, 4 * g), 0x7C00u);
    if (t == DType::bf16) EXPECT_EQ(yq.get(0, 4 * g), 67584.0f);
    // dequantize of quantize: QDQ's bytes everywhere but at the NaN (quantize cannot hold it: code 0, +0)
    QuantOptions od = o;
    od.backend = b;
    th::Placed d(b, th::HostTensor(t, 1, x.cols));
    dequantize(QuantizedIn{q.codes.view(), q.scales.view()}, d.view(), od);
    const th::HostTensor dq = d.get();
    for (std::int64_t k = 0; k < x.cols; ++k)
      EXPECT_EQ(dq.bits(0, k), k == 3 * g ? 0u : yq.bits(0, k)) << "element " << k;
  }
}

// The shapes the CUDA kernels and the CPU tiles treat apart (K not a multiple of g, odd K, strided rows, one
// row, long rows), swizzled scales, in place, with the NaN/Inf blocks of the grid: every backend against the
// reference byte for byte.
TEST_P(E5m3, TailsStridesLayoutsAndInPlaceMatchReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  th::Scalar ws(b);
  std::uint32_t seed = 7;
  for (int g : {16, 32})
    for (ScaleLayout l : {ScaleLayout::linear, ScaleLayout::swizzled})
      for (const th::Shape& s : th::shapes_for(g))
        for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
          QuantOptions o = QuantOptions::nvfp4_e5m3(g);
          o.scale_layout = l;
          SCOPED_TRACE(th::name_of(o) + " " + std::string(to_string(dt)) + " " + core::shape_str(s.rows, s.cols) + " stride " +
                       std::to_string(s.stride));
          const th::HostTensor x = th::grid_input(dt, s, seed++);
          QuantOptions oref = o;
          oref.backend = Backend::reference;
          th::Quantized qr(oref, s.rows, s.cols, true);
          quantize(x.view(), qr.out(), oref);
          th::Placed xb(b, x);
          th::PlacedQuantized q(b, o, s.rows, s.cols);
          quantize(xb.view(), q.out(), th::on(b, o, ws));
          th::expect_same_bytes(qr.codes, q.codes.get(), "codes");
          th::expect_same_bytes(qr.scales, q.scales.get(), "scales");
          th::expect_same_bytes(qr.mask, q.mask.get(), "clip mask");
          th::HostTensor yr(dt, s.rows, s.cols, s.stride);
          qdq(x.view(), yr.view(), oref);
          th::Placed z(b, x);
          qdq(z.view(), z.view(), th::on(b, o, ws));
          th::expect_same_bytes(yr, z.get(), "in-place qdq");
          th::HostTensor dr(dt, s.rows, s.cols, s.stride);
          dequantize(qr.in(), dr.view(), oref);
          th::Placed codes(b, qr.codes), scales(b, qr.scales), d(b, th::HostTensor(dt, s.rows, s.cols, s.stride));
          QuantOptions ob = o;
          ob.backend = b;
          dequantize(QuantizedIn{codes.view(), scales.view()}, d.view(), ob);
          th::expect_same_bytes(dr, d.get(), "dequantize");
        }
}

INSTANTIATE_TEST_SUITE_P(Backends, E5m3, testing::Values(Backend::reference, Backend::cpu, Backend::cuda), th::backend_name);

// What the format refuses, by name: the other rules (and its rule elsewhere), group sizes other than 16 and 32,
// stochastic rounding, rotations, a tensor scale, the fused producer ops.
TEST(E5m3Options, RefusedWithTheArgumentNamed) {
  const th::HostTensor x = th::llm_like(DType::bf16, 2, 64, 3);
  th::HostTensor y(DType::bf16, 2, 64);
  const auto refusal = [&](const QuantOptions& o) {
    try {
      qdq(x.view(), y.view(), o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const auto has = [](const std::string& s, const char* frag) { return s.find(frag) != std::string::npos; };
  QuantOptions o = QuantOptions::nvfp4_e5m3();
  o.rule = ScaleRule::floor;
  std::string m = refusal(o);
  EXPECT_TRUE(has(m, "rule 'floor' is not defined for format 'nvfp4_e5m3'") && has(m, "nvfp4_e5m3 accepts nvfp4_e5m3")) << m;
  o = QuantOptions::nvfp4();
  o.rule = ScaleRule::nvfp4_e5m3;
  m = refusal(o);
  EXPECT_TRUE(has(m, "rule 'nvfp4_e5m3' is not defined for format 'nvfp4'") && has(m, "defined for nvfp4_e5m3")) << m;
  for (int g : {2, 8, 64, 256}) {
    m = refusal(QuantOptions::nvfp4_e5m3(g));
    EXPECT_TRUE(has(m, "option 'group_size'") && has(m, "16 or 32")) << m;
  }
  o = QuantOptions::nvfp4_e5m3();
  o.rounding = Rounding::stochastic;
  m = refusal(o);
  EXPECT_TRUE(has(m, "option 'rounding'") && has(m, "nvfp4_e5m3")) << m;
  o = QuantOptions::nvfp4_e5m3();
  o.rotation = Rotation::hadamard;
  o.rotation_size = 32;
  m = refusal(o);
  EXPECT_TRUE(has(m, "option 'rotation'") && has(m, "nvfp4_e5m3")) << m;
  o = QuantOptions::nvfp4_e5m3();
  o.tensor_scale = 2.0f;
  m = refusal(o);
  EXPECT_TRUE(has(m, "option 'tensor_scale' is only used by format nvfp4")) << m;
  const th::HostTensor w = th::llm_like(DType::bf16, 1, 64, 4);
  const QuantOptions e = QuantOptions::nvfp4_e5m3();
  try {
    rms_norm(x.view(), w.view(), 1e-6f, y.view(), &e);
    ADD_FAILURE() << "rms_norm with an nvfp4_e5m3 qdq accepted";
  } catch (const Error& err) {
    EXPECT_EQ(int(err.code()), int(Error::Code::unsupported));
    EXPECT_TRUE(has(err.what(), "nvfp4_e5m3")) << err.what();
  }
  EXPECT_EQ(parse_format("nvfp4_e5m3"), Format::nvfp4_e5m3);
  EXPECT_EQ(parse_rule("nvfp4_e5m3"), ScaleRule::nvfp4_e5m3);
  EXPECT_EQ(format_info(Format::nvfp4_e5m3).default_group, 16);
  EXPECT_EQ(scale_shape(QuantOptions::nvfp4_e5m3(32), 3, 100), (Shape2{3, 4}));
}

}  // namespace
