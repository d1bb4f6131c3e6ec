// The fused producer ops (rms_norm, silu_mul, each with an optional QDQ of its output) on every
// backend: byte for byte the reference backend's producer followed by the reference qdq, over the
// case grid's round-to-nearest cases, every dtype, awkward, strided and long rows, in place; the
// producers' arithmetic against float64 (within the stated ulps); the exp they use; the refusals.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "core/fused_math.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

enum class Op { rms, silu };
const char* op_name(Op op) { return op == Op::rms ? "rms_norm" : "silu_mul"; }

struct Inputs {
  th::HostTensor a, b;  // x and weight [1, K], or gate and up
};

Inputs make_inputs(Op op, DType dt, const th::Shape& s, std::uint32_t seed) {
  Inputs in{th::grid_input(dt, s, seed), {}};
  if (op == Op::rms) {
    in.b = th::HostTensor(dt, 1, s.cols);
    std::mt19937 rng(seed + 7);
    std::uniform_real_distribution<float> u(0.25f, 2.0f);
    for (std::int64_t k = 0; k < s.cols; ++k) in.b.set(0, k, u(rng) * (k % 5 == 0 ? -1.0f : 1.0f));
  } else {
    in.b = th::llm_like(dt, s.rows, s.cols, seed + 11, s.stride);
    // gate values spanning SiLU's saturated and linear ranges
    std::mt19937 rng(seed + 3);
    std::uniform_real_distribution<float> u(-20.0f, 20.0f);
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t k = 0; k < s.cols; k += 3) in.a.set(r, k, u(rng));
  }
  return in;
}

void run(Op op, const mxq::Tensor& a, const mxq::Tensor& b, const mxq::Tensor& y, const QuantOptions* q, Backend be) {
  if (op == Op::rms) rms_norm(a, b, 1e-6f, y, q, be);
  else silu_mul(a, b, y, q, be);
}

// Producer then qdq, both on the reference backend.
th::HostTensor expected(Op op, const Inputs& in, const th::Shape& s, const QuantOptions* q) {
  th::HostTensor y(in.a.dtype, s.rows, s.cols, s.stride);
  run(op, in.a.view(), in.b.view(), y.view(), nullptr, Backend::reference);
  if (q) {
    QuantOptions o = *q;
    o.backend = Backend::reference;
    qdq(y.view(), y.view(), o);
  }
  return y;
}

std::vector<QuantOptions> fused_cases() {
  std::vector<QuantOptions> v;
  for (const th::Case& c : th::all_cases()) {
    if (c.rounding != Rounding::nearest_even) continue;
    QuantOptions o = th::options_of(c);
    if (o.format == Format::nvfp4 && o.rule == ScaleRule::quest) continue;  // refused there (api_test Nvfp4Quest)
    if (o.format == Format::nvfp4_e5m3) continue;  // refused there (api_test Nvfp4E5m3Options)
    if (o.format == Format::nvfp4) o.tensor_scale = 448.0f * 6.0f / 3.5f;
    v.push_back(o);
  }
  return v;
}

std::vector<th::Shape> fused_shapes() {
  // one and several lanes' chunks per row, K % 8 != 0 (the scalar path), rows of more than 256 chunks
  // (several chunks per lane), strided views
  return {{1, 1, 0}, {3, 97, 0}, {4, 2048, 0}, {2, 5504, 0}, {2, 8200, 0}, {3, 4103, 0}, {130, 65, 80}, {5, 256, 264}};
}

class Fused : public testing::TestWithParam<std::tuple<Backend, Op>> {};

TEST_P(Fused, ProducerAndQdqMatchReferenceComposition) {
  const auto [b, op] = GetParam();
  TH_REQUIRE_BACKEND(b);
  std::uint32_t seed = 1;
  const std::vector<QuantOptions> cases = fused_cases();
  for (const th::Shape& s : fused_shapes())
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const Inputs in = make_inputs(op, dt, s, seed++);
      th::Placed a(b, in.a), w(b, in.b);
      SCOPED_TRACE(std::string(op_name(op)) + " " + std::string(to_string(dt)) + " " + core::shape_str(s.rows, s.cols) +
                   " stride " + std::to_string(s.stride));
      {
        th::Placed y(b, th::HostTensor(dt, s.rows, s.cols, s.stride));
        run(op, a.view(), w.view(), y.view(), nullptr, b);
        th::expect_same_bytes(expected(op, in, s, nullptr), y.get(), "producer only");
      }
      for (const QuantOptions& q : cases) {
        if (s.cols > 1000 && q.group_size != 0 && q.group_size != 16) continue;  // long rows: default groups
        SCOPED_TRACE(th::name_of(q));
        th::Placed y(b, th::HostTensor(dt, s.rows, s.cols, s.stride));
        run(op, a.view(), w.view(), y.view(), &q, b);
        th::expect_same_bytes(expected(op, in, s, &q), y.get(), "fused");
      }
      // in place: y is the first input
      const QuantOptions q = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
      th::Placed z(b, in.a);
      run(op, z.view(), w.view(), z.view(), &q, b);
      th::expect_same_bytes(expected(op, in, s, &q), z.get(), "in place");
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, Fused,
                         testing::Combine(testing::Values(Backend::cpu, Backend::cuda), testing::Values(Op::rms, Op::silu)),
                         [](const auto& i) {
                           return std::string(to_string(std::get<0>(i.param))) + "_" + op_name(std::get<1>(i.param));
                         });

