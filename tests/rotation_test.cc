// Rotation before quantization (Hadamard, randomised Hadamard) on the CPU backends: the butterfly
// against float64 x @ H, an independent transcription of the documented order against the library's
// bytes, the fast CPU path against the reference, the inverse, the SQNR it buys on outlier data, and
// the refusals; the CUDA backend's bytes against the reference.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "core/codec.hpp"
#include "core/rotation.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

const int kSizes[] = {16, 32, 64, 128, 256};

// The documented order, written out again: signs, stages h = 1..RS/2 over pairs (j, j + h), one
// multiplication by RN32(1/sqrt(RS)).
void transcribed_rotation(float* v, int rs, bool random, std::uint64_t seed) {
  if (random)
    for (int i = 0; i < rs; ++i) {
      const core::U32x4 r = core::philox_block(seed, std::uint64_t(i / 128));
      if ((r.v[(i / 32) % 4] >> (i % 32)) & 1u) v[i] = -v[i];
    }
  for (int h = 1; h < rs; h *= 2)
    for (int i = 0; i < rs; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  const float n = static_cast<float>(1.0 / std::sqrt(double(rs)));
  for (int i = 0; i < rs; ++i) v[i] *= n;
}

TEST(Rotation, ButterflyIsTheNormalisedHadamardProduct) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int rs : kSizes) {
    std::vector<float> x(rs);
    for (float& v : x) v = nd(rng);
    std::vector<float> y = x;
    core::rotate_group(y.data(), rs, Rotation::hadamard, core::RotationSigns{}, false);
    double norm2 = 0;
    for (float v : x) norm2 += double(v) * v;
    for (int j = 0; j < rs; ++j) {
      double e = 0;
      for (int i = 0; i < rs; ++i) e += double(x[i]) * ((__builtin_popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0);
      e /= std::sqrt(double(rs));
      EXPECT_NEAR(y[j], e, 1e-6 * std::sqrt(norm2) * std::log2(double(rs))) << "RS " << rs << " j " << j;
    }
    EXPECT_EQ(core::hadamard_normalizer(rs), static_cast<float>(1.0 / std::sqrt(double(rs)))) << rs;
    // the inverse brings x back (orthogonal), within rounding
    core::rotate_group(y.data(), rs, Rotation::hadamard, core::RotationSigns{}, true);
    for (int i = 0; i < rs; ++i) EXPECT_NEAR(y[i], x[i], 1e-6 * std::sqrt(norm2)) << rs;
  }
}

QuantOptions rotated(QuantOptions o, Rotation r, int rs, std::uint64_t seed = 7) {
  o.rotation = r;
  o.rotation_size = rs;
  o.rotation_seed = seed;
  return o;
}

// qdq with a rotation == qdq of the transcribed rotation's fp32 tensor, rounded to the dtype.
TEST(Rotation, QdqEqualsQdqOfTheTranscribedRotation) {
  for (Backend b : {Backend::reference, Backend::cpu})
    for (int rs : kSizes)
      for (Rotation r : {Rotation::hadamard, Rotation::random_hadamard})
        for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even),
                                         QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor), QuantOptions::nvfp4()})
          for (DType dt : {DType::bf16, DType::f32}) {
            const std::int64_t R = 5, K = 512;
            const th::HostTensor x = th::llm_like(dt, R, K, 11);
            th::HostTensor t(DType::f32, R, K);
            for (std::int64_t row = 0; row < R; ++row)
              for (std::int64_t k0 = 0; k0 < K; k0 += rs) {
                float v[256];
                for (int i = 0; i < rs; ++i) v[i] = x.get(row, k0 + i);
                transcribed_rotation(v, rs, r == Rotation::random_hadamard, 7);
                for (int i = 0; i < rs; ++i) t.set(row, k0 + i, v[i]);
              }
            QuantOptions plain = base;
            plain.backend = Backend::reference;
            qdq(t.view(), t.view(), plain);
            th::HostTensor expect(dt, R, K);
            for (std::int64_t row = 0; row < R; ++row)
              for (std::int64_t k = 0; k < K; ++k) expect.set(row, k, t.get(row, k));  // RNE to the dtype
            QuantOptions o = rotated(base, r, rs);
            o.backend = b;
            th::HostTensor y(dt, R, K);
            qdq(x.view(), y.view(), o);
            th::expect_same_bytes(expect, y, std::string(to_string(b)) + " " + th::name_of(base) + " " +
                                                 std::string(to_string(r)) + " RS " + std::to_string(rs) + " " +
                                                 std::string(to_string(dt)));
          }
}

// tensor_amax(x, opt): the amax of the rotated tensor (NVFP4's computed scale of a rotated quantize).
TEST(Rotation, TensorAmaxOfTheRotatedTensor) {
  const std::int64_t R = 7, K = 256;
  const th::HostTensor x = th::llm_like(DType::bf16, R, K, 21);
  for (Rotation r : {Rotation::hadamard, Rotation::random_hadamard}) {
    float want = 0;
    for (std::int64_t row = 0; row < R; ++row)
      for (std::int64_t k0 = 0; k0 < K; k0 += 64) {
        float v[64];
        for (int i = 0; i < 64; ++i) v[i] = x.get(row, k0 + i);
        transcribed_rotation(v, 64, r == Rotation::random_hadamard, 5);
        for (float e : v) want = std::max(want, std::fabs(e));
      }
    for (Backend b : {Backend::reference, Backend::cpu}) {
      QuantOptions o = rotated(QuantOptions::nvfp4(), r, 64, 5);
      o.backend = b;
      EXPECT_EQ(tensor_amax(x.view(), o), want) << to_string(r) << " " << to_string(b);
      QuantOptions q = o;
      q.tensor_scale.reset();
      th::Quantized qq(q, R, K);
      quantize(x.view(), qq.out(), q);
      EXPECT_EQ(qq.S, nvfp4_tensor_scale_from_amax(want)) << "quantize's computed S is that of the rotated amax";
    }
  }
  EXPECT_EQ(tensor_amax(x.view(), QuantOptions::nvfp4()), tensor_amax(x.view())) << "no rotation: the plain amax";
  th::HostTensor xn = x;  // a NaN anywhere: NaN; an infinity (no NaN): +Inf
  xn.set(3, 100, INFINITY);
  EXPECT_EQ(tensor_amax(xn.view(), rotated(QuantOptions::nvfp4(), Rotation::hadamard, 64)), INFINITY);
  xn.set(5, 7, std::nanf(""));
  EXPECT_TRUE(std::isnan(tensor_amax(xn.view(), rotated(QuantOptions::nvfp4(), Rotation::hadamard, 64))));
}

TEST(Rotation, FastCpuQuantizeAndDequantizeMatchTheReference) {
  for (int rs : {32, 128})
    for (Rotation r : {Rotation::hadamard, Rotation::random_hadamard})
      for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::quest), QuantOptions::nvfp4()}) {
        const std::int64_t R = 130, K = 256;
        const th::HostTensor x = th::llm_like(DType::bf16, R, K, 3);
        QuantOptions o = rotated(base, r, rs);
        o.backend = Backend::reference;
        th::Quantized qr(o, R, K), qc(o, R, K);
        quantize(x.view(), qr.out(), o);
        o.backend = Backend::cpu;
        quantize(x.view(), qc.out(), o);
        th::expect_same_bytes(qr.codes, qc.codes, "codes");
        th::expect_same_bytes(qr.scales, qc.scales, "scales");
        EXPECT_EQ(qr.S, qc.S);
        QuantOptions od = o;
        if (base.format == Format::nvfp4) od.tensor_scale = qr.S;
        th::HostTensor yr(DType::bf16, R, K), yc(DType::bf16, R, K);
        od.backend = Backend::reference;
        dequantize(qr.in(), yr.view(), od);
        od.backend = Backend::cpu;
        dequantize(qr.in(), yc.view(), od);
        th::expect_same_bytes(yr, yc, "dequantize + un-rotate");
      }
}

double sqnr_db(const th::HostTensor& x, const th::HostTensor& y) {
  double s = 0, n = 0;
  for (std::int64_t r = 0; r < x.rows; ++r)
    for (std::int64_t k = 0; k < x.cols; ++k) {
      const double a = x.get(r, k), d = a - y.get(r, k);
      s += a * a;
      n += d * d;
    }
  return 10 * std::log10(s / n);
}

double roundtrip_sqnr(const th::HostTensor& x, const QuantOptions& o) {
  th::Quantized q(o, x.rows, x.cols);
  th::HostTensor y(DType::f32, x.rows, x.cols);
  quantize(x.view(), q.out(), o);
  QuantOptions od = o;
  if (o.format == Format::nvfp4) od.tensor_scale = q.S;
  dequantize(q.in(), y.view(), od);
  return sqnr_db(x, y);
}

// quantize + dequantize with a rotation returns to the input's domain (a wrong inverse, or a rotation
// applied on one side only, gives about 0 dB), for every size and both modes. The SQNR each gives on
// this LLM-like data (a Gaussian bulk, heavy outlier channels) is printed: docs/numerics.md reports it
// (with 32- and 16-element blocks the block scale already confines an outlier to its block, and
// spreading it over the rotation's blocks does not raise this energy-weighted SQNR).
TEST(Rotation, QuantizeDequantizeRoundTripReturnsToTheInput) {
  const std::int64_t R = 64, K = 1024;
  const th::HostTensor x = th::llm_like(DType::f32, R, K, 5);
  for (const QuantOptions& o : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::nvfp4(),
                                QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor)})
    for (int rs : kSizes)
      for (Rotation r : {Rotation::hadamard, Rotation::random_hadamard}) {
        const double plain = roundtrip_sqnr(x, o), rot = roundtrip_sqnr(x, rotated(o, r, rs));
        std::printf("%s %s RS %d: %.2f dB (no rotation %.2f dB)\n", std::string(to_string(o.format)).c_str(),
                    std::string(to_string(r)).c_str(), rs, rot, plain);
        EXPECT_GT(rot, plain - 12.0) << to_string(o.format) << " " << to_string(r) << " RS " << rs;
        EXPECT_GT(rot, 15.0) << to_string(o.format) << " " << to_string(r) << " RS " << rs;
      }
}

