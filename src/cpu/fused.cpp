// The fused producer ops on the CPU: the arithmetic of core/fused_math.hpp, rows in parallel.
#include "cpu/fused.hpp"

#include <array>
#include <cstring>

#include <mxq/fp_env.hpp>

#include "core/dispatch.hpp"
#include "core/fused_math.hpp"

namespace mxq::cpu {
namespace {

using core::Storage;

template <DType DT>
float load(const Tensor& t, std::int64_t r, std::int64_t c) {
  const auto* p = static_cast<const Storage<DT>*>(t.data) + r * t.stride() + c;
  if constexpr (DT == DType::f32) return core::u2f(*p);
  else return core::dtype_bits_to_f32(*p, DT);
}
template <DType DT>
void store(const Tensor& t, std::int64_t r, std::int64_t c, float v) {
  static_cast<Storage<DT>*>(t.data)[r * t.stride() + c] = static_cast<Storage<DT>>(core::round_to_dtype_bits(v, DT));
}

template <class F>
void for_rows(std::int64_t rows, F&& f) {
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (rows > 1)
#endif
  for (std::int64_t r = 0; r < rows; ++r) {
    const IeeeSubnormalScope ieee;  // on the worker thread too (mxq/fp_env.hpp)
    f(r);
  }
}

// The sum of squares of row r in core/fused_math.hpp's order (the CUDA block's, replayed).
template <DType DT>
float sum_of_squares(const Tensor& x, std::int64_t r) {
  using core::add_rn;
  constexpr int L = core::kNormLanes, C = core::kNormChunk;
  std::array<float, L> lane{};
  const std::int64_t K = x.cols, cpr = (K + C - 1) / C;
  for (std::int64_t c = 0; c < cpr; ++c) {
    float& acc = lane[c % L];
    for (std::int64_t k = c * C; k < K && k < (c + 1) * C; ++k) {
      const float v = load<DT>(x, r, k);
      acc = add_rn(acc, core::mul_rn(v, v));
    }
  }
  auto butterfly = [](float* v, int n, int top) {
    for (int s = top; s >= 1; s >>= 1) {
      float t[32];
      for (int i = 0; i < n; ++i) t[i] = add_rn(v[i], v[i ^ s]);
      std::memcpy(v, t, sizeof(float) * n);
    }
  };
  std::array<float, L / 32> warp{};
  for (int w = 0; w < L / 32; ++w) {
    butterfly(lane.data() + 32 * w, 32, 16);
    warp[w] = lane[32 * w];
  }
  butterfly(warp.data(), L / 32, L / 64);
  return warp[0];
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y) {
  core::dispatch_dtype(x.dtype, [&](auto dt) {
    constexpr DType DT = decltype(dt)::value;
    for_rows(x.rows, [&](std::int64_t r) {
      const float inv = core::rms_inverse(sum_of_squares<DT>(x, r), x.cols, eps);
      for (std::int64_t k = 0; k < x.cols; ++k)
        store<DT>(y, r, k, core::rms_norm_element(load<DT>(x, r, k), load<DT>(weight, 0, k), inv, DT));
    });
  });
}

void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y) {
  core::dispatch_dtype(gate.dtype, [&](auto dt) {
    constexpr DType DT = decltype(dt)::value;
    for_rows(gate.rows, [&](std::int64_t r) {
      for (std::int64_t k = 0; k < gate.cols; ++k)
        store<DT>(y, r, k, core::silu_mul_element(load<DT>(gate, r, k), load<DT>(up, r, k), DT));
    });
  });
}

}  // namespace mxq::cpu
