// Known answers that do not come from mxq: byte vectors computed by tests/known_answers/gen_known_answers.py
// (plain Python, exact rational arithmetic, docs/numerics.md's definitions written out afresh), checked
// on every backend. A uniform change that every backend makes alike (a stochastic-rounding counter
// shifted by one, two rows of the swizzled layout exchanged, the tensor scale rounded twice) passes the
// backend-vs-reference grids; it cannot pass these.
#include <bit>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "known_answers/known_answers.inc"

using namespace mxq;

namespace {

std::vector<Backend> all_backends() { return {Backend::reference, Backend::cpu, Backend::cuda}; }
std::string backend_name(const testing::TestParamInfo<Backend>& i) { return std::string(to_string(i.param)); }

Format format_of(const std::string& s) {
  if (s == "mxfp4") return Format::mxfp4;
  if (s == "mxfp8_e4m3") return Format::mxfp8_e4m3;
  if (s == "mxint8") return Format::mxint8;
  if (s == "nvfp4") return Format::nvfp4;
  throw std::runtime_error("unknown format " + s);
}

th::HostTensor bytes_tensor(const std::uint8_t* p, std::int64_t rows, std::int64_t cols) {
  th::HostTensor t(DType::u8, rows, cols);
  std::memcpy(t.bytes.data(), p, t.bytes.size());
  return t;
}
th::HostTensor f32_tensor(const std::uint32_t* p, std::int64_t rows, std::int64_t cols) {
  th::HostTensor t(DType::f32, rows, cols);
  std::memcpy(t.bytes.data(), p, t.bytes.size());
  return t;
}
std::string hex(std::uint32_t u) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08X", u);
  return b;
}

class KnownAnswerBackend : public testing::TestWithParam<Backend> {};

// Stochastic rounding: a fixed seed, a non-zero offset (some past 2^32 counters), K = 45 (ragged for
// groups of 32 and 16), 32, 16 and 8 random bits; codes, scales, NVFP4's computed tensor scale, and QDQ.
TEST_P(KnownAnswerBackend, StochasticRoundingBytes) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  for (const ka::SrCase& c : ka::sr_cases) {
    QuantOptions o;
    o.format = format_of(c.format);
    o.rule = o.format == Format::nvfp4 ? ScaleRule::nvfp4 : ScaleRule::floor;
    o.rounding = Rounding::stochastic;
    o.seed = c.seed;
    o.offset = c.offset;
    o.random_bits = c.random_bits;
    SCOPED_TRACE(th::name_of(o) + " seed " + std::to_string(c.seed) + " offset " + std::to_string(c.offset));
    const th::HostTensor x = f32_tensor(c.x, c.rows, c.cols);
    th::Scalar ws(b);
    const QuantOptions ob = th::on(b, o, ws);

    th::PlacedQuantized q(b, ob, c.rows, c.cols, false);
    th::Placed xb(b, x);
    quantize(xb.view(), q.out(), ob);
    ASSERT_EQ(q.host.codes.bytes.size(), std::size_t(c.ncodes));
    ASSERT_EQ(q.host.scales.bytes.size(), std::size_t(c.nscales));
    th::expect_same_bytes(bytes_tensor(c.codes, q.host.codes.rows, q.host.codes.cols), q.codes.get(), "codes");
    th::expect_same_bytes(bytes_tensor(c.scales, q.host.scales.rows, q.host.scales.cols), q.scales.get(), "scales");
    if (o.format == Format::nvfp4) EXPECT_EQ(hex(std::bit_cast<std::uint32_t>(q.S.value())), hex(c.tensor_scale));

    th::Placed y(b, th::HostTensor(DType::f32, c.rows, c.cols));
    qdq(xb.view(), y.view(), ob);
    th::expect_same_bytes(f32_tensor(c.qdq, c.rows, c.cols), y.get(), "qdq");
  }
}

// The 128x4 swizzled layout's offset formula, every (r, c) of two tiles down and two across.
TEST(KnownAnswer, SwizzledOffsetOfEveryRowOfTheTile) {
  int bad = 0;
  std::string first;
  for (int r = 0; r < ka::sw_padded_rows; ++r)
    for (int c = 0; c < ka::sw_padded_cols; ++c) {
      const std::int64_t want = ka::sw_offsets[r * ka::sw_padded_cols + c];
      const std::int64_t got = swizzled_offset(r, c, ka::sw_padded_cols);
      if (got != want && bad++ < 10)
        first += "  (" + std::to_string(r) + ", " + std::to_string(c) + "): " + std::to_string(got) + ", want " +
                 std::to_string(want) + "\n";
    }
  EXPECT_EQ(bad, 0) << bad << " offsets differ; first ones:\n" << first;
}