TEST(Rotation, RefusalsNameTheOption) {
  const th::HostTensor x = th::llm_like(DType::bf16, 2, 96, 1);
  th::HostTensor y(DType::bf16, 2, 96);
  auto message = [&](const QuantOptions& o) {
    try {
      qdq(x.view(), y.view(), o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const QuantOptions mx = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  EXPECT_NE(message(rotated(mx, Rotation::hadamard, 64)).find("does not divide K = 96"), std::string::npos);
  EXPECT_NE(message(rotated(mx, Rotation::hadamard, 48)).find("expected 16, 32"), std::string::npos);
  QuantOptions o = mx;
  o.rotation_size = 32;
  EXPECT_NE(message(o).find("without a rotation"), std::string::npos);
  EXPECT_EQ(parse_rotation("had128"), std::make_pair(Rotation::hadamard, 128));
  EXPECT_EQ(parse_rotation("rhad16"), std::make_pair(Rotation::random_hadamard, 16));
  EXPECT_EQ(parse_rotation("none"), std::make_pair(Rotation::none, 0));
  for (const char* bad : {"had", "had100", "had512", "hadamard", "rhad8", "had0128"}) EXPECT_THROW(parse_rotation(bad), Error) << bad;
  // the fused producers do not rotate
  th::HostTensor w(DType::bf16, 1, 96);
  const QuantOptions rq = rotated(mx, Rotation::hadamard, 32);
  EXPECT_THROW(rms_norm(x.view(), w.view(), 1e-6f, y.view(), &rq), Error);
}

// ---- a runtime matrix (Rotation::matrix) -------------------------------------------------------------
// The documented arithmetic written out again: y_j = RN32(sum_i x_i * M_ij) with the sum in double,
// i ascending (each product exact in double).
void transcribed_matrix(float* v, int rs, const std::vector<float>& m) {
  std::vector<float> y(rs);
  for (int j = 0; j < rs; ++j) {
    double acc = 0;
    for (int i = 0; i < rs; ++i) acc += double(v[i]) * double(m[std::size_t(i) * rs + j]);
    y[std::size_t(j)] = float(acc);
  }
  std::copy(y.begin(), y.end(), v);
}

// out = in with every group of rs elements of each row replaced by transcribed_matrix (out's dtype:
// each result rounded to it).
void by_groups(const th::HostTensor& in, th::HostTensor& out, int rs, const std::vector<float>& m) {
  for (std::int64_t row = 0; row < in.rows; ++row)
    for (std::int64_t k0 = 0; k0 < in.cols; k0 += rs) {
      float v[256];
      for (int i = 0; i < rs; ++i) v[i] = in.get(row, k0 + i);
      transcribed_matrix(v, rs, m);
      for (int i = 0; i < rs; ++i) out.set(row, k0 + i, v[i]);
    }
}

// A random orthogonal matrix (Gram-Schmidt on Gaussian columns, in double, rounded to fp32) and its
// transpose; `bf16`: the entries rounded to bf16 (then its transpose is the inverse only approximately,
// which is the caller's business: the library applies what it is given).
std::pair<std::vector<float>, std::vector<float>> random_rotation(int rs, std::uint32_t seed, bool bf16) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  std::vector<double> q(std::size_t(rs) * rs);
  for (double& v : q) v = nd(rng);
  for (int c = 0; c < rs; ++c) {  // column c of q, orthogonalised against the previous ones
    for (int p = 0; p < c; ++p) {
      double d = 0;
      for (int i = 0; i < rs; ++i) d += q[std::size_t(i) * rs + c] * q[std::size_t(i) * rs + p];
      for (int i = 0; i < rs; ++i) q[std::size_t(i) * rs + c] -= d * q[std::size_t(i) * rs + p];
    }
    double n = 0;
    for (int i = 0; i < rs; ++i) n += q[std::size_t(i) * rs + c] * q[std::size_t(i) * rs + c];
    for (int i = 0; i < rs; ++i) q[std::size_t(i) * rs + c] /= std::sqrt(n);
  }
  std::vector<float> m(q.size()), t(q.size());
  for (int i = 0; i < rs; ++i)
    for (int j = 0; j < rs; ++j) {
      float v = float(q[std::size_t(i) * rs + j]);
      if (bf16) v = bf16_to_f32(f32_to_bf16(v));
      m[std::size_t(i) * rs + j] = v;
      t[std::size_t(j) * rs + i] = v;
    }
  return {m, t};
}

QuantOptions with_matrix(QuantOptions o, int rs, const th::HostTensor& m, const th::HostTensor* inv) {
  o.rotation = Rotation::matrix;
  o.rotation_size = rs;
  o.rotation_matrix = m.view();
  if (inv) o.rotation_inverse = inv->view();
  return o;
}

// The matrix as a host tensor of dtype dt (f32, or bf16: the values are bf16 already when asked).
th::HostTensor matrix_tensor(const std::vector<float>& m, int rs, DType dt) {
  th::HostTensor t(dt, rs, rs);
  for (int i = 0; i < rs; ++i)
    for (int j = 0; j < rs; ++j) t.set(i, j, m[std::size_t(i) * rs + j]);
  return t;
}

// quantize, qdq and dequantize with a runtime matrix: the bytes of the same operations without a
// rotation on the tensor rotated by the transcription (dequantize: decoded, then rotated back by the
// inverse in the same arithmetic, rounded once to the dtype), both CPU backends, f32 and bf16 matrices,
// every RS, MXFP4 / MXFP8 / NVFP4 (computed S: from the rotated amax), bf16 and f32 inputs.
TEST(RotationMatrix, BytesEqualTheTranscribedArithmetic) {
  for (int rs : kSizes)
    for (DType mdt : {DType::f32, DType::bf16}) {
      const auto [mv, iv] = random_rotation(rs, 40 + rs, mdt == DType::bf16);
      const th::HostTensor m = matrix_tensor(mv, rs, mdt), inv = matrix_tensor(iv, rs, mdt);
      for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even),
                                       QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor), QuantOptions::nvfp4()})
        for (DType dt : {DType::bf16, DType::f32}) {
          const std::string what = th::name_of(base) + " RS " + std::to_string(rs) + " matrix " +
                                   std::string(to_string(mdt)) + " x " + std::string(to_string(dt));
          const std::int64_t R = 6, K = 512;
          const th::HostTensor x = th::llm_like(dt, R, K, 17);
          th::HostTensor t(DType::f32, R, K);  // x rotated, by the transcription
          by_groups(x, t, rs, mv);
          for (Backend b : {Backend::reference, Backend::cpu}) {
            QuantOptions plain = base, o = with_matrix(base, rs, m, &inv);
            plain.backend = o.backend = b;
            // quantize
            th::Quantized qe(plain, R, K), qg(o, R, K);
            quantize(t.view(), qe.out(), plain);
            quantize(x.view(), qg.out(), o);
            th::expect_same_bytes(qe.codes, qg.codes, what + ": codes");
            th::expect_same_bytes(qe.scales, qg.scales, what + ": scales");
            EXPECT_EQ(qe.S, qg.S) << what;
            // qdq: the QDQ of the rotated tensor, in the rotated domain, rounded to the dtype
            th::HostTensor te = t, ye(dt, R, K), yg(dt, R, K);
            qdq(te.view(), te.view(), plain);
            for (std::int64_t row = 0; row < R; ++row)
              for (std::int64_t k = 0; k < K; ++k) ye.set(row, k, te.get(row, k));
            qdq(x.view(), yg.view(), o);
            th::expect_same_bytes(ye, yg, what + ": qdq");
            // dequantize: decoded, rotated back by the inverse, rounded once to the dtype
            QuantOptions pd = plain, od = o;
            if (base.format == Format::nvfp4) pd.tensor_scale = od.tensor_scale = qe.S;
            th::HostTensor d(DType::f32, R, K), de(dt, R, K), dg(dt, R, K);
            dequantize(qe.in(), d.view(), pd);
            by_groups(d, de, rs, iv);
            dequantize(qg.in(), dg.view(), od);
            th::expect_same_bytes(de, dg, what + ": dequantize");
          }
        }
    }
}

// The normalised Hadamard matrix given as a runtime matrix: the same rotation as the built-in mode up
// to its arithmetic (a float64 product rounded once against the fp32 butterfly): each element within
// a few fp32 ulps of the group's scale; the round trip returns to the input; tensor_amax is that of
// the rotated tensor.
TEST(RotationMatrix, HadamardAsAMatrixAgreesWithTheButterfly) {
  const int rs = 64;
  std::vector<float> h(std::size_t(rs) * rs);
  for (int i = 0; i < rs; ++i)
    for (int j = 0; j < rs; ++j) h[std::size_t(i) * rs + j] = ((__builtin_popcount(unsigned(i & j)) & 1) ? -1.0f : 1.0f) / 8.0f;
  const th::HostTensor m = matrix_tensor(h, rs, DType::f32);  // symmetric and orthogonal: its own inverse
  const std::int64_t R = 8, K = 256;
  const th::HostTensor x = th::llm_like(DType::f32, R, K, 23);
  QuantOptions om = with_matrix(QuantOptions::nvfp4(), rs, m, &m), oh = rotated(QuantOptions::nvfp4(), Rotation::hadamard, rs);
  om.backend = oh.backend = Backend::cpu;
  const float am = tensor_amax(x.view(), om), ah = tensor_amax(x.view(), oh);
  EXPECT_NEAR(am, ah, 4e-7 * ah);
  // round trip through NVFP4 with a computed S returns to the input's domain
  om.tensor_scale.reset();
  th::Quantized q(om, R, K);
  quantize(x.view(), q.out(), om);
  EXPECT_EQ(q.S, nvfp4_tensor_scale_from_amax(am));
  om.tensor_scale = q.S;
  th::HostTensor y(DType::f32, R, K);
  dequantize(q.in(), y.view(), om);
  EXPECT_GT(sqnr_db(x, y), 15.0);
}

