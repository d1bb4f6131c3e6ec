// Scale layouts, the tensor amax and the thread count of the fast CPU path.
#include "cpu/common/reductions.hpp"
#include "cpu/common/vector_io.hpp"

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

namespace {
// The largest |x| bits of one row of bf16 or fp32 storage, in fp32 bit positions: the max of the
// magnitude bits themselves (for bf16 the high half of fp32's, an order-preserving shift).
template <DType DT>
MXQ_CLONES std::uint32_t row_amax_bits(const Storage<DT>* s, std::int64_t K) {
  // 256 elements at a time, with the source prefetched ahead (prefetch_ahead)
  if constexpr (DT == DType::bf16) {
    std::uint16_t m = 0;
    for (std::int64_t k0 = 0; k0 < K; k0 += 256) {
      const std::int64_t k1 = std::min<std::int64_t>(K, k0 + 256);
      prefetch_ahead(s + k0, int(k1 - k0));
      for (std::int64_t k = k0; k < k1; ++k) m = std::max<std::uint16_t>(m, s[k] & 0x7FFFu);
    }
    return std::uint32_t(m) << 16;
  } else {
    std::uint32_t m = 0;
    for (std::int64_t k0 = 0; k0 < K; k0 += 256) {
      const std::int64_t k1 = std::min<std::int64_t>(K, k0 + 256);
      prefetch_ahead(s + k0, int(k1 - k0));
      for (std::int64_t k = k0; k < k1; ++k) m = std::max<std::uint32_t>(m, s[k] & 0x7FFFFFFFu);
    }
    return m;
  }
}
}  // namespace

float tensor_amax(const Tensor& x) {
  std::uint32_t m = 0;
  const std::int64_t K = x.cols;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) reduction(max : m)
#endif
  for (std::int64_t r = 0; r < x.rows; ++r) {
    const char* row = static_cast<const char*>(x.data) + r * x.stride() * dtype_size(x.dtype);
    if (x.dtype == DType::bf16) {
      m = std::max(m, row_amax_bits<DType::bf16>(reinterpret_cast<const Storage<DType::bf16>*>(row), K));
      continue;
    }
    if (x.dtype == DType::f32) {
      m = std::max(m, row_amax_bits<DType::f32>(reinterpret_cast<const Storage<DType::f32>*>(row), K));
      continue;
    }
    alignas(64) float xf[256];
    for (std::int64_t k0 = 0; k0 < K; k0 += 256) {
      load_block<DType::f16, 256>(x, r, k0, K, 256, xf);
      m = std::max(m, amax_bits<256>(xf, 256));
    }
  }
  // NaN bits compare above +Inf bits, so a NaN anywhere gives NaN, else an Inf gives Inf.
  return u2f(m);
}

}  // namespace mxq::cpu
