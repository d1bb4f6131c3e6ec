// The W4A16 linear: prepack / unpack round trips, the reference against an independent oracle
// (mxq::dequantize to fp32, sums in double), and the CUDA kernels against the reference byte for byte
// on inputs whose fp32 sums are exact in any order; NaN scales, scale padding, strides, determinism,
// argument errors.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <mxq/mxq.hpp>

#include "backends.hpp"
#include "core/linear_layout.hpp"
#include "core/linear_plan.hpp"
#include "helpers.hpp"

namespace {

using mxq::Backend;
using mxq::DType;
using mxq::Format;
using th::HostTensor;

int block_of(Format f) { return f == Format::nvfp4 ? 16 : 32; }

mxq::QuantOptions opts(Format f, mxq::ScaleLayout layout = mxq::ScaleLayout::linear) {
  mxq::QuantOptions o = f == Format::nvfp4 ? mxq::QuantOptions::nvfp4(1.0f) : mxq::QuantOptions::mx(f, mxq::ScaleRule::floor);
  o.scale_layout = layout;
  return o;
}

// A quantized weight [N, K]: random codes and scales. exact: scales from a small set (MXFP4 2^-1..2^1,
// NVFP4 {0.5, 1, 1.5, 2, 3}), so that with x in {-2..2} every fp32 sum is exact in any order.
struct QWeight {
  Format f;
  std::int64_t N, K;
  HostTensor codes, scales;  // u8 [N, K/2], u8 [N, K/g] linear
};
QWeight make_weight(Format f, std::int64_t N, std::int64_t K, std::uint32_t seed, bool exact = true) {
  QWeight w{f, N, K, HostTensor(DType::u8, N, K / 2), HostTensor(DType::u8, N, K / block_of(f))};
  std::mt19937 rng(seed);
  for (auto& b : w.codes.bytes) b = static_cast<std::uint8_t>(rng());
  static const std::uint8_t nv_exact[] = {0x30, 0x38, 0x3C, 0x40, 0x44};
  for (auto& b : w.scales.bytes) {
    if (f == Format::nvfp4)
      b = exact ? nv_exact[rng() % 5] : static_cast<std::uint8_t>(0x20 + rng() % 0x50);
    else
      b = exact ? static_cast<std::uint8_t>(126 + rng() % 3) : static_cast<std::uint8_t>(110 + rng() % 20);
  }
  return w;
}

// A prepacked weight in host memory.
struct Packed {
  HostTensor codes, scales;
  mxq::PackedWeight w;
};
Packed pack(const QWeight& q, mxq::ScaleLayout layout = mxq::ScaleLayout::linear, float S = 1.0f) {
  const mxq::PackedLayout L = mxq::packed_layout(q.f, q.N, q.K);
  Packed p{HostTensor(DType::u8, L.codes.rows, L.codes.cols), HostTensor(DType::u8, L.scales.rows, L.scales.cols), {}};
  p.w.format = q.f;
  p.w.N = q.N;
  p.w.K = q.K;
  p.w.codes = p.codes.view();
  p.w.scales = p.scales.view();
  p.w.tensor_scale = S;
  const mxq::QuantOptions o = opts(q.f, layout);
  if (layout == mxq::ScaleLayout::linear) {
    mxq::prepack({q.codes.view(), q.scales.view()}, o, p.w);
  } else {
    // The swizzled layout, its padding full of 0xFF: no padding byte may reach the packed weight.
    const mxq::Shape2 ss = mxq::scale_shape(o, q.N, q.K);
    HostTensor sw(DType::u8, ss.rows, ss.cols);
    mxq::swizzle_scales(q.scales.view(), sw.view(), Backend::reference);
    const std::int64_t G = q.K / block_of(q.f);
    for (std::int64_t r = 0; r < ss.rows; ++r)
      for (std::int64_t c = 0; c < ss.cols; ++c)
        if (r >= q.N || c >= G) sw.bytes[mxq::swizzled_offset(r, c, ss.cols)] = 0xFF;
    mxq::prepack({q.codes.view(), sw.view()}, o, p.w);
  }
  p.w.codes = p.codes.view();
  p.w.scales = p.scales.view();
  return p;
}

HostTensor make_x(DType dt, std::int64_t M, std::int64_t K, std::uint32_t seed, bool exact = true, std::int64_t stride = 0) {
  HostTensor x(dt, M, K, stride);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) x.set(m, k, exact ? float(int(rng() % 5) - 2) : nd(rng));
  return x;
}