TEST(RotationMatrix, RefusalsNameTheOption) {
  const th::HostTensor x = th::llm_like(DType::bf16, 2, 128, 1);
  th::HostTensor y(DType::bf16, 2, 128);
  const auto [mv, iv] = random_rotation(32, 3, false);
  const th::HostTensor m = matrix_tensor(mv, 32, DType::f32), inv = matrix_tensor(iv, 32, DType::f32);
  const th::HostTensor m16 = matrix_tensor(std::vector<float>(16 * 16, 0.0f), 16, DType::f32);
  const th::HostTensor mf16(DType::f16, 32, 32);
  const QuantOptions mx = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  auto error_of = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto qdq_error = [&](const QuantOptions& o) { return error_of([&] { qdq(x.view(), y.view(), o); }); };
  QuantOptions o = with_matrix(mx, 32, m, nullptr);
  o.rotation_matrix = Tensor{};
  EXPECT_NE(qdq_error(o).find("option 'rotation_matrix': missing"), std::string::npos) << qdq_error(o);
  EXPECT_NE(qdq_error(with_matrix(mx, 32, m16, nullptr)).find("shape [16, 16], expected [32, 32]"), std::string::npos);
  EXPECT_NE(qdq_error(with_matrix(mx, 32, mf16, nullptr)).find("dtype f16, expected f32 or bf16"), std::string::npos);
  QuantOptions strided = with_matrix(mx, 32, m, nullptr);
  strided.rotation_matrix.row_stride = 40;
  EXPECT_NE(qdq_error(strided).find("dense"), std::string::npos) << qdq_error(strided);
  QuantOptions had = rotated(mx, Rotation::hadamard, 32);
  had.rotation_matrix = m.view();
  EXPECT_NE(qdq_error(had).find("option 'rotation_matrix' given with rotation 'hadamard'"), std::string::npos) << qdq_error(had);
  // qdq and quantize need only R; dequantize needs R^-1
  EXPECT_EQ(qdq_error(with_matrix(mx, 32, m, nullptr)), "no error");
  const QuantOptions no_inv = with_matrix(mx, 32, m, nullptr);
  th::Quantized q(no_inv, 2, 128);
  quantize(x.view(), q.out(), no_inv);
  const std::string deq = error_of([&] { dequantize(q.in(), y.view(), no_inv); });
  EXPECT_NE(deq.find("option 'rotation_inverse': missing"), std::string::npos) << deq;
  EXPECT_EQ(error_of([&] { dequantize(q.in(), y.view(), with_matrix(mx, 32, m, &inv)); }), "no error");
  // dequantize with the inverse alone: the same bytes; quantize, qdq and tensor_amax without R refused
  QuantOptions inv_only = with_matrix(mx, 32, m, &inv);
  inv_only.rotation_matrix = Tensor{};
  th::HostTensor y2(DType::bf16, 2, 128);
  dequantize(q.in(), y.view(), with_matrix(mx, 32, m, &inv));
  EXPECT_EQ(error_of([&] { dequantize(q.in(), y2.view(), inv_only); }), "no error");
  th::expect_same_bytes(y, y2, "dequantize with R^-1 alone");
  EXPECT_NE(qdq_error(inv_only).find("option 'rotation_matrix': missing"), std::string::npos) << qdq_error(inv_only);
  EXPECT_NE(error_of([&] { quantize(x.view(), q.out(), inv_only); }).find("option 'rotation_matrix': missing"), std::string::npos);
  EXPECT_NE(error_of([&] { tensor_amax(x.view(), inv_only); }).find("option 'rotation_matrix': missing"), std::string::npos);
  EXPECT_EQ(to_string(Rotation::matrix), "matrix");
  // the matrix is an input: sharing memory with the output is refused, in place too
  th::HostTensor yf(DType::f32, 64, 128);
  QuantOptions alias = with_matrix(mx, 32, m, nullptr);
  alias.rotation_matrix = Tensor::of(yf.view().data, DType::f32, 32, 32);
  const th::HostTensor xf = th::llm_like(DType::f32, 64, 128, 2);
  EXPECT_NE(error_of([&] { qdq(xf.view(), yf.view(), alias); }).find("rotation_matrix"), std::string::npos);
  EXPECT_NE(error_of([&] { qdq(yf.view(), yf.view(), alias); }).find("rotation_matrix"), std::string::npos);
  // a device matrix on a CPU backend: refused naming it (CudaRotationMatrixOptions: with a GPU)
  QuantOptions dev = with_matrix(mx, 32, m, nullptr);
  dev.rotation_matrix.device = Device::cuda;
  const std::string on_dev = qdq_error(dev);
  EXPECT_NE(on_dev.find("option 'rotation_matrix': in GPU memory"), std::string::npos) << on_dev;
}

// The CUDA backend against the reference, bytes: quantize (codes, scales, clip mask, S), qdq and
// dequantize + un-rotate, for every format, the scale rules and roundings, the three dtypes, every
// rotation size and both modes; dense tensors (the flat launches: 16-element chunks for 2-byte dtypes)
// and strided rows with groups of 8 (8-element chunks, the row-by-row launches).
struct RotCase {
  QuantOptions o;
  const char* name;
};
std::vector<RotCase> cuda_rotation_cases() {
  auto mx = [](Format f, ScaleRule r) { return QuantOptions::mx(f, r); };
  auto sr = [](QuantOptions o, int bits) {
    o.rounding = Rounding::stochastic;
    o.seed = 1234;
    o.offset = 77;
    o.random_bits = bits;
    return o;
  };
  return {{mx(Format::mxfp4, ScaleRule::even), "mxfp4 even"},
          {mx(Format::mxfp4, ScaleRule::floor), "mxfp4 floor"},
          {mx(Format::mxfp4, ScaleRule::quest), "mxfp4 quest"},
          {mx(Format::mxfp4, ScaleRule::qutlass_absmax), "mxfp4 qutlass_absmax"},
          {sr(mx(Format::mxfp4, ScaleRule::rceil), 16), "mxfp4 rceil sr16"},
          {mx(Format::mxfp6_e2m3, ScaleRule::even), "mxfp6_e2m3 even"},
          {sr(mx(Format::mxfp6_e3m2, ScaleRule::rceil), 32), "mxfp6_e3m2 rceil sr32"},
          {mx(Format::mxfp8_e4m3, ScaleRule::floor), "mxfp8_e4m3 floor"},
          {mx(Format::mxfp8_e5m2, ScaleRule::even), "mxfp8_e5m2 even"},
          {mx(Format::mxint8, ScaleRule::floor), "mxint8 floor"},
          {QuantOptions::nvfp4(), "nvfp4 computed S"},
          {QuantOptions::nvfp4(2.5f), "nvfp4 S = 2.5"},
          {sr(QuantOptions::nvfp4(), 8), "nvfp4 sr8"}};
}

TEST(CudaRotation, BytesEqualTheReference) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  int n = 0;
  for (const RotCase& rc : cuda_rotation_cases())
    for (DType dt : {DType::bf16, DType::f16, DType::f32})
      for (int rs : kSizes)
        for (Rotation r : {Rotation::hadamard, Rotation::random_hadamard})
          for (bool strided : {false, true}) {
            QuantOptions o = rotated(rc.o, r, rs, 7 + std::uint64_t(rs));
            const std::int64_t R = strided ? 5 : 9, K = 512;
            if (strided && o.format != Format::nvfp4) o.group_size = 8;
            const std::string what = std::string(rc.name) + " " + std::string(to_string(dt)) + " " +
                                     std::string(to_string(r)) + " RS " + std::to_string(rs) + (strided ? " strided g8" : " dense");
            SCOPED_TRACE(what);
            const th::HostTensor dense = th::llm_like(dt, R, K, 100 + n++);
            th::HostTensor x(dt, R, K, strided ? K + 40 : 0);
            for (std::int64_t row = 0; row < R; ++row)
              for (std::int64_t k = 0; k < K; ++k) x.set(row, k, dense.get(row, k));
            // quantize
            QuantOptions ro = o;
            ro.backend = Backend::reference;
            th::Quantized qr(ro, R, K, true);
            quantize(x.view(), qr.out(), ro);
            th::Scalar ws(Backend::cuda);
            const QuantOptions co = th::on(Backend::cuda, o, ws);
            th::Placed xd(Backend::cuda, x);
            th::PlacedQuantized qd(Backend::cuda, co, R, K);
            quantize(xd.view(), qd.out(), co);
            th::expect_same_bytes(qr.codes, qd.codes.get(), "codes");
            th::expect_same_bytes(qr.scales, qd.scales.get(), "scales");
            th::expect_same_bytes(qr.mask, qd.mask.get(), "clip mask");
            if (o.format == Format::nvfp4) EXPECT_EQ(qr.S, qd.S.value());
            // qdq (out of place)
            th::HostTensor yr(dt, R, K, strided ? K + 8 : 0);
            qdq(x.view(), yr.view(), ro);
            th::Placed yd(Backend::cuda, yr);
            qdq(xd.view(), yd.view(), co);
            th::expect_same_bytes(yr, yd.get(), "qdq");
            // dequantize + un-rotate of the reference's codes
            QuantOptions dro = ro;
            if (o.format == Format::nvfp4) dro.tensor_scale = qr.S;
            QuantOptions dco = co;
            dco.tensor_scale = dro.tensor_scale;
            th::HostTensor zr(dt, R, K, strided ? K + 8 : 0);
            dequantize(qr.in(), zr.view(), dro);
            th::Placed cd(Backend::cuda, qr.codes), sd(Backend::cuda, qr.scales), zd(Backend::cuda, zr);
            dequantize(QuantizedIn{cd.view(), sd.view()}, zd.view(), dco);
            th::expect_same_bytes(zr, zd.get(), "dequantize");
            if (testing::Test::HasFailure()) return;  // the first failing case is enough to read
          }
}

// In place, a NaN and an infinity in the input, a NaN scale byte on dequantize: the same bytes.
TEST(CudaRotation, SpecialValuesAndInPlace) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  const std::int64_t R = 4, K = 256;
  for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::nvfp4()})
    for (DType dt : {DType::bf16, DType::f32}) {
      th::HostTensor x = th::llm_like(dt, R, K, 9);
      x.set(1, 3, std::nanf(""));
      x.set(2, 200, INFINITY);
      const QuantOptions o = rotated(base, Rotation::random_hadamard, 64, 3);
      QuantOptions ro = o;
      ro.backend = Backend::reference;
      th::HostTensor yr = x;
      qdq(yr.view(), yr.view(), ro);
      th::Scalar ws(Backend::cuda);
      const QuantOptions co = th::on(Backend::cuda, o, ws);
      th::Placed yd(Backend::cuda, x);
      qdq(yd.view(), yd.view(), co);
      th::expect_same_bytes(yr, yd.get(), std::string("qdq in place ") + th::name_of(base) + " " + std::string(to_string(dt)));
      th::Quantized q(ro, R, K);
      quantize(x.view(), q.out(), ro);
      q.scales.bytes[0] = o.format == Format::nvfp4 ? 0x7F : 0xFF;  // a NaN scale
      QuantOptions dro = ro;
      if (o.format == Format::nvfp4) dro.tensor_scale = q.S;
      QuantOptions dco = co;
      dco.tensor_scale = dro.tensor_scale;
      th::HostTensor zr(dt, R, K);
      dequantize(q.in(), zr.view(), dro);
      th::Placed cd(Backend::cuda, q.codes), sd(Backend::cuda, q.scales), zd(Backend::cuda, zr);
      dequantize(QuantizedIn{cd.view(), sd.view()}, zd.view(), dco);
      th::expect_same_bytes(zr, zd.get(), "dequantize with a NaN scale");
    }
}

