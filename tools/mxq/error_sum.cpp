// Error statistics on the host (error_sum.hpp): vectorised band sums, bands in parallel.
#include "error_sum.hpp"

#include <algorithm>
#include <exception>
#include <vector>

namespace mxq::cli {
namespace {

// ErrorSum of n elements of x (dtype T) against y, in 8 interleaved partial sums (a fixed order: the
// same figures every run; one dependent chain of double adds per element bounded the loop), written
// with GCC vector types (the compiler did not vectorise the scalar form), an AVX2 clone where the CPU
// has it. Non-finite lanes are masked out, counted in bad_in / bad_out.
using Vd = double __attribute__((vector_size(32)));
using Vl = long long __attribute__((vector_size(32)));
template <SrcType T>
__attribute__((target_clones("avx2", "default"))) ErrorSum band_sum(const std::uint8_t* x, const float* y, std::int64_t n) {
  constexpr int es = T == SrcType::f32 ? 4 : 2;
  Vd e[2] = {}, r[2] = {};
  Vl bad_in[2] = {}, bad_out[2] = {};
  for (std::int64_t i0 = 0; i0 < n; i0 += 8) {
    const int m = int(std::min<std::int64_t>(8, n - i0));  // past the end: zeros (finite, adding 0)
    for (int h = 0; h < 2; ++h) {
      Vd xv, yv;
      for (int l = 0; l < 4; ++l) {
        const int k = 4 * h + l;
        xv[l] = k < m ? double(load_f32(x + (i0 + k) * es, T)) : 0.0;
        yv[l] = k < m ? double(y[i0 + k]) : 0.0;
      }
      const Vl fx = (xv - xv) == 0.0, fy = (yv - yv) == 0.0, ok = fx & fy;  // x - x is 0 iff x is finite
      bad_in[h] -= ~fx;  // masks are -1 where true
      bad_out[h] -= fx & ~fy;
      const Vd xd = (Vd)((Vl)xv & ok), d = (Vd)((Vl)yv & ok) - xd;
      e[h] += d * d;
      r[h] += xd * xd;
    }
  }
  ErrorSum s;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 4; ++l) {
      s.e += e[h][l];
      s.r += r[h][l];
      s.bad_in += bad_in[h][l];
      s.bad_out += bad_out[h][l];
    }
  return s;
}

}  // namespace

ErrorSum error_sum(const std::uint8_t* xp, SrcType xty, int es, std::int64_t N, std::int64_t K, const BandFn& y_of) {
  if (N == 0 || K == 0) return {};
  const std::int64_t band = std::max<std::int64_t>(1, (std::int64_t(1) << 18) / K), nb = (N + band - 1) / band;
  std::vector<ErrorSum> part(static_cast<std::size_t>(nb));
  std::exception_ptr error;
#if defined(MXQ_TOOL_HAVE_OPENMP)
#pragma omp parallel if (nb > 1)
#endif
  {
    std::vector<float> y;
#if defined(MXQ_TOOL_HAVE_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (std::int64_t b = 0; b < nb; ++b) {
      try {
        const std::int64_t r0 = b * band, nr = std::min(band, N - r0);
        y.resize(std::size_t(band * K));
        y_of(r0, nr, y.data());
        const std::uint8_t* x = xp + r0 * K * es;
        part[std::size_t(b)] = xty == SrcType::bf16 ? band_sum<SrcType::bf16>(x, y.data(), nr * K)
                               : xty == SrcType::f16 ? band_sum<SrcType::f16>(x, y.data(), nr * K)
                                                     : band_sum<SrcType::f32>(x, y.data(), nr * K);
      } catch (...) {
#if defined(MXQ_TOOL_HAVE_OPENMP)
#pragma omp critical(mxq_error_sum)
#endif
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
  ErrorSum total;
  for (const ErrorSum& s : part) total.merge(s);
  return total;
}

}  // namespace mxq::cli