// The oracle: the weight through mxq::dequantize (fp32, tensor scale 1: e2m1 * scale exactly), sums in
// double, rounded to fp32 (exact for the exact inputs), / S, + bias, rounded to the dtype.
HostTensor oracle(const HostTensor& x, const QWeight& q, float S, const HostTensor* bias) {
  HostTensor wf(DType::f32, q.N, q.K);
  mxq::dequantize({q.codes.view(), q.scales.view()}, wf.view(), opts(q.f));
  HostTensor y(x.dtype, x.rows, q.N);
  for (std::int64_t m = 0; m < x.rows; ++m)
    for (std::int64_t n = 0; n < q.N; ++n) {
      double s = 0;
      for (std::int64_t k = 0; k < q.K; ++k) s += double(x.get(m, k)) * double(wf.get(n, k));
      float v = float(s);
      if (q.f == Format::nvfp4) v = v / S;
      if (bias) v = v + bias->get(0, n);
      y.set(m, n, v);
    }
  return y;
}

// y on backend b.
HostTensor run(Backend b, const HostTensor& x, const Packed& p, const HostTensor* bias) {
  HostTensor y(x.dtype, x.rows, p.w.N);
  th::Placed px(b, x), pc(b, p.codes), ps(b, p.scales), py(b, y);
  std::unique_ptr<th::Placed> pb;
  if (bias) pb = std::make_unique<th::Placed>(b, *bias);
  mxq::PackedWeight w = p.w;
  w.codes = pc.view();
  w.scales = ps.view();
  mxq::Tensor bv;
  if (pb) bv = pb->view();
  mxq::linear(px.view(), w, pb ? &bv : nullptr, py.view(), b);
  return py.get();
}

// Bytes equal, NaN equal to any NaN; prints the first mismatches.
void expect_same(const HostTensor& want, const HostTensor& got, const std::string& what) {
  ASSERT_EQ(want.rows, got.rows);
  int bad = 0;
  for (std::int64_t m = 0; m < want.rows; ++m)
    for (std::int64_t n = 0; n < want.cols; ++n) {
      const float a = want.get(m, n), b = got.get(m, n);
      const bool same = (std::isnan(a) && std::isnan(b)) || std::memcmp(&want.bytes[(m * want.stride + n) * 2],
                                                                        &got.bytes[(m * got.stride + n) * 2], 2) == 0;
      if (!same && bad++ < 8) ADD_FAILURE() << what << ": y(" << m << ", " << n << ") want " << a << " got " << b;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.rows * want.cols << " outputs differ";
}

const Format kFormats[] = {Format::mxfp4, Format::nvfp4};

TEST(Linear, PackedLayoutShapes) {
  const mxq::PackedLayout a = mxq::packed_layout(Format::mxfp4, 2880, 2880);
  EXPECT_EQ(a.Np, 2880);
  EXPECT_EQ(a.Kp, 2880);
  EXPECT_EQ(mxq::packed_layout(Format::mxfp4, 2880, 2912).Kp, 2944);
  EXPECT_EQ(a.codes, (mxq::Shape2{2880 / 16 * (a.Kp / 64), 512}));
  EXPECT_EQ(a.scales.cols, 32);
  const mxq::PackedLayout b = mxq::packed_layout(Format::nvfp4, 1, 16);
  EXPECT_EQ(b.Np, 32);
  EXPECT_EQ(b.Kp, 64);
  EXPECT_EQ(b.scales, (mxq::Shape2{2, 64}));
}

TEST(Linear, PrepackUnpackRoundTripsAndIgnoresScalePadding) {
  for (Format f : kFormats)
    for (auto [N, K] : {std::pair<std::int64_t, std::int64_t>{1, 32}, {17, 64}, {33, 96}, {100, 2880}, {130, 4096}}) {
      const QWeight q = make_weight(f, N, K, std::uint32_t(N * 7 + K), /*exact=*/false);
      const Packed p = pack(q);
      HostTensor codes(DType::u8, N, K / 2), scales(DType::u8, N, K / block_of(f));
      mxq::unpack(p.w, {codes.view(), scales.view()});
      EXPECT_EQ(codes.bytes, q.codes.bytes) << mxq::to_string(f) << " " << N << "x" << K;
      EXPECT_EQ(scales.bytes, q.scales.bytes) << mxq::to_string(f) << " " << N << "x" << K;
      const Packed ps = pack(q, mxq::ScaleLayout::swizzled);
      EXPECT_EQ(ps.codes.bytes, p.codes.bytes) << mxq::to_string(f) << " swizzled";
      EXPECT_EQ(ps.scales.bytes, p.scales.bytes) << mxq::to_string(f) << " swizzled";
      EXPECT_EQ(ps.w.exp_shift, p.w.exp_shift);
    }
}

// The packed layout's tiles, element by element, from the formula docs/linear.md states; the code bit
// table is a bijection onto the 32 bits of a word.
TEST(Linear, PackedLayoutMatchesTheDocumentedFormula) {
  unsigned seen = 0;
  for (int pair = 0; pair < 4; ++pair)
    for (int half = 0; half < 2; ++half)
      for (int b = 0; b < 4; ++b) seen |= 1u << mxq::core::kCodeBit[pair][half][b];
  EXPECT_EQ(seen, 0xFFFFFFFFu);
  const std::int64_t N = 32, K = 128;
  QWeight q = make_weight(Format::mxfp4, N, K, 5, false);
  const Packed p = pack(q);
  const std::int64_t katoms = 2;
  for (std::int64_t r = 0; r < 2; ++r)
    for (std::int64_t a = 0; a < katoms; ++a)
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          std::uint32_t word = 0;
          std::memcpy(&word, &p.codes.bytes[(r * katoms + a) * 512 + lane * 16 + j * 4], 4);
          for (int pair = 0; pair < 4; ++pair)
            for (int half = 0; half < 2; ++half) {
              const std::int64_t row = 16 * r + lane / 4 + 8 * (pair & 1);
              const std::int64_t col = 64 * a + 16 * (lane % 4) + 4 * j + 2 * (pair >> 1) + half;
              const unsigned want = (q.codes.bytes[row * (K / 2) + col / 2] >> (4 * (col & 1))) & 15;
              unsigned got = 0;
              for (int b = 0; b < 4; ++b) got |= ((word >> mxq::core::kCodeBit[pair][half][b]) & 1u) << b;
              ASSERT_EQ(got, want) << "tile " << r << "," << a << " lane " << lane << " j " << j << " pair " << pair << " half " << half;
            }
        }
}