// Dequantize + un-rotate into bf16 and f16 at the edges of the output dtype (the CUDA kernel rounds a
// chunk of 2-byte outputs by the hardware conversion only where no value in it can round past the
// largest finite one), on backend be against the reference, byte for byte. Random codes (NaN codes
// included) under one scale exponent per rotation group, chosen so that the group's outputs reach the
// largest finite output and beyond, f16's and bf16's subnormals and underflow, or the ordinary range;
// then a diagonal inverse matrix placing outputs exactly at, just below and past the midpoint between
// the largest finite value and the next power of two (where the reference saturates and a plain
// round-to-nearest-even would give the infinity).
void dequantize_at_dtype_edges(Backend be) {
  const std::int64_t R = 6, K = 1024;
  std::mt19937 rng(2026);
  th::Scalar ws(be);
  auto run = [&](const QuantOptions& o, DType dt, const th::Quantized& q, const th::HostTensor* inv, const std::string& what) {
    QuantOptions ro = o;
    ro.backend = Backend::reference;
    th::HostTensor zr(dt, q.rows, q.K);
    dequantize(q.in(), zr.view(), ro);
    QuantOptions bo = th::on(be, o, ws);
    std::optional<th::Placed> invd;
    if (inv) bo.rotation_inverse = invd.emplace(be, *inv).view();
    th::Placed cd(be, q.codes), sd(be, q.scales), zd(be, zr);
    dequantize(QuantizedIn{cd.view(), sd.view()}, zd.view(), bo);
    th::expect_same_bytes(zr, zd.get(), "dequantize " + what);
    return zr;
  };
  for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::even), QuantOptions::mx(Format::mxfp4, ScaleRule::even)})
    for (DType dt : {DType::bf16, DType::f16})
      for (int rs : {16, 128, 256}) {
        const QuantOptions o = rotated(base, Rotation::hadamard, rs, 1);
        const int top = base.format == Format::mxfp8_e4m3 ? 8 : 2;  // the largest binade: 448 = 1.75 * 2^8, 6 = 1.5 * 2^2
        const int emax = (dt == DType::f16 ? 16 : 128) - top;        // outputs up to about the dtype's largest
        const int esub = (dt == DType::f16 ? -14 : -126) - top;      // outputs at the dtype's subnormals
        const std::vector<int> exps = {emax - 2, emax - 1, emax, esub, esub - 5, esub - 11, 0, -3};
        th::Quantized q(o, R, K);
        for (std::size_t i = 0; i < q.codes.bytes.size(); ++i) {
          std::uint8_t b = std::uint8_t(rng());
          // E4M3's NaN codes (0x7F, 0xFF) in the first row only: elsewhere a NaN would fill its group
          if (top == 8 && i >= std::size_t(q.codes.cols) && (b & 0x7F) == 0x7F) b ^= 1;
          q.codes.bytes[i] = b;
        }
        const std::int64_t per_row = q.scales.cols, blocks = std::max<std::int64_t>(1, rs / 32);
        for (std::int64_t r = 0; r < R; ++r)
          for (std::int64_t b = 0; b < per_row; b += blocks) {
            const int e = std::clamp(exps[rng() % exps.size()], -127, 127);
            for (std::int64_t j = b; j < b + blocks; ++j) q.scales.bytes[std::size_t(r * per_row + j)] = std::uint8_t(127 + e);
          }
        run(o, dt, q, nullptr, std::string(th::name_of(base)) + " " + std::string(to_string(dt)) + " RS " + std::to_string(rs));
        if (testing::Test::HasFailure()) return;
      }
  // The Hadamard butterfly cannot reach the top of bf16 (its unnormalised sums overflow first), so the
  // last cases take a runtime matrix: the inverse diag(d), under E4M3 codes and the scale 2^7 (f16) or
  // 2^119 (bf16), so that code 448 (0x7E) gives y = 57344 or 1.75 * 2^127 times d. One row, two groups
  // of 16, four chunks of 8 outputs (the matrix kernels' rounding chunk):
  //   chunk 0 (outputs 0-7, codes 448): exactly the midpoint as its largest value, halfway between the
  //     largest finite value and the midpoint, and six ordinary, distinct values (a fast path taken at
  //     the midpoint would round it to the infinity; both must saturate to the largest finite value);
  //   chunk 1 (8-15, codes 448): every value below the midpoint (the fast path): one rounding down
  //     onto the largest finite value, the largest itself, six ordinary, distinct values (swapped halves
  //     show);
  //   chunk 2 (16-23, codes 448): as chunk 0 and, at output 19, a value past the midpoint (saturates);
  //   chunk 3 (24-31): as chunk 1 under smaller codes (0x76 = 224, 0x6E = 112, alternating).
  // Output 3 of chunk 0 takes code 0x6E (112): d[3] is the past-midpoint factor, an ordinary value there.
  for (DType dt : {DType::f16, DType::bf16}) {
    const bool f16 = dt == DType::f16;
    const double y = f16 ? 57344.0 : std::ldexp(1.75, 127), top = f16 ? 65504.0 : std::ldexp(255.0 / 128.0, 127);
    const double mid = f16 ? 65520.0 : std::ldexp(511.0 / 256.0, 127), past = f16 ? 65534.0 : std::ldexp(1.9990234375, 127);
    const std::vector<float> d = {float(mid / y), float((top + mid) / 2 / y), 0.5f, float(past / y), 0.25f, 0.75f, 0.625f, 0.875f,
                                  float((2 * top + mid) / 3 / y), float(top / y), 0.375f, 0.8125f, 0.5625f, 0.6875f, 0.9375f, 0.3125f};
    std::vector<float> inv(256, 0.0f);
    for (int i = 0; i < 16; ++i) inv[std::size_t(i) * 17] = d[std::size_t(i)];
    const th::HostTensor invt = matrix_tensor(inv, 16, DType::f32);
    QuantOptions o = QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::even);
    o.rotation = Rotation::matrix;
    o.rotation_size = 16;
    o.rotation_inverse = invt.view();
    th::Quantized q(o, 1, 32);
    for (int j = 0; j < 32; ++j) q.codes.bytes[std::size_t(j)] = j >= 24 ? (j % 2 ? 0x6E : 0x76) : j == 3 ? 0x6E : 0x7E;
    std::fill(q.scales.bytes.begin(), q.scales.bytes.end(), std::uint8_t(127 + (f16 ? 7 : 119)));
    const th::HostTensor zr = run(o, dt, q, &invt, std::string("with a diagonal inverse to ") + std::string(to_string(dt)));
    const std::uint16_t want_top = f16 ? 0x7BFF : 0x7F7F;
    for (int j : {0, 1, 8, 9, 16, 17, 19}) EXPECT_EQ(zr.bits(0, j), want_top) << "output " << j << " of the reference (" << to_string(dt) << ")";
    for (int j : {2, 3, 4, 10, 11, 24, 25})
      EXPECT_LT(zr.bits(0, j) & 0x7FFF, want_top) << "output " << j << " of the reference (" << to_string(dt) << ")";
  }
}

TEST(Rotation, DequantizeRoundsAtTheEdgesOfTheOutputDtype) { dequantize_at_dtype_edges(Backend::cpu); }

TEST(CudaRotation, DequantizeRoundsAtTheEdgesOfTheOutputDtype) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  dequantize_at_dtype_edges(Backend::cuda);
}

// Signed zeros through the butterfly's shuffle stages (on the GPU each one fma(+-1, v, w): RN(w - v)
// or RN(v + w), whose zero results must carry the subtraction's and the addition's signs): rows of +0,
// of -0, of mixed zeros, of one repeated value (every difference an exact zero), of +-c, and of values
// repeated at a distance of 64; QDQ's output bytes and quantize's codes and scales equal to the
// reference's for every rotation size and both sign modes, on the CPU backend and, where usable, CUDA.
TEST(Rotation, SignedZerosMatchTheReference) {
  const std::int64_t R = 6, K = 512;
  for (Backend be : {Backend::cpu, Backend::cuda}) {
    if (!th::unusable(be).empty()) continue;
    for (DType dt : {DType::bf16, DType::f32}) {
      th::HostTensor x(dt, R, K);
      for (std::int64_t k = 0; k < K; ++k) {
        x.set(0, k, 0.0f);
        x.set(1, k, -0.0f);
        x.set(2, k, (k * 7) % 3 == 0 ? -0.0f : 0.0f);
        x.set(3, k, 1.5f);
        x.set(4, k, k % 2 ? -0.75f : 0.75f);
        x.set(5, k, float((k % 64) / 8) * (k % 3 == 1 ? -0.5f : 0.5f));
      }
      for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::nvfp4()})
        for (Rotation rot : {Rotation::hadamard, Rotation::random_hadamard})
          for (int rs : {16, 32, 64, 128, 256}) {
            const QuantOptions o = rotated(base, rot, rs, 5);
            QuantOptions ro = o;
            ro.backend = Backend::reference;
            const std::string what = std::string(to_string(be)) + " " + th::name_of(base) + " " + std::string(to_string(dt)) +
                                     " rs " + std::to_string(rs) + (rot == Rotation::random_hadamard ? " random" : "");
            th::HostTensor yr(dt, R, K), unwritten(dt, R, K);
            qdq(x.view(), yr.view(), ro);
            for (std::int64_t r = 0; r < R; ++r)
              for (std::int64_t k = 0; k < K; ++k) unwritten.set(r, k, NAN);  // no output here is NaN
            th::Scalar ws(be);
            const QuantOptions co = th::on(be, o, ws);
            th::Placed xd(be, x), yd(be, unwritten);
            qdq(xd.view(), yd.view(), co);
            th::expect_same_bytes(yr, yd.get(), "qdq " + what);
            th::Quantized q(ro, R, K);
            quantize(x.view(), q.out(), ro);
            th::PlacedQuantized qd(be, co, R, K, false);
            quantize(xd.view(), qd.out(), co);
            th::expect_same_bytes(q.codes, qd.codes.get(), "codes " + what);
            th::expect_same_bytes(q.scales, qd.scales.get(), "scales " + what);
          }
    }
  }
}

