#pragma once
// Test data and buffers: LLM-like inputs in every dtype, quantized-output holders sized by the
// public shape helpers, and byte comparisons that print the first mismatches with coordinates.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <mxq/mxq.hpp>

#include "core/codec.hpp"

namespace th {

// A dense host tensor of any float dtype, stored as raw bytes.
struct HostTensor {
  mxq::DType dtype = mxq::DType::f32;
  std::int64_t rows = 0, cols = 0, stride = 0;
  std::vector<std::uint8_t> bytes;

  HostTensor() = default;
  HostTensor(mxq::DType t, std::int64_t r, std::int64_t c, std::int64_t s = 0)
      : dtype(t), rows(r), cols(c), stride(s ? s : c), bytes(std::size_t(r * (s ? s : c) * esize(t)), 0xA5) {}
  static std::int64_t esize(mxq::DType t) {
    return t == mxq::DType::i64 ? 8 : (t == mxq::DType::f32 || t == mxq::DType::i32) ? 4 : (t == mxq::DType::u8 ? 1 : 2);
  }
  mxq::Tensor view() const {
    return mxq::Tensor::of(bytes.data(), dtype, rows, cols, stride == cols ? 0 : stride);
  }
  // Store an fp32 value rounded (RNE) to the dtype.
  void set(std::int64_t r, std::int64_t c, float v) {
    const std::int64_t i = r * stride + c;
    const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
    if (dtype == mxq::DType::f32) {
      std::memcpy(&bytes[i * 4], &u, 4);
    } else {
      std::uint16_t h;
      if (dtype == mxq::DType::bf16)
        h = mxq::f32_to_bf16(v);
      else
        h = std::bit_cast<std::uint16_t>(static_cast<_Float16>(v));
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  float get(std::int64_t r, std::int64_t c) const {
    const std::int64_t i = r * stride + c;
    if (dtype == mxq::DType::f32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      return f;
    }
    std::uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return dtype == mxq::DType::bf16 ? mxq::bf16_to_f32(h) : mxq::f16_to_f32(h);
  }
  std::uint32_t bits(std::int64_t r, std::int64_t c) const {
    const std::int64_t i = r * stride + c;
    if (dtype == mxq::DType::f32) {
      std::uint32_t u;
      std::memcpy(&u, &bytes[i * 4], 4);
      return u;
    }
    std::uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return h;
  }
};

// LLM-like data: a Gaussian bulk, a few heavy outlier channels, some exact zeros and tiny values.
inline HostTensor llm_like(mxq::DType t, std::int64_t rows, std::int64_t cols, std::uint32_t seed,
                           std::int64_t stride = 0) {
  HostTensor x(t, rows, cols, stride);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::student_t_distribution<float> heavy(2.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float v = nd(rng) * 0.02f;
      if (c % 97 == 13) v = heavy(rng) * 3.0f;     // outlier channel
      if (rng() % 53 == 0) v = 0.0f;                // exact zeros
      if (rng() % 101 == 0) v = std::ldexp(nd(rng), -30);  // tiny values
      if (t == mxq::DType::f16) v = std::clamp(v, -60000.0f, 60000.0f);
      x.set(r, c, v);
    }
  return x;
}

// Output buffers for quantize, poisoned so that unwritten bytes show up.
struct Quantized {
  mxq::QuantOptions opt;
  std::int64_t rows, K;
  HostTensor codes, scales, mask;
  float S = -1.0f;

  Quantized(const mxq::QuantOptions& o, std::int64_t r, std::int64_t k, bool with_mask = false) : opt(o), rows(r), K(k) {
    codes = HostTensor(mxq::DType::u8, r, mxq::code_cols(o.format, k));
    const mxq::Shape2 ss = mxq::scale_shape(o, r, k);
    scales = HostTensor(mxq::DType::u8, ss.rows, ss.cols);
    if (with_mask) {
      const mxq::Shape2 ms = mxq::clip_mask_shape(r, k);
      mask = HostTensor(mxq::DType::u8, ms.rows, ms.cols);
    }
  }
  mxq::QuantizedOut out() {
    mxq::QuantizedOut o;
    o.codes = codes.view();
    o.scales = scales.view();
    if (!mask.bytes.empty()) o.clip_mask = mask.view();
    o.tensor_scale = &S;
    return o;
  }
  mxq::QuantizedIn in() const { return mxq::QuantizedIn{codes.view(), scales.view()}; }
  std::uint32_t code(std::int64_t r, std::int64_t k) const {
    if (mxq::format_info(opt.format).elem_bits == 4) {
      const std::uint8_t b = codes.bytes[r * codes.stride + k / 2];
      return k % 2 ? b >> 4 : b & 0xF;
    }
    return codes.bytes[r * codes.stride + k];
  }
  std::uint8_t scale(std::int64_t r, std::int64_t b) const {
    const std::int64_t off = opt.scale_layout == mxq::ScaleLayout::swizzled
                                 ? mxq::swizzled_offset(r, b, scales.cols)
                                 : r * scales.stride + b;
    return scales.bytes[off];
  }
};

// Compares two byte buffers of a [rows, cols] layout; prints the first mismatches with coordinates.
inline void expect_same_bytes(const HostTensor& a, const HostTensor& b, const std::string& what) {
  ASSERT_EQ(a.bytes.size(), b.bytes.size()) << what;
  long n = 0;
  std::string first;
  const std::int64_t es = HostTensor::esize(a.dtype);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t c = 0; c < a.cols; ++c)
      for (std::int64_t k = 0; k < es; ++k) {
        const std::size_t i = std::size_t((r * a.stride + c) * es + k);
        if (a.bytes[i] != b.bytes[i]) {
          if (n < 10)
            first += "  [" + std::to_string(r) + ", " + std::to_string(c) + "] byte " + std::to_string(k) + ": " +
                     std::to_string(a.bytes[i]) + " vs " + std::to_string(b.bytes[i]) +
                     (es > 1 ? " (values " + std::to_string(a.get(r, c)) + " vs " + std::to_string(b.get(r, c)) + ")" : "") + "\n";
          ++n;
        }
      }
  EXPECT_EQ(n, 0) << what << ": " << n << " mismatching bytes; first ones:\n" << first;
}

inline std::string name_of(const mxq::QuantOptions& o) {
  return std::string(mxq::to_string(o.format)) + "/" + std::string(mxq::to_string(o.rule)) + "/" +
         std::string(mxq::to_string(o.rounding)) + "/" + std::string(mxq::to_string(o.scale_layout)) + "/g" +
         std::to_string(mxq::group_size(o)) +
         (o.rounding == mxq::Rounding::stochastic ? "/r" + std::to_string(o.random_bits) : std::string());
}

}  // namespace th
