#pragma once
// An independent, exact formulation of the element formats for the tests: every representable
// value is enumerated from the format's definition (exponent bits, mantissa bits, bias, largest
// finite value, as tabulated in docs/numerics.md) in double precision, and rounding is a search for
// the nearest value with ties to the even code. Shares nothing with src/core/codec.hpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <mxq/types.hpp>

namespace oracle {

struct Fmt {
  const char* name;
  int bits, ebits, mbits, bias;
  double maxval;
  bool int8;
  std::vector<double> vals;  // non-negative finite values, index == magnitude code
};

inline Fmt make(const char* name, int bits, int ebits, int mbits, int bias, double maxval, bool int8 = false) {
  Fmt f{name, bits, ebits, mbits, bias, maxval, int8, {}};
  const int ncodes = 1 << (bits - 1);
  for (int c = 0; c < ncodes; ++c) {
    double v;
    if (int8) {
      v = c / 64.0;
    } else {
      const int ef = c >> mbits, mant = c & ((1 << mbits) - 1);
      v = ef == 0 ? std::ldexp(double(mant), 1 - bias - mbits) : std::ldexp(1.0 + std::ldexp(double(mant), -mbits), ef - bias);
    }
    if (v > maxval) break;  // NaN / Inf codes sit above the largest finite value
    f.vals.push_back(v);
  }
  return f;
}

inline const Fmt& fmt(mxq::ElemType t) {
  static const Fmt e2m1 = make("e2m1", 4, 2, 1, 1, 6.0), e2m3 = make("e2m3", 6, 2, 3, 1, 7.5),
                   e3m2 = make("e3m2", 6, 3, 2, 3, 28.0), e4m3 = make("e4m3", 8, 4, 3, 7, 448.0),
                   e5m2 = make("e5m2", 8, 5, 2, 15, 57344.0), int8 = make("int8", 8, 0, 6, 0, 127.0 / 64, true);
  switch (t) {
    case mxq::ElemType::e2m1: return e2m1;
    case mxq::ElemType::e2m3: return e2m3;
    case mxq::ElemType::e3m2: return e3m2;
    case mxq::ElemType::e4m3: return e4m3;
    case mxq::ElemType::e5m2: return e5m2;
    case mxq::ElemType::int8: return int8;
  }
  return e2m1;
}

inline std::uint32_t with_sign(const Fmt& f, std::uint32_t mag, bool neg) {
  if (f.int8) return neg ? ((0u - mag) & 0xFFu) : mag;
  return mag | (std::uint32_t(neg) << (f.bits - 1));
}

// Codes of the grid neighbours l <= a < h of a magnitude below the largest finite value.
inline std::pair<std::uint32_t, std::uint32_t> neighbours(const Fmt& f, double a) {
  const auto hi = std::upper_bound(f.vals.begin(), f.vals.end(), a);  // first value > a
  const std::uint32_t h = std::uint32_t(hi - f.vals.begin());
  return {h - 1, h};
}

// Round-to-nearest-even with saturation of an exact double.
inline std::uint32_t encode(const Fmt& f, double v) {
  const double a = std::fabs(v);
  std::uint32_t mag = std::uint32_t(f.vals.size() - 1);  // saturated
  if (a < f.maxval) {
    const auto [l, h] = neighbours(f, a);
    const double dl = a - f.vals[l], dh = f.vals[h] - a;
    mag = dl < dh ? l : (dh < dl ? h : ((l % 2 == 0) ? l : h));
  }
  return with_sign(f, mag, std::signbit(v));
}

// Stochastic rounding by the documented rule: round up iff rnd < floor(frac * 2^32).
inline std::uint32_t encode_sr(const Fmt& f, double v, std::uint32_t rnd) {
  const double a = std::fabs(v);
  std::uint32_t mag = std::uint32_t(f.vals.size() - 1);  // saturated
  if (a < f.maxval) {
    const auto [l, h] = neighbours(f, a);
    const double frac = (a - f.vals[l]) / (f.vals[h] - f.vals[l]);  // exact: the grid is uniform between l and h
    mag = double(rnd) < std::floor(std::ldexp(frac, 32)) ? h : l;
  }
  return with_sign(f, mag, std::signbit(v));
}

inline double decode(const Fmt& f, std::uint32_t code) {
  if (f.int8) return double(std::int8_t(std::uint8_t(code))) / 64.0;
  const std::uint32_t mag = code & ((1u << (f.bits - 1)) - 1u);
  const bool neg = (code >> (f.bits - 1)) & 1u;
  if (mag >= f.vals.size()) return NAN;
  return neg ? -f.vals[mag] : f.vals[mag];
}

// floor(log2(a)) for a > 0, exactly.
inline int floor_log2(double a) {
  int ex;
  std::frexp(a, &ex);
  return ex - 1;
}

// Collects mismatches and prints the first ten with their coordinates.
class Mismatches {
 public:
  explicit Mismatches(std::string what) : what_(std::move(what)) {}
  void add(const std::string& where) {
    if (count_ < 10) first_ += "  " + where + "\n";
    ++count_;
  }
  long count() const { return count_; }
  ~Mismatches() {
    EXPECT_EQ(count_, 0) << what_ << ": " << count_ << " mismatches; first ones:\n" << first_;
  }

 private:
  std::string what_, first_;
  long count_ = 0;
};

inline std::string hex(std::uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace oracle