// The production path: tensors large enough that each thread runs many
// iterations (the cp.async ring, its prefetch and stale slots, in place across iterations; the rotated
// amax kernel's loop), and rows whose K is not a multiple of the group size (padding chunks under a
// rotation).
TEST(CudaRotation, LargeTensorsAndPartialGroups) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  struct Case {
    QuantOptions o;
    std::int64_t R, K;
    int rs;
  };
  const Case cases[] = {{QuantOptions::nvfp4(), 2048, 4096, 128},
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::even), 2048, 4096, 256},
                        {QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor), 1024, 2048, 64},
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::even), 33, 48, 16},   // K = 48: a partial group of 32
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::quest), 17, 96, 32}};  // K = 96: 3 groups, 3 rotation groups
  for (const Case& cs : cases)
    for (DType dt : {DType::bf16, DType::f32}) {
      const std::string what = th::name_of(cs.o) + " " + std::to_string(cs.R) + "x" + std::to_string(cs.K) + " RS " +
                               std::to_string(cs.rs) + " " + std::string(to_string(dt));
      SCOPED_TRACE(what);
      const th::HostTensor x = th::llm_like(dt, cs.R, cs.K, 77);
      const QuantOptions o = rotated(cs.o, Rotation::random_hadamard, cs.rs, 13);
      QuantOptions ro = o;
      ro.backend = Backend::reference;
      th::HostTensor yr = x;
      qdq(yr.view(), yr.view(), ro);
      th::Scalar ws(Backend::cuda);
      const QuantOptions co = th::on(Backend::cuda, o, ws);
      th::Placed yd(Backend::cuda, x);
      qdq(yd.view(), yd.view(), co);  // in place
      th::expect_same_bytes(yr, yd.get(), "qdq in place");
      th::Quantized qr(ro, cs.R, cs.K, true);
      quantize(x.view(), qr.out(), ro);
      th::Placed xd(Backend::cuda, x);
      th::PlacedQuantized qd(Backend::cuda, co, cs.R, cs.K);
      quantize(xd.view(), qd.out(), co);
      th::expect_same_bytes(qr.codes, qd.codes.get(), "codes");
      th::expect_same_bytes(qr.scales, qd.scales.get(), "scales");
      th::expect_same_bytes(qr.mask, qd.mask.get(), "clip mask");
      if (o.format == Format::nvfp4) EXPECT_EQ(qr.S, qd.S.value());
      if (testing::Test::HasFailure()) return;
    }
}

TEST(CudaRotation, RefusesGroupsBelowEight) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  const th::HostTensor x = th::llm_like(DType::bf16, 2, 128, 1);
  th::Placed xb(Backend::cuda, x), yb(Backend::cuda, x);
  QuantOptions o = rotated(QuantOptions::mx(Format::mxfp4, ScaleRule::even), Rotation::hadamard, 32);
  o.backend = Backend::cuda;
  o.group_size = 4;
  try {
    qdq(xb.view(), yb.view(), o);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Error::Code::unsupported);
    EXPECT_NE(std::string(e.what()).find("group_size = 4"), std::string::npos) << e.what();
  }
}

// A matrix whose double sums depend on their order on rows of one repeated value (constant_rows):
// column j holds +2^30 in row j and -2^30 in row (j + RS/2) mod RS, which cancel exactly there, and
// small entries +-m 2^e elsewhere (m of 8 bits, e in [-30, -20]): in increasing i the small products
// added between the two large ones fall below the last bit of the running sum, in another order
// others do, so the fp32 result depends on the order. Not a rotation; the library applies what it is
// given.
std::vector<float> wide_matrix(int rs, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> e(-30, -20), m(128, 255), s(0, 1);
  std::vector<float> w(std::size_t(rs) * rs);
  for (float& v : w) v = std::ldexp(float(m(rng)) / 128.0f, e(rng)) * (s(rng) ? -1.0f : 1.0f);
  for (int j = 0; j < rs; ++j) {
    w[std::size_t(j) * rs + j] = 0x1p30f;
    w[std::size_t((j + rs / 2) % rs) * rs + j] = -0x1p30f;
  }
  return w;
}
// Rows 0 and 1 of x set to one repeated value each (1 and -2.5), where wide_matrix's sums cancel, and
// (with more than 3 rows) rows 2 and 3 to +0 and -0: every sum of signed zero products, which starts
// from +0 on the CPU (+0 + -0 = +0), must give +0 on the GPU too.
void constant_rows(th::HostTensor& x) {
  for (std::int64_t k = 0; k < x.cols; ++k) {
    x.set(0, k, 1.0f), x.set(1, k, -2.5f);
    if (x.rows > 3) x.set(2, k, 0.0f), x.set(3, k, -0.0f);
  }
}

// The matrices of the CUDA cases: random orthogonal in f32 and in bf16, and the wide matrix (f32).
struct MatrixCase {
  std::vector<float> m, inv;
  DType dt;
  const char* name;
};
std::vector<MatrixCase> matrix_cases(int rs) {
  std::vector<MatrixCase> v;
  for (bool bf16 : {false, true}) {
    auto [m, inv] = random_rotation(rs, 60 + rs, bf16);
    v.push_back({m, inv, bf16 ? DType::bf16 : DType::f32, bf16 ? "orthogonal bf16" : "orthogonal f32"});
  }
  v.push_back({wide_matrix(rs, 90 + rs), wide_matrix(rs, 190 + rs), DType::f32, "wide f32"});
  return v;
}

// The wide matrix makes the CUDA cases below sensitive to the order of the double sums: on their
// constant rows, summing in decreasing i instead of increasing i, or in a wider accumulator (long
// double: within about 2^-33 of the exact sum here, far below double's errors of 2^-22), changes the
// fp32 result of most elements (so a kernel that summed in another order, or wider, could not pass
// them).
TEST(RotationMatrix, WideMatrixSumsDependOnTheirOrder) {
  for (int rs : kSizes) {
    const std::vector<float> w = wide_matrix(rs, 90 + rs);
    th::HostTensor x = th::llm_like(DType::f32, 2, 512, 5);
    constant_rows(x);
    std::int64_t differ = 0, inexact = 0, n = 0;
    for (std::int64_t row = 0; row < x.rows; ++row)
      for (std::int64_t k0 = 0; k0 < x.cols; k0 += rs)
        for (int j = 0; j < rs; ++j) {
          double up = 0, down = 0;
          long double exact = 0;
          for (int i = 0; i < rs; ++i) up += double(x.get(row, k0 + i)) * double(w[std::size_t(i) * rs + j]);
          for (int i = rs - 1; i >= 0; --i) down += double(x.get(row, k0 + i)) * double(w[std::size_t(i) * rs + j]);
          for (int i = 0; i < rs; ++i) exact += (long double)x.get(row, k0 + i) * (long double)w[std::size_t(i) * rs + j];
          differ += float(up) != float(down);
          inexact += float(up) != float(exact);
          ++n;
        }
    EXPECT_GT(double(differ) / double(n), 0.5) << "RS " << rs << ": " << differ << " of " << n;
    EXPECT_GT(double(inexact) / double(n), 0.5) << "RS " << rs << ": " << inexact << " of " << n;
  }
}

// The CUDA backend's matrix rotation against the reference, bytes (quantize: codes, scales, clip mask,
// S; qdq; dequantize with the inverse): every case of cuda_rotation_cases (formats, rules, roundings,
// NVFP4 given and computed S) x bf16/fp16/fp32 x every RS x the three matrices x dense rows and strided
// rows with groups of 8.
// Both forms of the sums: the f64 mma, and (MXQ_CUDA_MATRIX_CUDA_CORES=1) fused multiply-adds on the
// CUDA cores.
class CudaRotationMatrix : public testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) setenv("MXQ_CUDA_MATRIX_CUDA_CORES", "1", 1);
    else unsetenv("MXQ_CUDA_MATRIX_CUDA_CORES");
  }
  void TearDown() override { unsetenv("MXQ_CUDA_MATRIX_CUDA_CORES"); }
};
INSTANTIATE_TEST_SUITE_P(Cuda, CudaRotationMatrix, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? std::string("CudaCores") : std::string("TensorCores"); });