// A weight of more than 2^20 elements (prepack and unpack then split their loops over threads where
// OpenMP is built in): every code and scale byte where the documented formula puts it, the padding rows'
// scales neutral, the round trip exact, and a refused scale span named at the first such block.
TEST(Linear, LargeWeightPacksByTheFormula) {
  for (Format f : kFormats) {
    const std::int64_t N = 1040, K = 1024, G = K / block_of(f), katoms = K / 64;  // 1040: not a multiple of 32
    const QWeight q = make_weight(f, N, K, 17, false);
    const Packed p = pack(q);
    const bool nv = f == Format::nvfp4;
    const int slots = nv ? 32 : 16;
    std::uint8_t emax = 0;
    for (std::uint8_t b : q.scales.bytes) emax = std::max(emax, b);
    const std::int64_t rtiles = mxq::packed_layout(f, N, K).Np / 16;
    for (std::int64_t r = 0; r < rtiles; ++r)
      for (std::int64_t a = 0; a < katoms; ++a) {
        const std::int64_t tile = r * katoms + a;
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < 4; ++j) {
            std::uint32_t word = 0;
            std::memcpy(&word, &p.codes.bytes[tile * 512 + lane * 16 + j * 4], 4);
            for (int pair = 0; pair < 4; ++pair)
              for (int half = 0; half < 2; ++half) {
                const std::int64_t row = 16 * r + lane / 4 + 8 * (pair & 1);
                const std::int64_t col = 64 * a + 16 * (lane % 4) + 4 * j + 2 * (pair >> 1) + half;
                const unsigned want = row < N ? (q.codes.bytes[row * (K / 2) + col / 2] >> (4 * (col & 1))) & 15 : 0;
                ASSERT_EQ(mxq::core::unpack_code_bits(word, pair, half), want)
                    << mxq::to_string(f) << " tile " << r << "," << a << " lane " << lane << " j " << j;
              }
          }
        for (int slot = 0; slot < slots; ++slot)
          for (int b = 0; b < 2; ++b) {
            // MXFP4 slot 2g + h: block 2a + h of rows 16r + g (+ 8); NVFP4 slot 4g + q: block 4a + q
            const int g = nv ? slot >> 2 : slot >> 1, h = nv ? slot & 3 : slot & 1;
            const std::int64_t row = 16 * r + g + 8 * b, blk = (nv ? 4 : 2) * a + h;
            const std::uint8_t want = row < N ? q.scales.bytes[row * G + blk] : nv ? std::uint8_t(0x38) : emax;
            ASSERT_EQ(p.scales.bytes[tile * 2 * slots + 2 * slot + b], want)
                << mxq::to_string(f) << " tile " << r << "," << a << " slot " << slot << " byte " << b;
          }
      }
    HostTensor codes(DType::u8, N, K / 2), scales(DType::u8, N, G);
    mxq::unpack(p.w, {codes.view(), scales.view()});
    EXPECT_EQ(codes.bytes, q.codes.bytes) << mxq::to_string(f);
    EXPECT_EQ(scales.bytes, q.scales.bytes) << mxq::to_string(f);
  }
  // Two MXFP4 blocks 2^143 below the largest scale (the others, 110..129, within 2^133 of it): the error
  // names the first in row-major order.
  QWeight q = make_weight(Format::mxfp4, 1040, 1024, 19, false);
  const std::int64_t G = 1024 / 32;
  q.scales.bytes[3 * G + 5] = 243;
  for (auto [n, j] : {std::pair<std::int64_t, std::int64_t>{900, 1}, {700, 3}}) {
    q.scales.bytes[n * G + j] = 100;
    q.codes.bytes[n * 512 + j * 16] = 0x11;  // non-zero codes in the block
  }
  try {
    (void)pack(q);
    ADD_FAILURE() << "a scale span of 2^143 was packed";
  } catch (const mxq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight block (700, 3) has E8M0 scale 100"), std::string::npos) << e.what();
  }
}

