// quantize on every backend against the reference, byte for byte: codes, scales (both layouts), clip
// mask and NVFP4 tensor scale, for the whole case grid, every input dtype, awkward and strided shapes,
// and every bf16 pattern. The CPU backend runs each case at 1, 2 and 3 threads.
#include <bit>
#include <cmath>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

class Quantize : public testing::TestWithParam<th::BackendCase> {};

TEST_P(Quantize, MatchesReferenceBitExact) {
  const auto [b, c] = GetParam();
  TH_REQUIRE_BACKEND(b);
  QuantOptions o = th::options_of(c);
  th::Scalar workspace(b);
  std::uint32_t seed = 1;
  for (const th::Shape& s : th::shapes_for(group_size(o))) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const th::HostTensor x = th::grid_input(dt, s, seed++);
      th::Placed xb(b, x);
      for (ScaleLayout layout : {ScaleLayout::linear, ScaleLayout::swizzled}) {
        o.scale_layout = layout;
        // with and without a clip mask, each layout both ways across the dtypes (the CPU's maskless
        // direct paths, e.g. NVFP4's eight blocks at a time, differ from its masked ones)
        const bool with_mask = (layout == ScaleLayout::linear) != (dt == DType::f32);
        SCOPED_TRACE(th::name_of(o) + " " + std::string(to_string(dt)) + " " + core::shape_str(s.rows, s.cols) +
                     " stride " + std::to_string(s.stride) + (with_mask ? " with" : " without") + " a clip mask");
        QuantOptions oref = o;
        oref.backend = Backend::reference;
        th::Quantized qr(oref, s.rows, s.cols, with_mask);
        quantize(x.view(), qr.out(), oref);
        for (int threads : th::thread_counts(b)) {
          th::set_threads(threads);
          const std::string t = threads ? ", threads=" + std::to_string(threads) : "";
          th::PlacedQuantized q(b, o, s.rows, s.cols, with_mask);
          quantize(xb.view(), q.out(), th::on(b, o, workspace));
          th::expect_same_bytes(qr.codes, q.codes.get(), "codes" + t);
          th::expect_same_bytes(qr.scales, q.scales.get(), "scales" + t);
          th::expect_same_bytes(qr.mask, q.mask.get(), "clip mask" + t);
          EXPECT_EQ(std::bit_cast<std::uint32_t>(qr.S), std::bit_cast<std::uint32_t>(q.S.value())) << "tensor scale" << t;
        }
        th::set_threads(2);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, Quantize, testing::Combine(testing::ValuesIn(th::backends()), testing::ValuesIn(th::all_cases())),
                         th::backend_case_name);

// Every bf16 bit pattern: shuffled blocks of 32, and each pattern beside a fixed anchor in a group of
// 2 (so it is converted at many scales), for every format x rule x rounding of the sweep.
class QuantizeExhaustive : public testing::TestWithParam<Backend> {};

TEST_P(QuantizeExhaustive, EveryBf16PatternMatchesReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  th::Scalar workspace(b);
  th::for_each_sweep_case(b, [&](const QuantOptions& o, const th::HostTensor& x, th::Placed& xb) {
    QuantOptions oref = o;
    oref.backend = Backend::reference;
    th::Quantized qr(oref, x.rows, x.cols, true);
    quantize(x.view(), qr.out(), oref);
    th::PlacedQuantized q(b, o, x.rows, x.cols);
    quantize(xb.view(), q.out(), th::on(b, o, workspace));
    th::expect_same_bytes(qr.codes, q.codes.get(), "codes");
    th::expect_same_bytes(qr.scales, q.scales.get(), "scales");
    th::expect_same_bytes(qr.mask, q.mask.get(), "clip mask");
    // without a clip mask (another path of the fast CPU backend: FP4 codes of bf16 packed as they
    // are computed)
    th::PlacedQuantized qn(b, o, x.rows, x.cols);
    mxq::QuantizedOut out = qn.out();
    out.clip_mask = Tensor{};
    quantize(xb.view(), out, th::on(b, o, workspace));
    th::expect_same_bytes(qr.codes, qn.codes.get(), "codes (no clip mask)");
    th::expect_same_bytes(qr.scales, qn.scales.get(), "scales (no clip mask)");
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, QuantizeExhaustive, testing::ValuesIn(th::backends()), th::backend_name);

// Hand-built blocks that the LLM-like grid and the bf16 sweep rarely hold, through quantize, dequantize
// and QDQ for every sweep option (and 16 random bits), every input dtype: all +0, mixed +-0, fp32
// subnormals (the fast paths' scales outside MxFastRange), tiny normals, values near FLT_MAX, one
// nonzero element, rounding ties, a NaN and an Inf; rows end in a partial block (K = 3 * 32 + 7), and
// rows long enough for the fast paths that take eight blocks at a time (K = 2 * 256 + 103).
class EdgeBlocks : public testing::TestWithParam<Backend> {};

TEST_P(EdgeBlocks, QuantizeDequantizeQdqMatchReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  th::Scalar workspace(b);
  const std::int64_t R = 9;
  std::vector<QuantOptions> opts = th::sweep_options();
  {
    QuantOptions sr = QuantOptions::mx(Format::mxfp6_e3m2, ScaleRule::even);
    sr.rounding = Rounding::stochastic;
    sr.random_bits = 16;
    sr.offset = 7;
    opts.push_back(sr);
  }
  for (const std::int64_t K : {std::int64_t(103), std::int64_t(615)})
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    th::HostTensor x(dt, R, K);
    for (std::int64_t k = 0; k < K; ++k) {
      const float t = float(k % 13) - 6.0f;  // -6 .. 6
      x.set(0, k, 0.0f);
      x.set(1, k, k % 3 ? -0.0f : 0.0f);
      x.set(2, k, std::ldexp(t, -140 + int(k % 9)));               // fp32 subnormals (0 in bf16/f16 below their range)
      x.set(3, k, std::ldexp(t, -126 + int(k % 5)));               // smallest normals
      x.set(4, k, std::ldexp(t + 0.5f, 124 + int(k % 3)));         // up to ~FLT_MAX
      x.set(5, k, k % 32 == 5 ? -3.25f : 0.0f);                    // one nonzero per block
      x.set(6, k, (0.25f + 0.5f * float(k % 8)) * (k % 2 ? -1.0f : 1.0f));  // halfway points of the grids
      x.set(7, k, std::ldexp(t, -20 + int(k % 40)));               // wide range in one block
      x.set(8, k, k == 40 ? NAN : (k == 70 ? INFINITY : t));
    }
    th::Placed xb(b, x);
    for (QuantOptions o : opts) {
      SCOPED_TRACE(th::name_of(o) + " " + std::string(to_string(dt)) + " K " + std::to_string(K));
      QuantOptions oref = o;
      oref.backend = Backend::reference;
      th::Quantized qr(oref, R, K, true);
      quantize(x.view(), qr.out(), oref);
      th::PlacedQuantized q(b, o, R, K);
      quantize(xb.view(), q.out(), th::on(b, o, workspace));
      th::expect_same_bytes(qr.codes, q.codes.get(), "codes");
      th::expect_same_bytes(qr.scales, q.scales.get(), "scales");
      th::expect_same_bytes(qr.mask, q.mask.get(), "clip mask");

      th::HostTensor yr(dt, R, K);
      qdq(x.view(), yr.view(), oref);
      th::Placed y(b, yr);
      qdq(xb.view(), y.view(), th::on(b, o, workspace));
      th::expect_same_bytes(yr, y.get(), "qdq");

      QuantOptions od = oref;
      if (o.format == Format::nvfp4) od.tensor_scale = qr.S;
      th::HostTensor dr(dt, R, K);
      dequantize(qr.in(), dr.view(), od);
      th::Placed codes(b, qr.codes), scales(b, qr.scales), d(b, th::HostTensor(dt, R, K));
      QuantOptions ob = od;
      ob.backend = b;
      dequantize(QuantizedIn{codes.view(), scales.view()}, d.view(), ob);
      th::expect_same_bytes(dr, d.get(), "dequantize");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, EdgeBlocks, testing::ValuesIn(th::backends()), th::backend_name);

// Stochastic rounding whose element index (offset + row K + column, mod 2^64) wraps past 2^64 inside a
// tensor: the words after the wrap restart at counter 0, on the CPU backend as in the reference, for
// offsets that put the wrap at a block boundary, inside a block, and inside a Philox call, every field
// width, MX and NVFP4; quantize's codes and scales and qdq's bytes. (The CPU backend's words come 256
// elements at a time per tile: a window crossing 2^64 once gave the blocks after the wrap wrong words.)
TEST(StochasticOffsets, IndicesWrapPast2To64AsTheReference) {
  const std::int64_t R = 3, K = 576;
  const th::HostTensor x = th::llm_like(DType::bf16, R, K, 31);
  // (4: a CUDA chunk of 16 aligned to a Philox call of 4 words straddles the wrap)
  for (std::uint64_t back : {std::uint64_t(32), std::uint64_t(5), std::uint64_t(700), std::uint64_t(1), std::uint64_t(4)})
    for (int bits : {32, 16, 8})
      for (QuantOptions o : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::nvfp4(2.0f)}) {
        o.rounding = Rounding::stochastic;
        o.seed = 99;
        o.offset = std::uint64_t(0) - back;  // the wrap falls `back` elements into the tensor
        o.random_bits = bits;
        SCOPED_TRACE(th::name_of(o) + " offset 2^64 - " + std::to_string(back));
        QuantOptions oref = o, ocpu = o;
        oref.backend = Backend::reference;
        ocpu.backend = Backend::cpu;
        th::Quantized qr(oref, R, K), qc(ocpu, R, K);
        quantize(x.view(), qr.out(), oref);
        quantize(x.view(), qc.out(), ocpu);
        th::expect_same_bytes(qr.codes, qc.codes, "codes");
        th::expect_same_bytes(qr.scales, qc.scales, "scales");
        th::HostTensor yr(DType::bf16, R, K), yc(DType::bf16, R, K);
        qdq(x.view(), yr.view(), oref);
        qdq(x.view(), yc.view(), ocpu);
        th::expect_same_bytes(yr, yc, "qdq");
        if (!th::unusable(Backend::cuda).empty()) continue;
        th::Scalar ws(Backend::cuda);
        const QuantOptions og = th::on(Backend::cuda, o, ws);
        th::Placed xd(Backend::cuda, x), yd(Backend::cuda, yc);
        th::PlacedQuantized qd(Backend::cuda, og, R, K);
        quantize(xd.view(), qd.out(), og);
        th::expect_same_bytes(qr.codes, qd.codes.get(), "cuda codes");
        th::expect_same_bytes(qr.scales, qd.scales.get(), "cuda scales");
        qdq(xd.view(), yd.view(), og);
        th::expect_same_bytes(yr, yd.get(), "cuda qdq");
      }
}

}  // namespace