TEST_P(CudaRotationMatrix, BytesEqualTheReference) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  int n = 0;
  for (int rs : kSizes)
    for (const MatrixCase& mc : matrix_cases(rs)) {
      const th::HostTensor m = matrix_tensor(mc.m, rs, mc.dt), inv = matrix_tensor(mc.inv, rs, mc.dt);
      th::Placed md(Backend::cuda, m), invd(Backend::cuda, inv);
      for (const RotCase& rc : cuda_rotation_cases())
        for (DType dt : {DType::bf16, DType::f16, DType::f32})
          for (bool strided : {false, true}) {
            const std::int64_t R = strided ? 5 : 9, K = 512;
            QuantOptions o = rc.o;
            if (strided && o.format != Format::nvfp4) o.group_size = 8;
            const std::string what = std::string(rc.name) + " " + std::string(to_string(dt)) + " RS " + std::to_string(rs) +
                                     " " + mc.name + (strided ? " strided g8" : " dense");
            SCOPED_TRACE(what);
            th::HostTensor dense = th::llm_like(dt, R, K, 300 + n++);
            constant_rows(dense);
            th::HostTensor x(dt, R, K, strided ? K + 40 : 0);
            for (std::int64_t row = 0; row < R; ++row)
              for (std::int64_t k = 0; k < K; ++k) x.set(row, k, dense.get(row, k));
            QuantOptions ro = with_matrix(o, rs, m, &inv);
            ro.backend = Backend::reference;
            th::Scalar ws(Backend::cuda);
            QuantOptions co = th::on(Backend::cuda, with_matrix(o, rs, m, &inv), ws);
            co.rotation_matrix = md.view();
            co.rotation_inverse = invd.view();
            // quantize
            th::Quantized qr(ro, R, K, true);
            quantize(x.view(), qr.out(), ro);
            th::Placed xd(Backend::cuda, x);
            th::PlacedQuantized qd(Backend::cuda, co, R, K);
            quantize(xd.view(), qd.out(), co);
            th::expect_same_bytes(qr.codes, qd.codes.get(), "codes");
            th::expect_same_bytes(qr.scales, qd.scales.get(), "scales");
            th::expect_same_bytes(qr.mask, qd.mask.get(), "clip mask");
            if (o.format == Format::nvfp4) EXPECT_EQ(qr.S, qd.S.value());
            // qdq (out of place)
            th::HostTensor yr(dt, R, K, strided ? K + 8 : 0);
            qdq(x.view(), yr.view(), ro);
            th::Placed yd(Backend::cuda, yr);
            qdq(xd.view(), yd.view(), co);
            th::expect_same_bytes(yr, yd.get(), "qdq");
            // dequantize + un-rotate of the reference's codes
            QuantOptions dro = ro, dco = co;
            if (o.format == Format::nvfp4) dro.tensor_scale = dco.tensor_scale = qr.S;
            th::HostTensor zr(dt, R, K, strided ? K + 8 : 0);
            dequantize(qr.in(), zr.view(), dro);
            th::Placed cd(Backend::cuda, qr.codes), sd(Backend::cuda, qr.scales), zd(Backend::cuda, zr);
            dequantize(QuantizedIn{cd.view(), sd.view()}, zd.view(), dco);
            th::expect_same_bytes(zr, zd.get(), "dequantize");
            if (testing::Test::HasFailure()) return;  // the first failing case is enough to read
          }
    }
}

// Many tiles per warp (the grid strides), in place, partial quantization blocks (K = 48 with blocks of
// 32, K = 96 with blocks of 64, K = 48 with one block of 256 over a whole warp: a row's padding forms
// whole rotation groups), a NaN and an infinity in the input and
// a NaN scale byte on dequantize: the CUDA bytes equal the CPU backend's (itself equal to the
// reference's: BytesEqualTheTranscribedArithmetic).
TEST_P(CudaRotationMatrix, LargeTensorsSpecialValuesAndInPlace) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  struct Case {
    QuantOptions o;
    std::int64_t R, K;
    int rs;
  };
  auto grouped = [](QuantOptions o, int g) {
    o.group_size = g;
    return o;
  };
  const Case cases[] = {{QuantOptions::nvfp4(), 2048, 4096, 128},
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::even), 4096, 2048, 16},
                        {QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor), 512, 2048, 256},
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::even), 33, 48, 16},       // a padding group per row
                        {QuantOptions::mx(Format::mxfp4, ScaleRule::quest), 17, 96, 32},      // no padding
                        {grouped(QuantOptions::mx(Format::mxfp4, ScaleRule::even), 64), 19, 96, 32},   // g > RS: a padding group
                        {grouped(QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::rceil), 256), 9, 48, 16}};  // a block over a warp
  for (const Case& cs : cases)
    for (DType dt : {DType::bf16, DType::f32}) {
      const std::string what = th::name_of(cs.o) + " " + std::to_string(cs.R) + "x" + std::to_string(cs.K) + " RS " +
                               std::to_string(cs.rs) + " " + std::string(to_string(dt));
      SCOPED_TRACE(what);
      th::HostTensor x = th::llm_like(dt, cs.R, cs.K, 78);
      x.set(1, 3, std::nanf(""));
      x.set(cs.R - 1, cs.K - 1, INFINITY);
      const auto [mv, iv] = random_rotation(cs.rs, 7, false);
      const th::HostTensor m = matrix_tensor(mv, cs.rs, DType::f32), inv = matrix_tensor(iv, cs.rs, DType::f32);
      th::Placed md(Backend::cuda, m), invd(Backend::cuda, inv);
      QuantOptions ro = with_matrix(cs.o, cs.rs, m, &inv);
      ro.backend = Backend::cpu;
      th::Scalar ws(Backend::cuda);
      QuantOptions co = th::on(Backend::cuda, ro, ws);
      co.rotation_matrix = md.view();
      co.rotation_inverse = invd.view();
      th::HostTensor yr = x;
      qdq(yr.view(), yr.view(), ro);
      th::Placed yd(Backend::cuda, x);
      qdq(yd.view(), yd.view(), co);  // in place
      th::expect_same_bytes(yr, yd.get(), "qdq in place");
      th::Quantized qr(ro, cs.R, cs.K, true);
      quantize(x.view(), qr.out(), ro);
      th::Placed xd(Backend::cuda, x);
      th::PlacedQuantized qd(Backend::cuda, co, cs.R, cs.K);
      quantize(xd.view(), qd.out(), co);
      th::expect_same_bytes(qr.codes, qd.codes.get(), "codes");
      th::expect_same_bytes(qr.scales, qd.scales.get(), "scales");
      th::expect_same_bytes(qr.mask, qd.mask.get(), "clip mask");
      if (cs.o.format == Format::nvfp4) EXPECT_EQ(qr.S, qd.S.value());
      qr.scales.bytes[5] = cs.o.format == Format::nvfp4 ? 0x7F : 0xFF;  // a NaN scale
      QuantOptions dro = ro, dco = co;
      if (cs.o.format == Format::nvfp4) dro.tensor_scale = dco.tensor_scale = qr.S;
      th::HostTensor zr(dt, cs.R, cs.K);
      dequantize(qr.in(), zr.view(), dro);
      th::Placed cd(Backend::cuda, qr.codes), sd(Backend::cuda, qr.scales), zd(Backend::cuda, zr);
      dequantize(QuantizedIn{cd.view(), sd.view()}, zd.view(), dco);
      th::expect_same_bytes(zr, zd.get(), "dequantize with a NaN scale");
      if (testing::Test::HasFailure()) return;
    }
}

// The matrix is read where the backend runs: a host matrix on the CUDA backend, a device matrix on
// the CPU backend, each refused naming the option.
TEST(CudaRotationMatrixOptions, RefusesAMatrixInTheOtherMemory) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  const th::HostTensor x = th::llm_like(DType::bf16, 2, 128, 1);
  const auto [mv, iv] = random_rotation(32, 3, false);
  const th::HostTensor m = matrix_tensor(mv, 32, DType::f32);
  th::Placed md(Backend::cuda, m), xd(Backend::cuda, x), yd(Backend::cuda, x);
  th::HostTensor y(DType::bf16, 2, 128);
  auto error_of = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  QuantOptions on_gpu = with_matrix(QuantOptions::mx(Format::mxfp4, ScaleRule::even), 32, m, nullptr);
  on_gpu.backend = Backend::cuda;
  const std::string host_r = error_of([&] { qdq(xd.view(), yd.view(), on_gpu); });
  EXPECT_NE(host_r.find("option 'rotation_matrix': in host memory, but the CUDA backend reads it from device memory"),
            std::string::npos) << host_r;
  QuantOptions on_cpu = with_matrix(QuantOptions::mx(Format::mxfp4, ScaleRule::even), 32, m, nullptr);
  on_cpu.rotation_matrix = md.view();
  const std::string dev_r = error_of([&] { qdq(x.view(), y.view(), on_cpu); });
  EXPECT_NE(dev_r.find("option 'rotation_matrix': in GPU memory"), std::string::npos) << dev_r;
  on_gpu.rotation_matrix = md.view();
  EXPECT_EQ(error_of([&] { qdq(xd.view(), yd.view(), on_gpu); }), "no error");
  // only the matrix the op reads is checked: quantize reads R, not a host R^-1 beside it
  on_gpu.rotation_inverse = m.view();
  th::PlacedQuantized qd(Backend::cuda, on_gpu, 2, 128);
  EXPECT_EQ(error_of([&] { quantize(xd.view(), qd.out(), on_gpu); }), "no error");
  // the matrix is an input: sharing memory with an output is refused
  QuantOptions alias = on_gpu;
  alias.rotation_inverse = Tensor{};
  const th::HostTensor big = th::llm_like(DType::f32, 64, 128, 2);
  th::Placed bd(Backend::cuda, big);
  alias.rotation_matrix = Tensor::of(bd.view().data, DType::f32, 32, 32, 0, Device::cuda);
  th::Placed xf(Backend::cuda, big);
  const std::string overlap = error_of([&] { qdq(xf.view(), bd.view(), alias); });
  EXPECT_NE(overlap.find("rotation_matrix"), std::string::npos) << overlap;
}


// MatrixPrecision::bf16 on the CPU backends: the exact sums (within the bound by definition), so the
// same bytes as MatrixPrecision::exact; and its refusals, each naming the argument.
TEST(RotationMatrixBf16, CpuBackendsComputeTheExactSums) {
  for (int rs : {16, 128}) {
    const auto [mv, iv] = random_rotation(rs, 11 + rs, true);
    const th::HostTensor m = matrix_tensor(mv, rs, DType::bf16);
    const th::HostTensor x = th::llm_like(DType::bf16, 6, 256, 4);
    for (Backend b : {Backend::reference, Backend::cpu}) {
      QuantOptions o = with_matrix(QuantOptions::mx(Format::mxfp4, ScaleRule::even), rs, m, nullptr);
      o.backend = b;
      QuantOptions f = o;
      f.matrix_precision = MatrixPrecision::bf16;
      th::HostTensor ye(DType::bf16, 6, 256), yf(DType::bf16, 6, 256);
      qdq(x.view(), ye.view(), o);
      qdq(x.view(), yf.view(), f);
      th::expect_same_bytes(ye, yf, "qdq bf16 precision against exact, RS " + std::to_string(rs));
    }
  }
}