// The prefill kernel's x tile order against the packed layout: for every k16 step i and lane (g, q), the
// columns the lane's A fragment holds as k = 0..15 are the x columns the wgmma reads as k = 0..15.
TEST(Linear, WgmmaXTileOrderMatchesThePackedLayout) {
  std::array<int, 64> seen{};
  for (int c = 0; c < 64; ++c) {
    const int p = mxq::core::wgmma_x_column(c);
    ASSERT_TRUE(p >= 0 && p < 64) << c;
    ++seen[p];
  }
  for (int p = 0; p < 64; ++p) EXPECT_EQ(seen[p], 1) << "position " << p << " is not the image of exactly one column";
  for (int i = 0; i < 4; ++i)
    for (int q = 0; q < 4; ++q)
      for (int pair = 0; pair < 4; ++pair)
        for (int half = 0; half < 2; ++half) {
          // the documented layout: nibble (pair, half) of word i of lane (g, q) is column 16 q + 4 i + 2 (pair >> 1) + half
          const int col = 16 * q + 4 * i + 2 * (pair >> 1) + half;
          // the m16n8k16 A fragment: pairs 0-1 are k = 2 q + half, pairs 2-3 are k = 2 q + 8 + half
          const int k = 2 * q + 8 * (pair >> 1) + half;
          EXPECT_EQ(mxq::core::wgmma_x_column(col), 16 * i + k) << "step " << i << " lane q " << q << " pair " << pair << " half " << half;
        }
}

TEST(Linear, ReferenceMatchesOracleOnExactSums) {
  for (Format f : kFormats)
    for (DType dt : {DType::bf16, DType::f16})
      for (auto [M, N, K] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 1, 32}, {7, 33, 96}, {3, 40, 2880}}) {
        const QWeight q = make_weight(f, N, K, std::uint32_t(M + N + K));
        const float S = f == Format::nvfp4 ? 2688.0f / 5.3f : 1.0f;
        const Packed p = pack(q, mxq::ScaleLayout::linear, S);
        const HostTensor x = make_x(dt, M, K, 11);
        HostTensor bias(dt, 1, N);
        for (std::int64_t n = 0; n < N; ++n) bias.set(0, n, float(n % 7) - 3.0f);
        const std::string what = std::string(mxq::to_string(f)) + " " + std::string(mxq::to_string(dt)) + " " +
                                 std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K);
        expect_same(oracle(x, q, S, nullptr), run(Backend::reference, x, p, nullptr), what);
        expect_same(oracle(x, q, S, &bias), run(Backend::reference, x, p, &bias), what + " bias");
        expect_same(oracle(x, q, S, &bias), run(Backend::cpu, x, p, &bias), what + " cpu");
      }
}

// dequantize_packed: e2m1 * scale * 2^-exp_shift, rounded once (exactly) to the dtype.
TEST(Linear, DequantizePackedIsTheScaledWeight) {
  for (Format f : kFormats) {
    const QWeight q = make_weight(f, 40, 96, 6, false);
    const Packed p = pack(q);
    HostTensor wf(DType::f32, q.N, q.K), out(DType::bf16, q.N, q.K);
    mxq::dequantize({q.codes.view(), q.scales.view()}, wf.view(), opts(q.f));
    mxq::dequantize_packed(p.w, out.view());
    for (std::int64_t n = 0; n < q.N; ++n)
      for (std::int64_t k = 0; k < q.K; ++k)
        ASSERT_EQ(out.get(n, k), std::ldexp(wf.get(n, k), -p.w.exp_shift)) << mxq::to_string(f) << " (" << n << ", " << k << ")";
  }
}