// The SiLU-and-multiply halves of one concatenated [rows, 2K] gate_up tensor, as row-strided views.
TEST(Fused, SiluMulOnHalvesOfAConcatenatedTensor) {
  const std::int64_t R = 5, K = 96;
  th::HostTensor gu = th::llm_like(DType::bf16, R, 2 * K, 3);
  th::HostTensor gate(DType::bf16, R, K), up(DType::bf16, R, K);
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t k = 0; k < K; ++k) gate.set(r, k, gu.get(r, k)), up.set(r, k, gu.get(r, K + k));
  th::HostTensor y1(DType::bf16, R, K), y2(DType::bf16, R, K);
  const QuantOptions q = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  silu_mul(gate.view(), up.view(), y1.view(), &q);
  auto* base = reinterpret_cast<std::uint16_t*>(gu.bytes.data());
  silu_mul(Tensor::of(base, DType::bf16, R, K, 2 * K), Tensor::of(base + K, DType::bf16, R, K, 2 * K), y2.view(), &q);
  th::expect_same_bytes(y1, y2, "halves");
}

// ---- the producers' arithmetic ---------------------------------------------------------------------------------
double ulp_of(double v, DType t) {
  const int mbits = t == DType::f32 ? 23 : (t == DType::bf16 ? 7 : 10);
  const int emin = t == DType::f32 ? -126 : (t == DType::bf16 ? -126 : -14);
  int e = v == 0.0 ? emin : std::max(emin, std::ilogb(v));
  return std::ldexp(1.0, e - mbits);
}

TEST(FusedMath, ExpIsWithinTwoUlpOfTheTrueValue) {
  // every 97th fp32 pattern in exp's finite, non-zero range, both signs, plus the edges
  int worst = 0;
  for (std::uint32_t u = 0; u < 0x43000000u; u += 97)
    for (std::uint32_t s : {0u, 0x80000000u}) {
      const float x = core::u2f(u | s);
      if (x > 88.7228394f || x < -87.0f) continue;  // results in the normal range
      const double t = std::exp(double(x));
      const float got = core::exp_f32(x);
      const double err = std::fabs(double(got) - t) / ulp_of(t, DType::f32);
      worst = std::max(worst, int(std::ceil(err - 0.5)));
      ASSERT_LE(err, 2.0) << "x = " << x << " got " << got << " exp " << t;
    }
  EXPECT_EQ(core::exp_f32(89.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(core::exp_f32(-104.0f), 0.0f);
  EXPECT_TRUE(std::isnan(core::exp_f32(NAN)));
  EXPECT_GT(core::exp_f32(-100.0f), 0.0f);  // subnormal results
  EXPECT_NEAR(core::exp_f32(-100.0f), std::exp(-100.0), 2e-45);
  EXPECT_LE(worst, 2);
}

TEST(FusedMath, ProducersAgreeWithFloat64WithinOneUlpOfTheDtype) {
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    const th::Shape s{4, 1000, 0};
    const Inputs rin = make_inputs(Op::rms, dt, s, 5);
    th::HostTensor y(dt, s.rows, s.cols);
    rms_norm(rin.a.view(), rin.b.view(), 1e-5f, y.view());
    for (std::int64_t r = 0; r < s.rows; ++r) {
      double ss = 0;
      for (std::int64_t k = 0; k < s.cols; ++k) ss += double(rin.a.get(r, k)) * rin.a.get(r, k);
      if (!std::isfinite(ss)) continue;  // rows with the grid's NaN / Inf
      const double inv = 1.0 / std::sqrt(ss / double(s.cols) + double(1e-5f));
      for (std::int64_t k = 0; k < s.cols; ++k) {
        const double t = double(rin.b.get(0, k)) * rin.a.get(r, k) * inv;
        // two roundings to the dtype (x * r, then w * that): within 1.5 ulp plus fp32's own error
        EXPECT_LE(std::fabs(y.get(r, k) - t), 1.5 * ulp_of(std::fabs(t), dt) + 1e-6 * std::fabs(t))
            << to_string(dt) << " rms_norm [" << r << ", " << k << "]";
      }
    }
    const Inputs sin = make_inputs(Op::silu, dt, s, 6);
    silu_mul(sin.a.view(), sin.b.view(), y.view());
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t k = 0; k < s.cols; ++k) {
        const double g = sin.a.get(r, k), u = sin.b.get(r, k);
        if (!std::isfinite(g) || !std::isfinite(u)) continue;
        const double t = g / (1.0 + std::exp(-g)) * u;
        EXPECT_LE(std::fabs(y.get(r, k) - t), 1.5 * ulp_of(std::fabs(t), dt) + 1e-6 * std::fabs(t))
            << to_string(dt) << " silu_mul [" << r << ", " << k << "] g=" << g << " u=" << u;
      }
  }
}