// swizzle_scales / unswizzle_scales on every backend against the stored image (padding included).
TEST_P(KnownAnswerBackend, SwizzleLayoutBytes) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  const th::HostTensor lin = bytes_tensor(ka::sw_linear, ka::sw_rows, ka::sw_cols);
  th::Placed lb(b, lin), sw(b, th::HostTensor(DType::u8, ka::sw_padded_rows, ka::sw_padded_cols));
  swizzle_scales(lb.view(), sw.view(), b);
  th::expect_same_bytes(bytes_tensor(ka::sw_swizzled, ka::sw_padded_rows, ka::sw_padded_cols), sw.get(), "swizzle");
  th::Placed back(b, th::HostTensor(DType::u8, ka::sw_rows, ka::sw_cols));
  unswizzle_scales(sw.view(), back.view(), b);
  th::expect_same_bytes(lin, back.get(), "unswizzle");
}

// quantize's own swizzled scale writes (the kernels index the layout themselves): each scale byte of a
// linear quantize lands at the stored offset of the swizzled one, padding zero.
TEST_P(KnownAnswerBackend, QuantizeWritesTheSwizzledLayout) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  static_assert(ka::sw_cols * 32 == 192);
  for (Format f : {Format::mxfp8_e4m3, Format::mxfp4}) {
    QuantOptions o;
    o.format = f;
    o.backend = b;
    SCOPED_TRACE(th::name_of(o));
    const th::HostTensor x = th::llm_like(DType::bf16, ka::sw_rows, ka::sw_cols * 32, 40);
    th::Placed xb(b, x);
    th::PlacedQuantized lin(b, o, ka::sw_rows, ka::sw_cols * 32, false);
    quantize(xb.view(), lin.out(), o);
    o.scale_layout = ScaleLayout::swizzled;
    th::PlacedQuantized sw(b, o, ka::sw_rows, ka::sw_cols * 32, false);
    ASSERT_EQ(sw.host.scales.rows, ka::sw_padded_rows);
    ASSERT_EQ(sw.host.scales.cols, ka::sw_padded_cols);
    quantize(xb.view(), sw.out(), o);
    const th::HostTensor l = lin.scales.get();
    th::HostTensor want(DType::u8, ka::sw_padded_rows, ka::sw_padded_cols);
    std::fill(want.bytes.begin(), want.bytes.end(), 0);
    for (int r = 0; r < ka::sw_rows; ++r)
      for (int c = 0; c < ka::sw_cols; ++c)
        want.bytes[ka::sw_offsets[r * ka::sw_padded_cols + c]] = l.bytes[r * l.stride + c];
    th::expect_same_bytes(want, sw.scales.get(), "swizzled scales");
  }
}

// NVFP4's tensor scale S = RN_f32(2688 / amax) (the division rounded once) over a sweep of amax:
// the public function, and quantize's computed S on every backend.
TEST(KnownAnswer, Nvfp4TensorScaleSweep) {
  int bad = 0;
  std::string first;
  for (std::size_t i = 0; i < std::size(ka::ts_amax); ++i) {
    const std::uint32_t got = std::bit_cast<std::uint32_t>(nvfp4_tensor_scale_from_amax(std::bit_cast<float>(ka::ts_amax[i])));
    if (got != ka::ts_scale[i] && bad++ < 10)
      first += "  amax " + hex(ka::ts_amax[i]) + ": S " + hex(got) + ", want " + hex(ka::ts_scale[i]) + "\n";
  }
  EXPECT_EQ(bad, 0) << bad << " of " << std::size(ka::ts_amax) << " tensor scales differ; first ones:\n" << first;
}

TEST_P(KnownAnswerBackend, Nvfp4ComputedTensorScaleSweep) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  // every amax, one tensor each: amax at column i % 16 (negated for odd i), smaller values elsewhere
  const std::size_t n = std::size(ka::ts_amax);
  int bad = 0;
  std::string first;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = std::bit_cast<float>(ka::ts_amax[i]);
    th::HostTensor x(DType::f32, 1, 16);
    for (int k = 0; k < 16; ++k) x.set(0, k, std::isfinite(a) ? a * (float(k + 1) / 128.0f) : 1.0f);
    x.set(0, int(i % 16), i % 2 ? -a : a);
    QuantOptions o;
    o.format = Format::nvfp4;
    o.rule = ScaleRule::nvfp4;
    th::Scalar ws(b);
    const QuantOptions ob = th::on(b, o, ws);
    th::PlacedQuantized q(b, ob, 1, 16, false);
    th::Placed xb(b, x);
    quantize(xb.view(), q.out(), ob);
    const std::uint32_t got = std::bit_cast<std::uint32_t>(q.S.value());
    if (got != ka::ts_scale[i] && bad++ < 10)
      first += "  amax " + hex(ka::ts_amax[i]) + ": S " + hex(got) + ", want " + hex(ka::ts_scale[i]) + "\n";
  }
  EXPECT_EQ(bad, 0) << bad << " of " << n << " computed tensor scales differ; first ones:\n" << first;
}

INSTANTIATE_TEST_SUITE_P(Backends, KnownAnswerBackend, testing::ValuesIn(all_backends()), backend_name);

}  // namespace