TEST(Linear, NanScaleGivesNanRows) {
  for (Format f : kFormats) {
    QWeight q = make_weight(f, 40, 64, 3);
    q.scales.bytes[5 * q.scales.cols + 1] = f == Format::nvfp4 ? 0x7F : 0xFF;  // row 5, block 1
    const Packed p = pack(q);
    const HostTensor x = make_x(DType::bf16, 3, 64, 4);
    const HostTensor y = run(Backend::reference, x, p, nullptr);
    for (std::int64_t m = 0; m < 3; ++m)
      for (std::int64_t n = 0; n < 40; ++n) EXPECT_EQ(std::isnan(y.get(m, n)), n == 5) << m << "," << n;
  }
}

TEST(Linear, RefusesBadArguments) {
  const QWeight q = make_weight(Format::mxfp4, 40, 64, 1);
  Packed p = pack(q);
  HostTensor x(DType::bf16, 2, 64), y(DType::bf16, 2, 40), xf(DType::f32, 2, 64), y2(DType::bf16, 2, 41);
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const mxq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { mxq::linear(xf.view(), p.w, nullptr, y.view()); }, "x: dtype f32");
  expect_error([&] { mxq::linear(x.view(), p.w, nullptr, y2.view()); }, "y");
  HostTensor xk(DType::bf16, 2, 96);
  expect_error([&] { mxq::linear(xk.view(), p.w, nullptr, y.view()); }, "K = 64");
  mxq::PackedWeight bad = p.w;
  bad.format = Format::mxfp8_e4m3;
  expect_error([&] { mxq::linear(x.view(), bad, nullptr, y.view()); }, "mxfp4 or nvfp4");
  bad = p.w;
  bad.K = 48;
  expect_error([&] { mxq::linear(x.view(), bad, nullptr, y.view()); }, "multiple of 32");
  bad = p.w;
  bad.format = Format::nvfp4;
  expect_error([&] { mxq::linear(x.view(), bad, nullptr, y.view()); }, "w.scales");
  expect_error([&] { (void)mxq::packed_layout(Format::nvfp4, 0, 16); }, "N >= 1");
  // group size other than the format's block
  mxq::QuantOptions o = opts(Format::mxfp4);
  o.group_size = 16;
  mxq::PackedWeight w = p.w;
  expect_error([&] { mxq::prepack({q.codes.view(), q.scales.view()}, o, w); }, "group size 16");
  // an MXFP4 weight whose scales span more than 2^24: fp16 activations refused, bf16 fine
  QWeight wide = make_weight(Format::mxfp4, 40, 64, 2);
  wide.scales.bytes[0] = 100;
  wide.scales.bytes[1] = 140;
  const Packed pw = pack(wide);
  EXPECT_FALSE(pw.w.f16_exact);
  HostTensor xh(DType::f16, 2, 64), yh(DType::f16, 2, 40);
  expect_error([&] { mxq::linear(xh.view(), pw.w, nullptr, yh.view()); }, "f16 activations");
  EXPECT_NO_THROW(mxq::linear(x.view(), pw.w, nullptr, y.view()));
}

// MXFP4 block scales 130 binades apart: the small blocks' kernel operands are bf16 subnormals (exact);
// 134 apart: refused.
QWeight wide_scales(int span) {
  QWeight q = make_weight(Format::mxfp4, 40, 64, 7);
  for (std::int64_t n = 0; n < q.N; ++n)
    for (std::int64_t j = 0; j < 2; ++j) q.scales.bytes[n * 2 + j] = n == 3 ? std::uint8_t(140 - span) : std::uint8_t(140);
  return q;
}
HostTensor wide_x() {
  HostTensor x = make_x(DType::bf16, 3, 64, 8);
  for (std::int64_t k = 0; k < 64; ++k) x.set(0, k, 32.0f * float(k % 5 - 2));  // products stay normal fp32
  return x;
}