TEST(RotationMatrixBf16, RefusalsNameTheArgument) {
  const auto [mv, iv] = random_rotation(32, 5, true);
  const th::HostTensor mb = matrix_tensor(mv, 32, DType::bf16), mf = matrix_tensor(mv, 32, DType::f32);
  const th::HostTensor xb = th::llm_like(DType::bf16, 2, 256, 1), xf = th::llm_like(DType::f32, 2, 256, 1);
  auto error_of = [&](const th::HostTensor& x, QuantOptions o) {
    th::HostTensor y(x.dtype, x.rows, x.cols);
    try {
      qdq(x.view(), y.view(), o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  QuantOptions o = with_matrix(QuantOptions::mx(Format::mxfp4, ScaleRule::even), 32, mb, nullptr);
  o.matrix_precision = MatrixPrecision::bf16;
  EXPECT_EQ(error_of(xb, o), "no error");
  std::string e = error_of(xf, o);
  EXPECT_NE(e.find("argument 'x': dtype f32 with matrix_precision 'bf16', expected bf16"), std::string::npos) << e;
  QuantOptions of = o;
  of.rotation_matrix = mf.view();
  e = error_of(xb, of);
  EXPECT_NE(e.find("option 'rotation_matrix': dtype f32 with matrix_precision 'bf16', expected bf16"), std::string::npos) << e;
  QuantOptions h = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  h.rotation = Rotation::hadamard;
  h.rotation_size = 32;
  h.matrix_precision = MatrixPrecision::bf16;
  e = error_of(xb, h);
  EXPECT_NE(e.find("option 'matrix_precision': 'bf16' with rotation 'hadamard'"), std::string::npos) << e;
  const auto [m2, i2] = random_rotation(256, 5, true);
  const th::HostTensor m256 = matrix_tensor(m2, 256, DType::bf16);
  QuantOptions big = with_matrix(QuantOptions::mx(Format::mxfp4, ScaleRule::even), 256, m256, nullptr);
  big.matrix_precision = MatrixPrecision::bf16;
  e = error_of(xb, big);
  EXPECT_NE(e.find("option 'matrix_precision': 'bf16' with rotation_size 256"), std::string::npos) << e;
  QuantOptions bad = o;
  bad.matrix_precision = static_cast<MatrixPrecision>(7);
  e = error_of(xb, bad);
  EXPECT_NE(e.find("option 'matrix_precision': invalid value 7"), std::string::npos) << e;
}

// The normalised Hadamard matrix of size rs rounded to bf16 (QuTLASS's matrix).
std::vector<float> hadamard_bf16(int rs) {
  std::vector<float> h(std::size_t(rs) * rs);
  const float a = bf16_to_f32(f32_to_bf16(float(1.0 / std::sqrt(double(rs)))));
  for (int i = 0; i < rs; ++i)
    for (int j = 0; j < rs; ++j) h[std::size_t(i) * rs + j] = (__builtin_popcount(unsigned(i & j)) & 1) ? -a : a;
  return h;
}

// MatrixPrecision::bf16 on the GPU (the bf16 tensor cores' sums) against the stated bound: each
// rotated value y' lies within B = RS 2^-20 sum_i |x_i R_ij| + RS 2^-126 of the exact y (double).
// Every code and scale byte that differs from what the exact y gives is traced: the GPU's block scale
// lies between the scales of the block amax shrunk and grown by the bounds, and each GPU code, under
// the GPU's scale, between the codes of y - B and y + B (the codecs are monotone). Blocks with a NaN or
// an infinity: the same NaN scale byte as the exact path. QDQ's bytes equal the GPU quantize's codes
// decoded (the same products), and NVFP4's computed tensor scale comes from an amax within the bounds.
// Formats: MXFP4 even, MXFP8 E4M3 rceil, NVFP4 given and computed S; RS 16..128; the Hadamard matrix
// in bf16 (QuTLASS's), a random orthogonal bf16 matrix and a random non-orthogonal one.
// Both block forms of the kernels (MXQ_CUDA_MATRIX_BF16_WARPS: 4 and 8 warps; 8 is skipped on a GPU
// whose shared memory does not hold such a block).
class CudaRotationMatrixBf16 : public testing::TestWithParam<int> {
 protected:
  void SetUp() override { setenv("MXQ_CUDA_MATRIX_BF16_WARPS", std::to_string(GetParam()).c_str(), 1); }
  void TearDown() override { unsetenv("MXQ_CUDA_MATRIX_BF16_WARPS"); }
};
INSTANTIATE_TEST_SUITE_P(Cuda, CudaRotationMatrixBf16, testing::Values(4, 8),
                         [](const testing::TestParamInfo<int>& i) { return "Warps" + std::to_string(i.param); });

TEST_P(CudaRotationMatrixBf16, WithinTheStatedBound) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  std::int64_t n_codes = 0, n_blocks = 0, code_diff = 0, scale_diff = 0, outside = 0;
  for (int rs : {16, 32, 64, 128}) {
    std::vector<std::pair<std::vector<float>, const char*>> mats;
    mats.push_back({hadamard_bf16(rs), "hadamard bf16"});
    mats.push_back({random_rotation(rs, 70 + rs, true).first, "orthogonal bf16"});
    {
      std::mt19937 rng(500 + rs);
      std::normal_distribution<float> nd;
      std::vector<float> w(std::size_t(rs) * rs);
      for (float& v : w) v = bf16_to_f32(f32_to_bf16(nd(rng) * 0.3f));
      mats.push_back({w, "random bf16"});
    }
    for (const auto& [mv, mname] : mats) {
      const th::HostTensor m = matrix_tensor(mv, rs, DType::bf16);
      th::Placed md(Backend::cuda, m);
      const std::int64_t R = 24, K = 1024;
      // With a NaN and an infinity (their blocks, and NVFP4's computed S = 1), and without (S from the amax).
      for (const bool specials : {true, false}) {
        th::HostTensor x = th::llm_like(DType::bf16, R, K, 900 + rs);
        if (specials) {
          x.set(3, 5, std::nanf(""));
          x.set(R - 1, K - 2, INFINITY);
        }
        // The exact y and its bound, per element.
        std::vector<double> y(std::size_t(R * K)), bnd(std::size_t(R * K));
        std::vector<char> special(std::size_t(R * K), 0);
        for (std::int64_t r = 0; r < R; ++r)
          for (std::int64_t k0 = 0; k0 < K; k0 += rs)
            for (int j = 0; j < rs; ++j) {
              double s = 0, a = 0;
              bool fin = true;
              for (int i = 0; i < rs; ++i) {
                const double xi = x.get(r, k0 + i), rij = mv[std::size_t(i) * rs + j];
                if (!std::isfinite(xi)) fin = false;
                s += xi * rij;
                a += std::fabs(xi * rij);
              }
              const std::size_t at = std::size_t(r * K + k0 + j);
              y[at] = s;
              bnd[at] = rs * std::ldexp(a, -20) + rs * std::ldexp(1.0, -126);
              special[at] = !fin;
            }
        const QuantOptions nv_given = [] {
          QuantOptions o = QuantOptions::nvfp4();
          o.tensor_scale = 448.0f * 6.0f / 40.0f;
          return o;
        }();
        for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even),
                                         QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::rceil), nv_given, QuantOptions::nvfp4()}) {
          const std::string what = th::name_of(base) + " RS " + std::to_string(rs) + " " + mname + (specials ? " with NaN, inf" : "");
          SCOPED_TRACE(what);
          th::Scalar ws(Backend::cuda);
          QuantOptions co = th::on(Backend::cuda, with_matrix(base, rs, m, nullptr), ws);
          co.rotation_matrix = md.view();
          co.matrix_precision = MatrixPrecision::bf16;
          th::Placed xd(Backend::cuda, x);
          th::PlacedQuantized qd(Backend::cuda, co, R, K);
          try {
            quantize(xd.view(), qd.out(), co);
          } catch (const Error& e) {
            if (GetParam() == 8 && std::string(e.what()).find("shared memory") != std::string::npos)
              GTEST_SKIP() << "blocks of 8 warps do not fit this GPU's shared memory: " << e.what();
            throw;
          }
          th::Quantized g = qd.host;
          g.codes = qd.codes.get();
          g.scales = qd.scales.get();
          const bool nv = base.format == Format::nvfp4;
          const core::FloatSpec elem = nv || base.format == Format::mxfp4 ? core::kE2M1 : core::kE4M3;
          const int gs = nv ? 16 : 32;
          float S = 1.0f;
          if (nv) {
            S = qd.S.value();
            if (!base.tensor_scale && specials) {  // computed from a non-finite amax: 1 (docs/numerics.md)
              EXPECT_EQ(S, 1.0f);
            } else if (!base.tensor_scale) {  // computed: from the amax of the GPU's y, within the bounds
              double lo = 0, hi = 0;
              for (std::size_t i = 0; i < y.size(); ++i)
                if (!special[i]) lo = std::max(lo, std::fabs(y[i]) - bnd[i]), hi = std::max(hi, std::fabs(y[i]) + bnd[i]);
              // S = 448 * 6 / amax in fp32 arithmetic; a generous ulp either side
              EXPECT_GE(double(S), 2688.0 / hi * (1 - 1e-6)) << "S " << S << " amax bounds " << lo << " " << hi;
              EXPECT_LE(double(S), 2688.0 / lo * (1 + 1e-6)) << "S " << S << " amax bounds " << lo << " " << hi;
            } else {
              EXPECT_EQ(S, *base.tensor_scale);
            }
          }
          std::ostringstream first;
          int shown = 0;
          auto down = [](double v) { return std::nextafter(float(v), -INFINITY); };
          auto up = [](double v) { return std::nextafter(float(v), INFINITY); };
          for (std::int64_t r = 0; r < R; ++r)
            for (std::int64_t b = 0; b < K / gs; ++b) {
              ++n_blocks;
              bool sp = false;
              double alo = 0, ahi = 0, amax = 0;
              for (int i = 0; i < gs; ++i) {
                const std::size_t at = std::size_t(r * K + b * gs + i);
                sp = sp || special[at] || !std::isfinite(y[at]);
                alo = std::max(alo, std::fabs(y[at]) - bnd[at]);
                ahi = std::max(ahi, std::fabs(y[at]) + bnd[at]);
                amax = std::max(amax, std::fabs(y[at]));
              }
              const std::uint32_t sg = g.scale(r, b);
              if (sp) {
                EXPECT_EQ(sg, nv ? 0x7Fu : 0xFFu) << "row " << r << " block " << b << ": a NaN or infinity in its groups";
                continue;
              }
              std::uint32_t slo, shi, sx;
              if (nv) {
                slo = core::nvfp4_block_scale_code(down(alo), S), shi = core::nvfp4_block_scale_code(up(ahi), S);
                sx = core::nvfp4_block_scale_code(float(amax), S);
              } else {
                slo = std::uint32_t(core::mx_scale_exp(base.rule, down(alo), 0.0f, elem) + 127);
                shi = std::uint32_t(core::mx_scale_exp(base.rule, up(ahi), 0.0f, elem) + 127);
                sx = amax > 0 ? std::uint32_t(core::mx_scale_exp(base.rule, float(amax), 0.0f, elem) + 127) : 0u;
                if (alo <= 0) slo = 0;
              }
              scale_diff += sg != sx;
              bool bad = sg < slo || sg > shi;
              for (int i = 0; i < gs; ++i) {
                const std::int64_t k = b * gs + i;
                const std::size_t at = std::size_t(r * K + k);
                const float lo = down(y[at] - bnd[at]), hi = up(y[at] + bnd[at]), ex = float(y[at]);
                auto code = [&](float v) {
                  return nv ? core::nvfp4_encode(core::f2u(v), core::nvfp4_multiplier(sg, S)) : core::encode_scaled(core::f2u(v), int(sg) - 127, elem);
                };
                const std::uint32_t cg = g.code(r, k);
                ++n_codes;
                code_diff += cg != code(ex);
                const float dg = core::decode_f32(cg, elem), dlo = core::decode_f32(code(lo), elem), dhi = core::decode_f32(code(hi), elem);
                if (!(dlo <= dg && dg <= dhi)) {
                  bad = true;
                  if (shown < 5)
                    first << "\n  row " << r << " k " << k << ": y " << y[at] << " bound " << bnd[at] << " gpu code " << cg
                          << " (" << dg << ") allowed [" << dlo << ", " << dhi << "]";
                }
              }
              if (bad) {
                ++outside;
                if (shown++ < 5)
                  first << "\n  row " << r << " block " << b << ": amax " << amax << " [" << alo << ", " << ahi << "] gpu scale "
                        << sg << " allowed [" << slo << ", " << shi << "]";
              }
            }
          EXPECT_EQ(outside, 0) << "blocks outside the bound:" << first.str();
          // QDQ: the GPU's codes decoded (CPU dequantize without a rotation, to bf16)
          QuantOptions plain = base;
          plain.backend = Backend::reference;
          plain.tensor_scale = nv ? std::optional<float>(S) : std::nullopt;
          th::HostTensor dq(DType::bf16, R, K);
          dequantize(g.in(), dq.view(), plain);
          th::Placed yd(Backend::cuda, th::HostTensor(DType::bf16, R, K));
          qdq(xd.view(), yd.view(), co);
          th::expect_same_bytes(dq, yd.get(), "qdq against the GPU's codes decoded");
          if (testing::Test::HasFailure()) return;
        }
      }
    }
  }
  std::printf("[ bf16 tensor-core matrix rotation ] %lld codes, %lld differ from the exact y's (%.4f%%); %lld blocks, "
              "%lld scale bytes differ (%.4f%%); all within the bound\n",
              (long long)n_codes, (long long)code_diff, 100.0 * double(code_diff) / double(n_codes), (long long)n_blocks,
              (long long)scale_diff, 100.0 * double(scale_diff) / double(n_blocks));
}