TEST(FusedMath, RoundingToTheDtypeOverflowsToInfinityAndCanonicalisesNaN) {
  EXPECT_EQ(core::round_to_dtype_bits(3.4e38f, DType::bf16), 0x7F80u);
  EXPECT_EQ(core::round_to_dtype_bits(-3.4e38f, DType::bf16), 0xFF80u);
  EXPECT_EQ(core::round_to_dtype_bits(65520.0f, DType::f16), 0x7C00u);
  EXPECT_EQ(core::round_to_dtype_bits(65519.0f, DType::f16), 0x7BFFu);
  EXPECT_EQ(core::round_to_dtype_bits(core::u2f(0xFFC00001u), DType::f32), 0x7FC00000u);
  EXPECT_EQ(core::round_to_dtype_bits(core::u2f(0xFFC00001u), DType::bf16), 0x7FC0u);
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {  // every f16 pattern decodes exactly
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu)) continue;
    EXPECT_EQ(core::round_to_dtype_bits(core::dtype_bits_to_f32(h, DType::f16), DType::f16), h) << h;
  }
}

// ---- refusals ----------------------------------------------------------------------------------------------------
TEST(Fused, RefusesWhatItCannotComputeNamingTheArgument) {
  th::HostTensor x = th::llm_like(DType::bf16, 2, 64, 1), w(DType::bf16, 1, 64), y(DType::bf16, 2, 64);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  QuantOptions sr = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  sr.rounding = Rounding::stochastic;
  EXPECT_NE(message([&] { rms_norm(x.view(), w.view(), 1e-6f, y.view(), &sr); }).find("rounding"), std::string::npos);
  const QuantOptions nv = QuantOptions::nvfp4();
  EXPECT_NE(message([&] { rms_norm(x.view(), w.view(), 1e-6f, y.view(), &nv); }).find("tensor_scale"), std::string::npos);
  EXPECT_NE(message([&] { rms_norm(x.view(), w.view(), -1.0f, y.view()); }).find("'eps'"), std::string::npos);
  EXPECT_NE(message([&] { rms_norm(x.view(), w.view(), NAN, y.view()); }).find("'eps'"), std::string::npos);
  th::HostTensor w2(DType::bf16, 1, 63), wf(DType::f32, 1, 64);
  EXPECT_NE(message([&] { rms_norm(x.view(), w2.view(), 1e-6f, y.view()); }).find("'weight'"), std::string::npos);
  EXPECT_NE(message([&] { rms_norm(x.view(), wf.view(), 1e-6f, y.view()); }).find("'weight'"), std::string::npos);
  th::HostTensor up(DType::bf16, 2, 65);
  EXPECT_NE(message([&] { silu_mul(x.view(), up.view(), y.view()); }).find("'up'"), std::string::npos);
  // y overlapping weight, and partially overlapping x
  EXPECT_NE(message([&] { rms_norm(x.view(), Tensor::of(x.bytes.data(), DType::bf16, 1, 64), 1e-6f, x.view()); })
                .find("overlap"),
            std::string::npos);
  QuantOptions other = QuantOptions::mx(Format::mxfp4, ScaleRule::even);
  other.backend = Backend::reference;
  EXPECT_NE(message([&] { rms_norm(x.view(), w.view(), 1e-6f, y.view(), &other, Backend::cpu); }).find("backend"),
            std::string::npos);
}

}  // namespace