TEST(Linear, EveryPlanHasAKernel) {
  for (int sm : {80, 89, 90})
   for (bool wgmma : {false, true})
    for (std::int64_t M : {1, 7, 8, 9, 16, 17, 32, 33, 64, 65, 129, 300, 4096})
      for (std::int64_t N : {1, 100, 4096, 4097, 8192, 12288, 14336, 28672})
        for (std::int64_t K : {32, 2880, 4096, 8192, 14336}) {
          const mxq::core::LinearPlan p = mxq::core::plan_linear(N, K, M, sm, wgmma);
          if (p.wgmma) EXPECT_EQ(sm, 90) << "the prefill kernel is sm90a code";
          EXPECT_TRUE(mxq::core::has_kernel(p)) << "sm" << sm << " M=" << M << " N=" << N << " K=" << K << ": " << mxq::core::to_string(p);
          if (sm < 90) EXPECT_EQ(p.cluster, 1) << "clusters need sm90";
          if (p.xstage) EXPECT_GE(p.tokens, 32) << "x staging is for the medium-M tiles";
          EXPECT_EQ(p.grid_n, ((N + 31) / 32 + p.groups - 1) / p.groups * p.cluster);
        }
}

TEST(Linear, WgmmaTileChoice) {
  // The first row of kWgmmaKernels whose M range holds M and that gives >= kWgmmaMinCtas CTAs; else the
  // mma.sync tiles. "tokens x rows / K split", or "mma".
  const auto tile = [](std::int64_t N, std::int64_t K, std::int64_t M) {
    const mxq::core::LinearPlan p = mxq::core::plan_linear(N, K, M, 90, true);
    if (!p.wgmma) return std::string("mma");
    return std::to_string(p.tokens) + " x " + std::to_string(32 * p.groups) + " / " + std::to_string(p.cluster);
  };
  EXPECT_EQ(tile(8192, 8192, 1024), "128 x 256 / 1");
  EXPECT_EQ(tile(14336, 4096, 256), "128 x 256 / 1");  // 112 CTAs
  EXPECT_EQ(tile(8192, 8192, 256), "128 x 256 / 2");   // 64 CTAs unsplit, 128 split
  EXPECT_EQ(tile(14336, 4096, 128), "128 x 256 / 2");  // 56 and 112
  EXPECT_EQ(tile(8192, 8192, 128), "64 x 256 / 2");    // 32, 64, then 128
  EXPECT_EQ(tile(4096, 4096, 256), "128 x 128 / 2");   // 32, 64, then 128 (64-token rows stop at M = 128)
  EXPECT_EQ(tile(14336, 4096, 64), "64 x 256 / 2");    // 112
  EXPECT_EQ(tile(8192, 8192, 64), "64 x 128 / 2");     // 64, then 128
  EXPECT_EQ(tile(4096, 4096, 64), "mma");              // 32 and 64
  EXPECT_EQ(tile(28672, 8192, 32), "mma");             // M <= 32 never takes it
  EXPECT_EQ(mxq::core::plan_linear(8192, 8192, 1024, 90, false).wgmma, false);
  EXPECT_EQ(mxq::core::plan_linear(8192, 8192, 1024, 89, true).wgmma, false);
  // The printed plan names the weight ring: registers for the 128-token rows, shared memory for the 64.
  const std::string big = mxq::core::to_string(mxq::core::plan_linear(8192, 8192, 1024, 90, true));
  const std::string small = mxq::core::to_string(mxq::core::plan_linear(8192, 8192, 64, 90, true));
  EXPECT_NE(big.find("tiles in flight 4"), std::string::npos) << big;
  EXPECT_EQ(big.find("shared-memory ring"), std::string::npos) << big;
  EXPECT_NE(small.find("weights through a shared-memory ring of 6 tiles"), std::string::npos) << small;
}

TEST(Linear, ScaleSpanLimit) {
  EXPECT_THROW((void)pack(wide_scales(134)), mxq::Error);
  const Packed p = pack(wide_scales(130));
  const HostTensor x = wide_x();
  const QWeight q = wide_scales(130);
  expect_same(oracle(x, q, 1.0f, nullptr), run(Backend::reference, x, p, nullptr), "span 2^130");
}

// ---- CUDA against the reference ---------------------------------------------------------------------

TEST(LinearCuda, SubnormalOperandsAreExact) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  const Packed p = pack(wide_scales(130));
  const HostTensor x = wide_x();
  expect_same(run(Backend::reference, x, p, nullptr), run(Backend::cuda, x, p, nullptr), "span 2^130");
}