// The bf16 product's kernels on the layouts the bound test does not reach, held to the dense case's
// bytes (each group's sums depend on that group's values and R only, not on where the group sits in
// a tile or in memory): a partial last tile with strided rows that are not 16-byte aligned (the
// scalar loads), swizzled scales, padding chunks of a partial MX block (K = 48, g = 32, RS = 16: as
// the same rows with 16 zero columns appended), stochastic rounding (words by element index), QDQ in
// place and into strided output. And a group of -0 values gives +0 (QDQ's output bytes 0x0000), as in
// the exact mode.
TEST_P(CudaRotationMatrixBf16, LayoutsGiveTheDenseBytes) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  struct Run {
    th::Quantized q;
    float S;
    th::HostTensor y;
  };
  // quantize and qdq of x on the GPU with options o (R in device memory)
  auto run = [&](const th::HostTensor& x, const QuantOptions& o, const th::HostTensor& m) -> Run {
    th::Placed md(Backend::cuda, m), xd(Backend::cuda, x);
    th::Scalar ws(Backend::cuda);
    QuantOptions co = th::on(Backend::cuda, o, ws);
    co.rotation_matrix = md.view();
    th::PlacedQuantized qd(Backend::cuda, co, x.rows, x.cols);
    quantize(xd.view(), qd.out(), co);
    Run r{qd.host, 0.0f, th::HostTensor(DType::bf16, x.rows, x.cols)};
    r.q.codes = qd.codes.get();
    r.q.scales = qd.scales.get();
    r.S = o.format == Format::nvfp4 ? qd.S.value() : 1.0f;
    th::Placed yd(Backend::cuda, th::HostTensor(DType::bf16, x.rows, x.cols));
    qdq(xd.view(), yd.view(), co);
    r.y = yd.get();
    return r;
  };
  auto same = [&](const Run& a, const Run& b, std::int64_t rows, std::int64_t K, int gs, const std::string& what) {
    int bad = 0;
    EXPECT_EQ(a.S, b.S) << what << ": tensor scale";
    for (std::int64_t r = 0; r < rows && bad < 5; ++r) {
      for (std::int64_t k = 0; k < K && bad < 5; ++k) {
        if (a.q.code(r, k) != b.q.code(r, k)) ADD_FAILURE() << what << ": code row " << r << " k " << k << ": " << a.q.code(r, k) << " vs " << b.q.code(r, k), ++bad;
        if (a.y.bits(r, k) != b.y.bits(r, k))
          ADD_FAILURE() << what << ": qdq row " << r << " k " << k << ": " << a.y.get(r, k) << " vs " << b.y.get(r, k), ++bad;
      }
      for (std::int64_t blk = 0; blk < (K + gs - 1) / gs && bad < 5; ++blk)
        if (a.q.scale(r, blk) != b.q.scale(r, blk)) ADD_FAILURE() << what << ": scale row " << r << " block " << blk, ++bad;
    }
  };
  const QuantOptions sr = [] {
    QuantOptions o = QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::rceil);
    o.rounding = Rounding::stochastic;
    o.seed = 7;
    return o;
  }();
  for (int rs : {16, 64, 128})
    for (const QuantOptions& base : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::nvfp4(), sr}) {
      const std::string what = th::name_of(base) + " RS " + std::to_string(rs);
      SCOPED_TRACE(what);
      const th::HostTensor m = matrix_tensor(random_rotation(rs, 40 + rs, true).first, rs, DType::bf16);
      QuantOptions o = with_matrix(base, rs, m, nullptr);
      o.matrix_precision = MatrixPrecision::bf16;
      const int gs = base.format == Format::nvfp4 ? 16 : 32;
      // K = 496 at RS 16: 31 groups a row, so 37 rows end in a partial tile of 16 groups at every RS
      const std::int64_t R = 48, K = rs == 16 ? 496 : 512, Rp = 37;
      th::HostTensor x = th::llm_like(DType::bf16, R, K, 77 + rs);
      for (std::int64_t k = 0; k < K; ++k) x.set(0, k, -0.0f);
      x.set(1, 7, 200.0f);  // the tensor amax (NVFP4's S) in a row every variant holds (others' < 20)
      std::optional<Run> dense_run;
      try {
        dense_run.emplace(run(x, o, m));
      } catch (const Error& e) {
        if (GetParam() == 8 && std::string(e.what()).find("shared memory") != std::string::npos)
          GTEST_SKIP() << "blocks of 8 warps do not fit this GPU's shared memory: " << e.what();
        throw;
      }
      const Run& dense = *dense_run;
      for (std::int64_t k = 0; k < K; ++k)
        ASSERT_EQ(dense.y.bits(0, k), 0u) << "a group of -0 values: qdq k " << k << " is not +0";
      // a partial last tile, rows 3 elements apart from 16-byte alignment
      th::HostTensor xs(DType::bf16, Rp, K, K + 3);
      for (std::int64_t r = 0; r < Rp; ++r)
        for (std::int64_t k = 0; k < K; ++k) xs.set(r, k, x.get(r, k));
      same(dense, run(xs, o, m), Rp, K, gs, what + ", 37 strided unaligned rows");
      // swizzled scales
      QuantOptions sw = o;
      sw.scale_layout = ScaleLayout::swizzled;
      same(dense, run(x, sw, m), R, K, gs, what + ", swizzled scales");
      // QDQ in place, and into a strided output
      {
        th::Scalar ws(Backend::cuda);
        th::Placed md(Backend::cuda, m), xd(Backend::cuda, x);
        QuantOptions co = th::on(Backend::cuda, o, ws);
        co.rotation_matrix = md.view();
        qdq(xd.view(), xd.view(), co);
        th::expect_same_bytes(dense.y, xd.get(), what + ": qdq in place");
        th::Placed ys(Backend::cuda, th::HostTensor(DType::bf16, R, K, K + 24)), x2(Backend::cuda, x);
        qdq(x2.view(), ys.view(), co);
        const th::HostTensor yh = ys.get();
        for (std::int64_t r = 0; r < R; ++r)
          for (std::int64_t k = 0; k < K + 24; ++k) {  // the 24 gap columns keep their poison (0xA5A5)
            const std::uint32_t got = yh.bits(r, k), want = k < K ? dense.y.bits(r, k) : 0xA5A5u;
            if (got != want) {
              ADD_FAILURE() << what << ": strided qdq output row " << r << " k " << k << (k < K ? "" : " (a gap column)");
              r = R;
              break;
            }
          }
      }
      // padding chunks of a partial block: K = 48 against the same rows with 16 zero columns
      if (rs == 16 && base.format != Format::nvfp4) {
        th::HostTensor a(DType::bf16, 8, 48), b(DType::bf16, 8, 64);
        for (std::int64_t r = 0; r < 8; ++r)
          for (std::int64_t k = 0; k < 64; ++k) {
            if (k < 48) a.set(r, k, x.get(r + 2, k));
            b.set(r, k, k < 48 ? x.get(r + 2, k) : 0.0f);
          }
        if (base.rounding == Rounding::nearest_even) same(run(b, o, m), run(a, o, m), 8, 48, gs, what + ", K = 48 (padding chunks)");
      }
      if (testing::Test::HasFailure()) return;
    }
}

}  // namespace
