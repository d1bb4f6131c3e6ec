// dequantize on every backend against the reference, byte for byte: the reference's codes and scales
// (both layouts) of the whole case grid to every output dtype, and arbitrary code and scale bytes
// (NaN/Inf element codes, stray FP6 high bits, NaN scales).
#include <random>

#include <gtest/gtest.h>

#include "backends.hpp"
#include "grid.hpp"

using namespace mxq;

namespace {

class Dequantize : public testing::TestWithParam<th::BackendCase> {};

TEST_P(Dequantize, MatchesReferenceBitExact) {
  const auto [b, c] = GetParam();
  TH_REQUIRE_BACKEND(b);
  QuantOptions o = th::options_of(c);
  o.backend = Backend::reference;
  std::uint32_t seed = 1;
  for (const th::Shape& s : th::shapes_for(group_size(o))) {
    const th::HostTensor x = th::grid_input(DType::bf16, s, seed++);
    for (ScaleLayout layout : {ScaleLayout::linear, ScaleLayout::swizzled}) {
      o.scale_layout = layout;
      o.tensor_scale.reset();
      th::Quantized q(o, s.rows, s.cols);
      quantize(x.view(), q.out(), o);
      if (c.format == Format::nvfp4) o.tensor_scale = q.S;
      th::Placed codes(b, q.codes), scales(b, q.scales);
      for (DType ot : {DType::f32, DType::bf16, DType::f16}) {
        SCOPED_TRACE(th::name_of(o) + " " + core::shape_str(s.rows, s.cols) + " to " + std::string(to_string(ot)));
        th::HostTensor yr(ot, s.rows, s.cols);
        dequantize(q.in(), yr.view(), o);
        for (int threads : th::thread_counts(b)) {
          th::set_threads(threads);
          QuantOptions ob = o;
          ob.backend = b;
          th::Placed y(b, th::HostTensor(ot, s.rows, s.cols));
          dequantize(QuantizedIn{codes.view(), scales.view()}, y.view(), ob);
          th::expect_same_bytes(yr, y.get(), "dequantize" + (threads ? ", threads=" + std::to_string(threads) : std::string()));
        }
        th::set_threads(2);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, Dequantize, testing::Combine(testing::ValuesIn(th::backends()), testing::ValuesIn(th::all_cases())),
                         th::backend_case_name);

class DequantizeBytes : public testing::TestWithParam<Backend> {};

// Backend b's dequantize of q (R x K) to every output dtype against the reference's, bytes.
void expect_dequantize_matches_reference(Backend b, QuantOptions o, const th::Quantized& q, std::int64_t R, std::int64_t K,
                                         const std::string& what) {
  th::Placed codes(b, q.codes), scales(b, q.scales);
  for (DType ot : {DType::f32, DType::bf16, DType::f16}) {
    th::HostTensor yr(ot, R, K);
    o.backend = Backend::reference;
    dequantize(q.in(), yr.view(), o);
    th::Placed y(b, yr);
    o.backend = b;
    dequantize(QuantizedIn{codes.view(), scales.view()}, y.view(), o);
    th::expect_same_bytes(yr, y.get(), what + " to " + std::string(to_string(ot)));
  }
}

TEST_P(DequantizeBytes, ArbitraryCodeAndScaleBytesMatchReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  std::mt19937 rng(3);
  for (Format f : all_formats()) {
    QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(3.0f) : th::format_options(f, rules_for(f)[0]);
    th::Quantized q(o, 7, 300);
    for (auto& v : q.codes.bytes) v = std::uint8_t(rng());
    for (auto& v : q.scales.bytes) v = std::uint8_t(rng());
    expect_dequantize_matches_reference(b, o, q, 7, 300, std::string(to_string(f)) + " random bytes");
  }
}

// NVFP4, exhaustively: every scale byte (negative ones and the NaN byte included) with every code, in
// each position of a block, under tensor scales that keep the values normal, make them subnormal in
// the output dtype, or overflow it (S tiny: Inf), to every output dtype (the fast CPU path reads a
// table of (scale byte, magnitude) pairs and flips the sign: this checks every entry and both signs).
TEST_P(DequantizeBytes, Nvfp4EveryScaleByteAndCodeMatchesReference) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  const std::int64_t R = 256, K = 256;  // row r: scale byte r in every block; codes 0..15 in each block
  for (float S : {3.0f, 1e-3f, 1e-30f, 2.5e6f, 1e30f}) {
    QuantOptions o = QuantOptions::nvfp4(S);
    th::Quantized q(o, R, K);
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t k = 0; k < K / 2; ++k) {
        const std::uint8_t lo = std::uint8_t((k * 2 + r) % 16), hi = std::uint8_t((k * 2 + 1 + 3 * r) % 16);
        q.codes.bytes[std::size_t(r * (K / 2) + k)] = std::uint8_t(lo | (hi << 4));
      }
      for (std::int64_t c = 0; c < K / 16; ++c) q.scales.bytes[std::size_t(r * (K / 16) + c)] = std::uint8_t(r);
    }
    expect_dequantize_matches_reference(b, o, q, R, K, "nvfp4 every scale byte and code, S " + std::to_string(S));
  }
}

// The one-byte MX formats, exhaustively: every scale byte (row r: byte r in every block, the NaN byte
// 0xFF included) with every finite code, in blocks free of NaN/Inf codes (the fast CPU path decodes
// such blocks straight from their bytes, by the exponent for the scales where every value is a normal
// fp32: this covers both sides of that range's bounds), and a row whose blocks each hold a NaN code
// (the scalar path), to every output dtype.
TEST_P(DequantizeBytes, MxOneByteFormatsEveryScaleByteAndFiniteCode) {
  const Backend b = GetParam();
  TH_REQUIRE_BACKEND(b);
  for (Format f : {Format::mxfp8_e4m3, Format::mxfp8_e5m2, Format::mxfp6_e2m3, Format::mxfp6_e3m2, Format::mxint8}) {
    const FormatInfo fi = format_info(f);
    // the finite codes of f, in order (FP8: magnitudes up to the largest finite one, both signs)
    std::vector<std::uint8_t> finite;
    for (int c = 0; c < (fi.elem_bits == 6 ? 64 : 256); ++c) {
      const int mag = c & (fi.elem_bits == 6 ? 0x1F : 0x7F);
      const bool special = f == Format::mxfp8_e4m3 ? mag == 0x7F : f == Format::mxfp8_e5m2 ? mag >= 0x7C : false;
      if (!special) finite.push_back(std::uint8_t(c));
    }
    const std::int64_t R = 257, K = 512;  // row 256: a NaN/Inf code in every block (FP8) or as row 0
    QuantOptions o = QuantOptions::mx(f, ScaleRule::floor);
    th::Quantized q(o, R, K);
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t k = 0; k < K; ++k)
        q.codes.bytes[std::size_t(r * K + k)] = finite[std::size_t(k + 7 * r) % finite.size()];
      for (std::int64_t c = 0; c < K / 32; ++c) q.scales.bytes[std::size_t(r * (K / 32) + c)] = std::uint8_t(r < 256 ? r : 127);
    }
    if (fi.elem_bits == 8 && f != Format::mxint8)
      for (std::int64_t k = 0; k < K; k += 32) q.codes.bytes[std::size_t(256 * K + k + 5)] = 0xFF;  // NaN (E4M3) / NaN (E5M2)
    expect_dequantize_matches_reference(b, o, q, R, K, std::string(to_string(f)) + " every scale byte and finite code");
    // Mixed tiles: a scale byte per block (in and out of the exact range and the NaN byte side by side),
    // a partial last block (K = 525), and in odd rows one NaN/Inf code in a single block (FP8: the
    // whole tile then takes the per-block path, with its other blocks finite).
    const std::int64_t R2 = 64, K2 = 525, nb = (K2 + 31) / 32;
    th::Quantized q2(o, R2, K2);
    for (std::int64_t r = 0; r < R2; ++r) {
      for (std::int64_t k = 0; k < K2; ++k)
        q2.codes.bytes[std::size_t(r * K2 + k)] = finite[std::size_t(3 * k + 11 * r) % finite.size()];
      for (std::int64_t c = 0; c < nb; ++c) q2.scales.bytes[std::size_t(r * nb + c)] = std::uint8_t((r * 5 + 37 * c) & 0xFF);
      if (r % 2 && fi.elem_bits == 8 && f != Format::mxint8) q2.codes.bytes[std::size_t(r * K2 + 32 * (r % nb) + 3)] = 0x7F;
    }
    expect_dequantize_matches_reference(b, o, q2, R2, K2, std::string(to_string(f)) + " mixed scales, partial block");
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, DequantizeBytes, testing::ValuesIn(th::backends()), th::backend_name);

}  // namespace
