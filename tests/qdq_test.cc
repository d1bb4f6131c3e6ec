// qdq on every backend against the reference, byte for byte: out of place and in place, for the whole
// case grid, every input dtype, awkward and strided shapes, and every bf16 pattern.
#include <gtest/gtest.h>

#include "backends.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

class Qdq : public testing::TestWithParam<th::BackendCase> {};

TEST_P(Qdq, MatchesReferenceBitExactOutOfPlaceAndInPlace) {
  const auto [b, c] = GetParam();
  TH_REQUIRE_BACKEND(b);
  const QuantOptions o = th::options_of(c);
  th::Scalar workspace(b);
  std::uint32_t seed = 1;
  for (const th::Shape& s : th::shapes_for(group_size(o))) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const th::HostTensor x = th::grid_input(dt, s, seed++);
      SCOPED_TRACE(th::name_of(o) + " " + std::string(to_string(dt)) + " " + core::shape_str(s.rows, s.cols) + " stride " +
                   std::to_string(s.stride));
      QuantOptions oref = o;
      oref.backend = Backend::reference;
      th::HostTensor yr(dt, s.rows, s.cols, s.stride);
      qdq(x.view(), yr.view(), oref);
      th::Placed xb(b, x);
      for (int threads : th::thread_counts(b)) {
        th::set_threads(threads);
        th::Placed y(b, th::HostTensor(dt, s.rows, s.cols, s.stride));
        qdq(xb.view(), y.view(), th::on(b, o, workspace));
        th::expect_same_bytes(yr, y.get(), "qdq" + (threads ? ", threads=" + std::to_string(threads) : std::string()));
      }
      th::set_threads(2);
      th::Placed z(b, x);
      qdq(z.view(), z.view(), th::on(b, o, workspace));
      th::expect_same_bytes(yr, z.get(), "in-place qdq");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, Qdq, testing::Combine(testing::ValuesIn(th::backends()), testing::ValuesIn(th::all_cases())),
                         th::backend_case_name);

class QdqExhaustive : public testing::TestWithParam<Backend> {};

TEST_P(QdqExhaustive, EveryBf16PatternMatchesReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  th::Scalar workspace(b);
  th::for_each_sweep_case(b, [&](const QuantOptions& o, const th::HostTensor& x, th::Placed& xb) {
    QuantOptions oref = o;
    oref.backend = Backend::reference;
    th::HostTensor yr(DType::bf16, x.rows, x.cols);
    qdq(x.view(), yr.view(), oref);
    th::Placed y(b, yr);
    qdq(xb.view(), y.view(), th::on(b, o, workspace));
    th::expect_same_bytes(yr, y.get(), "qdq");
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, QdqExhaustive, testing::ValuesIn(th::backends()), th::backend_name);

}  // namespace
