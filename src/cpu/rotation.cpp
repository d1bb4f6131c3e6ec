#include "cpu/rotation.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include <mxq/fp_env.hpp>

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

// The rotation of a row's groups: the Hadamard modes through core::rotate_group, a matrix R (or its
// inverse) as v @ M per group: y_j = RN32(sum_i double(v_i) * double(M_ij)), i ascending (each
// product exact in double), the documented order of every backend that supports it.
class GroupRotation {
 public:
  GroupRotation(const QuantOptions& opt, bool inverse)
      : opt_(opt), inverse_(inverse), signs_(core::rotation_signs(opt.rotation_seed)) {
    if (opt.rotation != Rotation::matrix) return;
    const Tensor& m = inverse ? opt.rotation_inverse : opt.rotation_matrix;
    const int rs = opt.rotation_size;
    m_.resize(std::size_t(rs) * rs);
    for (std::size_t i = 0; i < m_.size(); ++i)
      m_[i] = m.dtype == DType::f32 ? double(static_cast<const float*>(m.data)[i])
                                    : double(bf16_to_f32(static_cast<const std::uint16_t*>(m.data)[i]));
  }
  // Every group of a row of K elements, in place; tmp: rotation_size floats of scratch.
  void row(float* v, std::int64_t K, float* tmp) const {
    const int rs = opt_.rotation_size;
    for (std::int64_t k0 = 0; k0 < K; k0 += rs) {
      float* g = v + k0;
      if (m_.empty()) {
        core::rotate_group(g, rs, opt_.rotation, signs_, inverse_);
        continue;
      }
      for (int j = 0; j < rs; ++j) {
        double acc = 0.0;
        for (int i = 0; i < rs; ++i) acc += double(g[i]) * m_[std::size_t(i) * rs + j];
        tmp[j] = float(acc);  // RN (the default rounding mode)
      }
      std::memcpy(g, tmp, sizeof(float) * std::size_t(rs));
    }
  }

 private:
  const QuantOptions& opt_;
  bool inverse_;
  core::RotationSigns signs_;
  std::vector<double> m_;  // the matrix as double (exact from f32 or bf16), row-major
};

}  // namespace

void rotate_rows(const Tensor& x, float* out, const QuantOptions& opt, bool inverse) {
  const std::int64_t K = x.cols;
  const GroupRotation rot(opt, inverse);
  core::dispatch_dtype(x.dtype, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (x.rows > 1)
#endif
    for (std::int64_t r = 0; r < x.rows; ++r) {
      const IeeeSubnormalScope ieee;  // on the worker thread too (mxq/fp_env.hpp)
      float* row = out + r * K;
      float tmp[256];
      // out may be x's own dense fp32 data (then the row is already there)
      const void* src = static_cast<const std::uint8_t*>(x.data) + r * x.stride() * core::dtype_size(DT);
      if (DT != DType::f32 || static_cast<const void*>(row) != src) load_row<DT>(x, r, row);
      rot.row(row, K, tmp);
    }
  });
}

float rotated_amax(const Tensor& x, const QuantOptions& opt) {
  const std::int64_t K = x.cols;
  const GroupRotation rot(opt, false);
  std::uint32_t m = 0;
  core::dispatch_dtype(x.dtype, [&](auto dtc) {
    constexpr DType DT = decltype(dtc)::value;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel reduction(max : m) if (x.rows > 1)
#endif
    {
      const IeeeSubnormalScope ieee;  // on the worker thread too (mxq/fp_env.hpp)
      std::vector<float> row(static_cast<std::size_t>(K));  // one row per thread, not the tensor
      float tmp[256];
#if defined(MXQ_HAVE_OPENMP)
#pragma omp for schedule(static)
#endif
      for (std::int64_t r = 0; r < x.rows; ++r) {
        load_row<DT>(x, r, row.data());
        rot.row(row.data(), K, tmp);
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
    for (std::int64_t r = 0; r < y.rows; ++r) {
      const IeeeSubnormalScope ieee;  // on the worker thread too (mxq/fp_env.hpp)
      store_row<DT>(v + r * y.cols, y, r);
    }
  });
}

}  // namespace mxq::cpu
