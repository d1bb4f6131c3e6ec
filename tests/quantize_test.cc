// quantize on every backend against the reference, byte for byte: codes, scales (both layouts), clip
// mask and NVFP4 tensor scale, for the whole case grid, every input dtype, awkward and strided shapes,
// and every bf16 pattern. The CPU backend runs each case at 1, 2 and 3 threads.
#include <bit>

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
        SCOPED_TRACE(th::name_of(o) + " " + std::string(to_string(dt)) + " " + core::shape_str(s.rows, s.cols) +
                     " stride " + std::to_string(s.stride));
        QuantOptions oref = o;
        oref.backend = Backend::reference;
        th::Quantized qr(oref, s.rows, s.cols, true);
        quantize(x.view(), qr.out(), oref);
        for (int threads : th::thread_counts(b)) {
          th::set_threads(threads);
          const std::string t = threads ? ", threads=" + std::to_string(threads) : "";
          th::PlacedQuantized q(b, o, s.rows, s.cols);
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
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, QuantizeExhaustive, testing::ValuesIn(th::backends()), th::backend_name);

}  // namespace