TEST(LinearCuda, DequantizePackedMatchesTheReference) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  for (Format f : kFormats)
    for (DType dt : {DType::bf16, DType::f16}) {
      const QWeight q = make_weight(f, 100, 2880, 4, false);
      const Packed p = pack(q);
      HostTensor want(dt, q.N, q.K), got(dt, q.N, q.K);
      mxq::dequantize_packed(p.w, want.view(), Backend::reference);
      th::Placed pc(Backend::cuda, p.codes), ps(Backend::cuda, p.scales), po(Backend::cuda, got);
      mxq::PackedWeight w = p.w;
      w.codes = pc.view();
      w.scales = ps.view();
      mxq::dequantize_packed(w, po.view(), Backend::cuda);
      EXPECT_EQ(po.get().bytes, want.bytes) << mxq::to_string(f) << " " << mxq::to_string(dt);
    }
}

struct Case {
  std::int64_t M, N, K;
};

// Each case, format and dtype: the CUDA linear against the reference, with a bias (and once without).
void expect_cases_match(const std::vector<Case>& cases, const std::vector<Format>& formats, const std::vector<DType>& dtypes) {
  for (Format f : formats)
    for (DType dt : dtypes)
      for (const Case& c : cases) {
        const QWeight q = make_weight(f, c.N, c.K, std::uint32_t(c.M * 31 + c.N + c.K));
        const float S = f == Format::nvfp4 ? 2688.0f / 3.7f : 1.0f;
        const Packed p = pack(q, mxq::ScaleLayout::linear, S);
        const HostTensor x = make_x(dt, c.M, c.K, std::uint32_t(c.K));
        HostTensor bias(dt, 1, c.N);
        for (std::int64_t n = 0; n < c.N; ++n) bias.set(0, n, float(n % 5) - 2.0f);
        const std::string what = std::string(mxq::to_string(f)) + " " + std::string(mxq::to_string(dt)) + " M=" +
                                 std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
        const HostTensor want = run(Backend::reference, x, p, &bias);
        expect_same(want, run(Backend::cuda, x, p, &bias), what);
        if (c.M == 17 && c.N == 100) expect_same(run(Backend::reference, x, p, nullptr), run(Backend::cuda, x, p, nullptr), what + " no bias");
      }
}

// One small case per kernel kind (the sanitizers' subset): tokens 1/8/16, two groups per CTA, a cluster,
// x staged with 4 and 2 groups (K slices with different atom counts; on sm_90 the sm90a kernel takes
// some of these shapes, and the next test runs those tiles), and on sm_90 every row of the sm90a
// kernel's table: 128 x 256, 128 x 256 / 2, 64 x 256 / 2, 128 x 128 / 2, 64 x 128 / 2.
TEST(LinearCuda, EveryKernelKindOnce) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  expect_cases_match({{1, 100, 2880}, {7, 40, 96}, {16, 12300, 192}, {1, 100, 8192}, {33, 12300, 320}, {64, 5700, 2880},
                      {260, 12300, 128}, {129, 8200, 128}, {64, 14336, 320}, {200, 4100, 160}, {64, 8200, 96}},
                     {Format::mxfp4}, {DType::bf16});
}

// The mma.sync tiles where the sm90a kernel would take the shape (MXQ_LINEAR_NO_WGMMA=1): x staged with
// 4 and 2 groups per CTA (64 tokens), which sm_90 otherwise leaves to the sm90a kernel.
TEST(LinearCuda, MmaTilesWhereTheWgmmaKernelWouldRun) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  setenv("MXQ_LINEAR_NO_WGMMA", "1", 1);
  struct Unset {
    ~Unset() { unsetenv("MXQ_LINEAR_NO_WGMMA"); }
  } unset;
  EXPECT_EQ(mxq::core::plan_linear(8200, 96, 64, 90, false).groups, 2);
  EXPECT_EQ(mxq::core::plan_linear(12300, 320, 33, 90, false).groups, 4);
  expect_cases_match({{33, 12300, 320}, {64, 14336, 320}, {100, 8200, 704}, {64, 8200, 96}, {260, 12300, 128}},
                     {std::begin(kFormats), std::end(kFormats)}, {DType::bf16, DType::f16});
}

