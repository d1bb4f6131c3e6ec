#pragma once
// Error statistics of a conversion on the host: SQNR's sums over a weight and its converted values,
// in parallel bands of rows combined in a fixed order (the same figures on any number of threads).
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include <fmt/format.h>

#include "convert.hpp"
#include "gpu_stats.hpp"

namespace mxq::cli {

// Signal and error energy: SQNR = 10 log10(sum x^2 / sum (y - x)^2). A non-finite input, or a
// non-finite output of a finite input (the rest of a NaN block), makes the statistics "not finite":
// never a perfect score computed over what is left.
// The sums themselves are ErrorTotals' (the GPU engine's statistics come back as those).
struct ErrorSum : ErrorTotals {
  ErrorSum() = default;
  explicit ErrorSum(const ErrorTotals& t) : ErrorTotals(t) {}
  void add(float x, float y) {
    if (!std::isfinite(x)) {
      ++bad_in;
      return;
    }
    if (!std::isfinite(y)) {
      ++bad_out;
      return;
    }
    const double d = double(y) - x;
    e += d * d;
    r += double(x) * x;
  }
  void merge(const ErrorSum& o) {
    e += o.e;
    r += o.r;
    bad_in += o.bad_in;
    bad_out += o.bad_out;
  }
  bool finite() const { return bad_in == 0 && bad_out == 0; }
  double sqnr_db() const { return e == 0 ? INFINITY : 10 * std::log10(r / e); }
  std::string str() const {
    if (finite()) return fmt::format("SQNR {:.2f} dB", sqnr_db());
    return fmt::format("SQNR not finite ({} non-finite inputs, {} more non-finite outputs)", bad_in, bad_out);
  }
};


using BandFn = std::function<void(std::int64_t r0, std::int64_t nr, float* y)>;
// The statistics of a [N, K] weight x (dense rows, dtype xty of es bytes) against its conversion y:
// y_of(r0, nr, y) writes rows [r0, r0 + nr) of y as fp32 (a dequantize, or a load of the QDQ'd
// bytes). Bands of rows of about 2^18 elements run in parallel on the host's cores (a library call
// inside runs on its thread alone: OpenMP's nested regions have one thread); their sums are combined
// in band order, so the figures do not depend on the number of threads. Peak memory: one band of
// fp32 per thread. The first exception a band throws is rethrown here.
ErrorSum error_sum(const std::uint8_t* xp, SrcType xty, int es, std::int64_t N, std::int64_t K, const BandFn& y_of);

}  // namespace mxq::cli
