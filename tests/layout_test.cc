// Scale layouts (swizzle, unswizzle) and the tensor amax on every backend against the reference.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

class Layout : public testing::TestWithParam<Backend> {};

TEST_P(Layout, SwizzleAndUnswizzleMatchReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  std::mt19937 rng(8);
  for (auto [r, c] : {std::pair<int, int>{1, 1}, {130, 7}, {256, 8}, {300, 65}}) {
    SCOPED_TRACE(core::shape_str(r, c));
    th::HostTensor lin(DType::u8, r, c, c + 3);
    for (auto& v : lin.bytes) v = std::uint8_t(rng());
    th::HostTensor swr(DType::u8, (r + 127) / 128 * 128, (c + 3) / 4 * 4);
    swizzle_scales(lin.view(), swr.view(), Backend::reference);
    th::Placed lb(b, lin), sw(b, swr);
    swizzle_scales(lb.view(), sw.view(), b);
    th::expect_same_bytes(swr, sw.get(), "swizzle");
    th::Placed back(b, th::HostTensor(DType::u8, r, c, c + 3));
    unswizzle_scales(sw.view(), back.view(), b);
    th::expect_same_bytes(lin, back.get(), "unswizzle");
  }
}

TEST_P(Layout, TensorAmaxMatchesReferenceWithSpecials) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  th::HostTensor x = th::llm_like(DType::bf16, 33, 1000, 4, 1003);
  EXPECT_EQ(tensor_amax(th::Placed(b, x).view(), b), tensor_amax(x.view(), Backend::reference));
  x.set(5, 5, -INFINITY);
  EXPECT_TRUE(std::isinf(tensor_amax(th::Placed(b, x).view(), b)));
  x.set(7, 999, NAN);
  EXPECT_TRUE(std::isnan(tensor_amax(th::Placed(b, x).view(), b)));
}

INSTANTIATE_TEST_SUITE_P(Backends, Layout, testing::ValuesIn(th::backends()), th::backend_name);

}  // namespace