TEST(LinearCuda, MatchesReferenceOnExactSums) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  std::vector<Case> cases;
  for (std::int64_t M : {1, 7, 16, 17, 33, 64, 129})
    for (auto [N, K] : {std::pair<std::int64_t, std::int64_t>{1, 32}, {40, 96}, {100, 2880}, {360, 2880}}) cases.push_back({M, N, K});
  cases.push_back({1000, 40, 96});
  cases.push_back({1000, 300, 320});
  cases.push_back({16, 4096, 4096});
  cases.push_back({3, 4100, 1024});
  // the table's other rows on sm90: two 32-row groups per CTA (an odd last group past N), a 2-CTA cluster
  cases.push_back({1, 12300, 128});
  cases.push_back({16, 12300, 192});
  cases.push_back({1, 100, 8192});
  cases.push_back({5, 4096, 8192});
  // x staged in shared memory (M >= 17): 4 and 2 groups per CTA, odd last groups, K slices without atoms,
  // rows past M (on sm_90 the sm90a kernel takes M = 33 N = 12300 and M = 1000 N = 1000)
  cases.push_back({20, 12300, 192});
  cases.push_back({32, 5700, 96});
  cases.push_back({33, 12300, 320});
  cases.push_back({64, 5700, 2880});
  cases.push_back({129, 2900, 2880});
  cases.push_back({1000, 1000, 320});
  // the sm90a prefill kernel (an sm90a build on an sm_90 device): N, K and M off its tiles; 256-row tiles
  cases.push_back({260, 12300, 128});
  cases.push_back({1000, 4100, 704});
  // K split over 2 CTAs where the unsplit tile gives too few CTAs: a K tail, N off 8 (the epilogue's
  // scalar tail), an odd last M tile, uneven K ranges, a rank without K atoms (K = 32)
  cases.push_back({2050, 1000, 96});
  cases.push_back({129, 8201, 320});
  cases.push_back({260, 5000, 192});
  cases.push_back({33, 14340, 704});   // 64 x 256 / 2
  cases.push_back({40, 14336, 32});    // 64 x 256 / 2, one K atom
  cases.push_back({100, 8200, 96});    // 64 x 256 / 2, two token tiles
  cases.push_back({50, 8201, 160});    // 64 x 128 / 2
  cases.push_back({200, 4100, 160});   // 128 x 128 / 2
  expect_cases_match(cases, {std::begin(kFormats), std::end(kFormats)}, {DType::bf16, DType::f16});
}

TEST(LinearCuda, UnalignedPackedWeightIsRefused) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  const QWeight q = make_weight(Format::mxfp4, 32, 64, 1);
  const Packed p = pack(q);
  const HostTensor x = make_x(DType::bf16, 2, 64, 2);
  const HostTensor y(x.dtype, x.rows, p.w.N);
  HostTensor codes = p.codes, scales = p.scales;  // 16 spare bytes, so that the views 1 byte in stay inside
  codes.bytes.resize(codes.bytes.size() + 16);
  scales.bytes.resize(scales.bytes.size() + 16);
  th::Placed px(Backend::cuda, x), pc(Backend::cuda, codes), ps(Backend::cuda, scales), py(Backend::cuda, y);
  for (const char* which : {"w.codes", "w.scales"}) {
    mxq::PackedWeight w = p.w;
    w.codes = pc.view();
    w.scales = ps.view();
    mxq::Tensor& t = std::string(which) == "w.codes" ? w.codes : w.scales;
    t.data = static_cast<unsigned char*>(t.data) + 1;
    try {
      mxq::linear(px.view(), w, nullptr, py.view(), Backend::cuda);
      ADD_FAILURE() << which << " 1 byte off 16-byte alignment was accepted";
    } catch (const mxq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(which), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
    }
  }
}

TEST(LinearCuda, RowStrideNanScalesAndDeterminism) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  for (Format f : kFormats) {
    // x with a row stride of K + 8
    const QWeight q = make_weight(f, 72, 640, 9);
    const Packed p = pack(q, mxq::ScaleLayout::linear, 2.0f);
    const HostTensor xs = make_x(DType::bf16, 5, 640, 8, true, 648);
    expect_same(run(Backend::reference, xs, p, nullptr), run(Backend::cuda, xs, p, nullptr), "row stride");
    // NaN scale
    QWeight qn = make_weight(f, 40, 64, 3);
    qn.scales.bytes[5 * qn.scales.cols + 1] = f == Format::nvfp4 ? 0x7F : 0xFF;
    const Packed pn = pack(qn);
    const HostTensor x = make_x(DType::bf16, 3, 64, 4);
    expect_same(run(Backend::reference, x, pn, nullptr), run(Backend::cuda, x, pn, nullptr), "NaN scale");
    // LLM-like data (sums not exact): two runs, the same bytes
    const QWeight ql = make_weight(f, 1024, 4096, 12, false);
    const Packed pl = pack(ql, mxq::ScaleLayout::linear, 300.0f);
    const HostTensor xl = make_x(DType::bf16, 16, 4096, 13, false);
    const HostTensor a = run(Backend::cuda, xl, pl, nullptr), b = run(Backend::cuda, xl, pl, nullptr);
    EXPECT_EQ(a.bytes, b.bytes) << "two runs differ";
  }
}

}  // namespace
