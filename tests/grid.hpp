#pragma once
// The one case grid of the backend-vs-reference tests (quantize_test, dequantize_test, qdq_test,
// layout_test): every backend runs the same cases, named "<backend>_<format>_<rule>_<rounding>[_g<g>]".
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <mxq/mxq.hpp>

#include "backends.hpp"
#include "core/validate.hpp"
#include "helpers.hpp"

namespace mxq {
// gtest prints a parameter with PrintTo, found by argument-dependent lookup.
inline void PrintTo(Backend b, std::ostream* os) { *os << to_string(b); }
}  // namespace mxq

namespace th {

struct Case {
  mxq::Format format;
  mxq::ScaleRule rule;
  mxq::Rounding rounding;
  int group;  // 0 = the format's default
  int random_bits = 32;  // stochastic rounding: random bits per element
  bool aligned = false;  // offset 0 (every chunk starts at a Philox call) instead of 12345
};

inline void PrintTo(const Case& c, std::ostream* os) {
  *os << mxq::to_string(c.format) << "/" << mxq::to_string(c.rule) << "/" << mxq::to_string(c.rounding) << "/g" << c.group << "/r" << c.random_bits
      << (c.aligned ? "/aligned" : "");
}

// The backends checked against the reference: the fast CPU path and the CUDA kernels (skipped, with
// the reason, where no CUDA device is usable).
inline std::vector<mxq::Backend> backends() { return {mxq::Backend::cpu, mxq::Backend::cuda}; }

// Whether format f takes rounding rd: nvfp4_e5m3 rounds to nearest even only.
inline bool rounds(mxq::Format f, mxq::Rounding rd) {
  return f != mxq::Format::nvfp4_e5m3 || rd == mxq::Rounding::nearest_even;
}

// The options of format f under rule r (NVFP4: its own constructor, tensor scale computed).
inline mxq::QuantOptions format_options(mxq::Format f, mxq::ScaleRule r) {
  mxq::QuantOptions o = f == mxq::Format::nvfp4        ? mxq::QuantOptions::nvfp4()
                        : f == mxq::Format::nvfp4_e5m3 ? mxq::QuantOptions::nvfp4_e5m3()
                                                       : mxq::QuantOptions::mx(f, r);
  o.rule = r;
  return o;
}

// Every format x every rule it accepts (mxq::rules_for), default group size, both roundings (nvfp4_e5m3:
// round to nearest even only, groups of 16 and 32); NVFP4 in groups of 32 too; other group sizes (the C = 2 and C = 8 kernels, T = 1 .. 32 lanes per group).
inline std::vector<Case> all_cases() {
  using mxq::Format;
  using mxq::ScaleRule;
  std::vector<Case> v;
  for (mxq::Rounding rd : {mxq::Rounding::nearest_even, mxq::Rounding::stochastic}) {
    for (Format f : mxq::all_formats())
      for (ScaleRule r : mxq::rules_for(f))
        if (rounds(f, rd)) v.push_back({f, r, rd, 0});
    if (rd == mxq::Rounding::nearest_even) v.push_back({Format::nvfp4_e5m3, ScaleRule::nvfp4_e5m3, rd, 32});
    v.push_back({Format::nvfp4, ScaleRule::nvfp4, rd, 32});
    for (int g : {8, 32}) v.push_back({Format::nvfp4, ScaleRule::quest, rd, g});  // groups over several lanes, C = 2
    for (int g : {2, 4, 8, 16, 64, 128, 256}) {
      v.push_back({Format::mxfp4, ScaleRule::quest, rd, g});
      v.push_back({Format::mxfp8_e4m3, ScaleRule::even, rd, g});
    }
    v.push_back({Format::mxfp4, ScaleRule::even, rd, 16});
    v.push_back({Format::mxfp8_e4m3, ScaleRule::floor, rd, 64});
    v.push_back({Format::mxint8, ScaleRule::floor, rd, 2});
    v.push_back({Format::mxfp6_e3m2, ScaleRule::rceil, rd, 4});
  }
  // Stochastic rounding with 16 and 8 random bits per element (and 32, at an aligned offset): the
  // kernels' aligned Philox paths (offset 0) and their per-element fallback (offset 12345).
  for (int bits : {8, 16, 32}) {
    for (bool aligned : {false, true}) {
      if (bits == 32 && !aligned) continue;  // the cases above
      const auto sr = mxq::Rounding::stochastic;
      v.push_back({Format::mxfp4, ScaleRule::even, sr, 0, bits, aligned});
      v.push_back({Format::mxfp8_e4m3, ScaleRule::floor, sr, 0, bits, aligned});
      v.push_back({Format::nvfp4, ScaleRule::nvfp4, sr, 0, bits, aligned});
      v.push_back({Format::nvfp4, ScaleRule::quest, sr, 0, bits, aligned});
      v.push_back({Format::mxfp6_e2m3, ScaleRule::floor, sr, 0, bits, aligned});  // floor clips E2M3: saturation after SR
      v.push_back({Format::mxfp4, ScaleRule::quest, sr, 8, bits, aligned});
      v.push_back({Format::mxint8, ScaleRule::floor, sr, 2, bits, aligned});
    }
  }
  return v;
}

inline mxq::QuantOptions options_of(const Case& c) {
  mxq::QuantOptions o = format_options(c.format, c.rule);
  o.rounding = c.rounding;
  o.group_size = c.group;
  o.seed = 0xC0FFEE;
  o.offset = c.aligned ? 0 : 12345;
  o.random_bits = c.random_bits;
  return o;
}

struct Shape {
  std::int64_t rows, cols, stride;
};
// Awkward shapes for group size g: one row, K = g - 1, g, g + 1, rows past 128 (the swizzled
// layout's padding), strided rows, long rows.
inline std::vector<Shape> shapes_for(int g) {
  return {{1, 1, 0}, {1, g - 1, 0}, {1, g, 0}, {1, g + 1, 0}, {3, 97, 0}, {130, 65, 80},
          {2, 4103, 0}, {16, 1024, 0}, {5, 256, 259}, {257, 96, 0}};
}

// An input of the grid: LLM-like, with a NaN block and an Inf block where there are three rows.
inline HostTensor grid_input(mxq::DType dt, const Shape& s, std::uint32_t seed) {
  HostTensor x = llm_like(dt, s.rows, s.cols, seed, s.stride);
  if (s.rows >= 3) {
    x.set(1, 0, NAN);
    x.set(2, s.cols - 1, -INFINITY);
  }
  return x;
}

using BackendCase = std::tuple<mxq::Backend, Case>;
inline std::string backend_case_name(const testing::TestParamInfo<BackendCase>& i) {
  const Case& c = std::get<1>(i.param);
  std::string n = std::string(mxq::to_string(std::get<0>(i.param))) + "_" + std::string(mxq::to_string(c.format)) + "_" +
                  std::string(mxq::to_string(c.rule)) + "_" + std::string(mxq::to_string(c.rounding));
  if (c.group) n += "_g" + std::to_string(c.group);
  if (c.random_bits != 32) n += "_r" + std::to_string(c.random_bits);
  if (c.aligned) n += "_aligned";
  return n;
}
inline std::string backend_name(const testing::TestParamInfo<mxq::Backend>& i) { return std::string(mxq::to_string(i.param)); }

// ---- the exhaustive bf16 sweep --------------------------------------------------------------------------
// Every bf16 pattern once, shuffled into [rows, 65536 / rows] (mixed magnitudes, NaN/Inf blocks): the
// sweep takes [256, 256] (rows wide enough for the fast paths that take eight blocks at a time) and
// [2048, 32] (rows too short for them: the block-at-a-time paths).
inline HostTensor all_bf16_shuffled(std::int64_t rows = 256) {
  std::vector<std::uint16_t> pats(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) pats[i] = std::uint16_t(i);
  std::shuffle(pats.begin(), pats.end(), std::mt19937(5));
  HostTensor x(mxq::DType::bf16, rows, 65536 / rows);
  std::memcpy(x.bytes.data(), pats.data(), 65536 * 2);
  return x;
}
// Every bf16 pattern beside a fixed anchor in [1, 2^31), one per row of [65536, 2] (group size 2), so
// each pattern is converted at many different scales.
inline HostTensor all_bf16_anchored() {
  HostTensor x(mxq::DType::bf16, 65536, 2);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const std::uint16_t p = std::uint16_t(i), a = std::uint16_t(0x3F80 + ((i * 37) % 0x0F00));
    std::memcpy(&x.bytes[i * 4], &p, 2);
    std::memcpy(&x.bytes[i * 4 + 2], &a, 2);
  }
  return x;
}
// An NVFP4 tensor scale S under which an output of a block scaled by 448 (the sweep's usual block
// scale), (e2m1 magnitude x 448) / S rounded to fp32, lies exactly halfway between two bf16 values: the
// output conversion's ties are reached (with S = 1 no output has more than 6 significant bits).
inline float nvfp4_bf16_tie_scale() {
  const float mags[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (std::uint32_t k = 1;; ++k) {
    float S;
    const std::uint32_t bits = 0x3F800000u + k;
    std::memcpy(&S, &bits, 4);
    for (float m : mags) {
      volatile float v = (m * 448.0f) / S;  // exact product, one IEEE division
      const float w = v;
      std::uint32_t b;
      std::memcpy(&b, &w, 4);
      if ((b & 0xFFFFu) == 0x8000u) return S;
    }
  }
}

// The sweep's options: every format x every rule it accepts, NVFP4 with a computed and given tensor
// scales (1; one reaching the bf16 output's ties; tiny ones whose outputs pass the largest bf16 and
// overflow fp32), nvfp4_e5m3 in groups of 16 and 32; each with round-to-nearest-even and (every format but
// nvfp4_e5m3) with stochastic rounding.
inline std::vector<mxq::QuantOptions> sweep_options() {
  using namespace mxq;
  std::vector<QuantOptions> opts;
  for (Format f : all_formats())
    for (ScaleRule r : rules_for(f)) opts.push_back(format_options(f, r));
  opts.push_back(QuantOptions::nvfp4_e5m3(32));
  // (3.4e38: S / s overflows to Inf for small block scales, where zero elements must stay zero)
  for (float S : {1.0f, nvfp4_bf16_tie_scale(), 7.915e-36f, 1.881e-38f, 3.4e38f}) opts.push_back(QuantOptions::nvfp4(S));
  for (std::size_t i = 0, n = opts.size(); i < n; ++i) {
    if (!rounds(opts[i].format, Rounding::stochastic)) continue;
    QuantOptions sr = opts[i];
    sr.rounding = Rounding::stochastic;
    sr.seed = 99;
    opts.push_back(sr);
    sr.random_bits = 8;  // the aligned 8-bit path (offset 0)
    opts.push_back(sr);
  }
  return opts;
}

// f(options, input, the input on backend b) for every sweep option x the three sweep inputs (the shuffled
// patterns in the format's groups as [256, 256] and [2048, 32], the anchored ones in groups of 2, or for
// nvfp4_e5m3, whose groups are 16 or 32, as the two elements of a zero-padded group), traced by name.
template <class F>
void for_each_sweep_case(mxq::Backend b, F&& f) {
  const HostTensor shuffled = all_bf16_shuffled(), narrow = all_bf16_shuffled(2048), anchored = all_bf16_anchored();
  Placed sb(b, shuffled), nb(b, narrow), ab(b, anchored);
  for (mxq::QuantOptions o : sweep_options()) {
    for (const HostTensor* x : {&shuffled, &narrow, &anchored}) {
      if (o.format != mxq::Format::nvfp4_e5m3) o.group_size = x == &anchored ? 2 : 0;
      SCOPED_TRACE(name_of(o) + (x == &anchored ? " anchored" : (x == &narrow ? " shuffled [2048, 32]" : " shuffled")));
      f(o, *x, x == &anchored ? ab : (x == &narrow ? nb : sb));
    }
  }
}

}  // namespace th
