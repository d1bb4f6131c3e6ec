#include "cpu/rotation.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"
#include "core/problem.hpp"
#include "core/rotation.hpp"

namespace mxq::cpu {

namespace {

// Row r of a DT view as fp32 (exact), K elements into v.
template <DType DT>
void load_row(const Tensor& x, std::int64_t r, float* v) {
  using S = core::Storage<DT>;
  const S* src = static_cast<const S*>(x.data) + r * x.stride();
  for (std::int64_t k = 0; k < x.cols; ++k) {
    if constexpr (DT == DType::f32) v[k] = core::u2f(src[k]);
    else if constexpr (DT == DType::bf16) v[k] = bf16_to_f32(src[k]);
    else v[k] = f16_to_f32(src[k]);
  }
}

// fp32 values -> a DT row, rounded as the library rounds outputs (RNE, saturating finite values,
// infinities kept), a NaN as the dtype's canonical NaN (its payload and sign after the rotation's
// additions are the hardware's choice), as the CUDA backend does. to_dtype_bits_nonnan equals
// f32_to_dtype_bits off NaN (fastmath_test, FastOutput).
template <DType DT>
void store_row(const float* v, const Tensor& y, std::int64_t r) {
  using S = core::Storage<DT>;
  S* dst = static_cast<S*>(y.data) + r * y.stride();
  for (std::int64_t k = 0; k < y.cols; ++k)
    dst[k] = static_cast<S>(v[k] != v[k] ? core::nan_bits(DT) : core::to_dtype_bits_nonnan<DT>(v[k]));
}

}  // namespace

void rotate_rows(const Tensor& x, float* out, const QuantOptions& opt, bool inverse) {
  const std::int64_t K = x.cols;
  const int rs = opt.rotation_size;
  const core::RotationSigns signs = core::rotation_signs(opt.rotation_seed);
  core::dispatch_dtype(x.dtype, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (x.rows > 1)
#endif
    for (std::int64_t r = 0; r < x.rows; ++r) {
      float* row = out + r * K;
      // out may be x's own dense fp32 data (then the row is already there)
      const void* src = static_cast<const std::uint8_t*>(x.data) + r * x.stride() * core::dtype_size(DT);
      if (DT != DType::f32 || static_cast<const void*>(row) != src) load_row<DT>(x, r, row);
      for (std::int64_t k0 = 0; k0 < K; k0 += rs) core::rotate_group(row + k0, rs, opt.rotation, signs, inverse);
    }
  });
}

float rotated_amax(const Tensor& x, const QuantOptions& opt) {
  const std::int64_t K = x.cols;
  const int rs = opt.rotation_size;
  const core::RotationSigns signs = core::rotation_signs(opt.rotation_seed);
  std::uint32_t m = 0;
  core::dispatch_dtype(x.dtype, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel reduction(max : m) if (x.rows > 1)
#endif
    {
      std::vector<float> row(static_cast<std::size_t>(K));  // one row per thread, not the tensor
#if defined(MXQ_HAVE_OPENMP)
#pragma omp for schedule(static)
#endif
      for (std::int64_t r = 0; r < x.rows; ++r) {
        load_row<DT>(x, r, row.data());
        for (std::int64_t k0 = 0; k0 < K; k0 += rs) core::rotate_group(row.data() + k0, rs, opt.rotation, signs, false);
        for (float v : row) m = std::max(m, core::f2u(v) & 0x7FFFFFFFu);
      }
    }
  });
  // NaN bits compare above +Inf bits, so a NaN anywhere gives NaN, else an Inf gives Inf (as tensor_amax).
  return core::u2f(m);
}

void store_rows(const float* v, const Tensor& y) {
  core::dispatch_dtype(y.dtype, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (y.rows > 1)
#endif
    for (std::int64_t r = 0; r < y.rows; ++r) store_row<DT>(v + r * y.cols, y, r);
  });
}

}  // namespace mxq::cpu
