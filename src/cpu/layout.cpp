// Scale layouts, the tensor amax and the thread count of the fast CPU path.
#include "cpu/fast_common.hpp"

namespace mxq::cpu {

int max_threads() {
#if defined(MXQ_HAVE_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void swizzle_scales(const Tensor& linear, const Tensor& swizzled) {
  std::uint8_t* d = static_cast<std::uint8_t*>(swizzled.data);
  const std::uint8_t* s = static_cast<const std::uint8_t*>(linear.data);
  const std::int64_t R = swizzled.rows, C = swizzled.cols;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (R > 512)
#endif
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c)
      d[swizzled_offset(r, c, C)] = (r < linear.rows && c < linear.cols) ? s[r * linear.stride() + c] : 0;
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear) {
  const std::uint8_t* s = static_cast<const std::uint8_t*>(swizzled.data);
  std::uint8_t* d = static_cast<std::uint8_t*>(linear.data);
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (linear.rows > 512)
#endif
  for (std::int64_t r = 0; r < linear.rows; ++r)
    for (std::int64_t c = 0; c < linear.cols; ++c) d[r * linear.stride() + c] = s[swizzled_offset(r, c, swizzled.cols)];
}

float tensor_amax(const Tensor& x) {
  std::uint32_t m = 0;
  const std::int64_t K = x.cols;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) reduction(max : m)
#endif
  for (std::int64_t r = 0; r < x.rows; ++r) {
    alignas(64) float xf[256];
    for (std::int64_t k0 = 0; k0 < K; k0 += 256) {
      if (x.dtype == DType::bf16) load_block<DType::bf16, 256>(x, r, k0, K, 256, xf);
      else if (x.dtype == DType::f32) load_block<DType::f32, 256>(x, r, k0, K, 256, xf);
      else load_block<DType::f16, 256>(x, r, k0, K, 256, xf);
      m = std::max(m, amax_bits<256>(xf, 256));
    }
  }
  // NaN bits compare above +Inf bits, so a NaN anywhere gives NaN, else an Inf gives Inf.
  return u2f(m);
}

}  // namespace mxq::cpu
