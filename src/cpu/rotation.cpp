#include "cpu/rotation.hpp"

#include <cstring>
#include <vector>

#include "core/problem.hpp"
#include "core/rotation.hpp"

namespace mxq::cpu {

void rotate_rows(const Tensor& x, float* out, const QuantOptions& opt, bool inverse) {
  const std::int64_t K = x.cols;
  const int rs = opt.rotation_size;
  const core::RotationSigns signs = core::rotation_signs(opt.rotation_seed);
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (x.rows > 1)
#endif
  for (std::int64_t r = 0; r < x.rows; ++r) {
    float v[256];
    for (std::int64_t k0 = 0; k0 < K; k0 += rs) {
      for (int i = 0; i < rs; ++i) v[i] = core::load_f32(x, r, k0 + i);
      core::rotate_group(v, rs, opt.rotation, signs, inverse);
      std::memcpy(out + r * K + k0, v, sizeof(float) * std::size_t(rs));
    }
  }
}

namespace {
// A NaN is stored as the dtype's canonical NaN (its payload and sign after the rotation's additions
// are the hardware's choice), as the CUDA backend does.
std::uint32_t store_value(float v, DType t) { return v != v ? core::nan_bits(t) : core::f32_to_dtype_bits(v, t); }
}  // namespace

void store_rows(const float* v, const Tensor& y) {
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (y.rows > 1)
#endif
  for (std::int64_t r = 0; r < y.rows; ++r)
    for (std::int64_t k = 0; k < y.cols; ++k)
      core::store_bits(y, r, k, store_value(v[r * y.cols + k], y.dtype));
}

}  // namespace mxq::cpu
