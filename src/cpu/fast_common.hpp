#pragma once
// Shared by the fast CPU path's operations (src/cpu/{quantize,qdq,dequantize,layout}.cpp): tiling
// over OpenMP threads, block loads and stores, the MX block scale, the scalar-codec block quantizer.
//
// Work is split into tiles of (one row, up to kTileBlocks blocks) and spread over OpenMP threads;
// every tile is independent, so results do not depend on the thread count. Inside a block the MX
// round-to-nearest-even path is branch-free fp32/int32 code that the compiler vectorises (an AVX2
// clone is selected at run time where the CPU has it):
//   a = |x| * 2^-e                       exact, or an underflow far below the element grid
//   r = (a + C) - C, C = 1.5 * 2^(q+23)  RNE onto the grid of quantum 2^q (q from a's binade)
//   r = min(r, max_elem)                 saturation
// Stochastic rounding, NVFP4 and blocks holding NaN/Inf element codes use the shared scalar codec.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(MXQ_HAVE_OPENMP)
#include <omp.h>
#endif

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"
#include "cpu/fast.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

constexpr std::int64_t kTileBlocks = 64;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MXQ_CLONES
#endif
#define MXQ_INLINE [[gnu::always_inline]] inline

template <class F>
void parallel_tiles(std::int64_t rows, std::int64_t nblocks, F&& f) {
  const std::int64_t per_row = (nblocks + kTileBlocks - 1) / kTileBlocks;
  const std::int64_t n = rows * per_row;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (n > 1)
#endif
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t r = t / per_row, b0 = (t % per_row) * kTileBlocks;
    f(r, b0, std::min(nblocks, b0 + kTileBlocks));
  }
}

// ---- loads and stores ----------------------------------------------------------------------------------
// G is the group size when known at compile time (0: use g). DT is the input dtype.
template <DType DT, int G>
MXQ_INLINE void load_block(const Tensor& x, std::int64_t r, std::int64_t k0, std::int64_t K, int g_rt, float* xf) {
  const int g = G ? G : g_rt;
  const std::int64_t n = std::min<std::int64_t>(g, K - k0);
  const std::int64_t base = r * x.stride() + k0;
  if constexpr (DT == DType::bf16) {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = bf16_to_f32(s[i]);
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? bf16_to_f32(s[i]) : 0.0f;
  } else if constexpr (DT == DType::f32) {
    const float* s = static_cast<const float*>(x.data) + base;
    if (n == g)
      for (int i = 0; i < g; ++i) xf[i] = s[i];
    else
      for (int i = 0; i < g; ++i) xf[i] = i < n ? s[i] : 0.0f;
  } else {
    const std::uint16_t* s = static_cast<const std::uint16_t*>(x.data) + base;
    for (int i = 0; i < g; ++i) xf[i] = i < n ? f16_to_f32(s[i]) : 0.0f;
  }
}

// Max of |x| as bits: >= 0x7F800000 means the block holds a NaN or Inf.
template <int G = 0>
MXQ_INLINE std::uint32_t amax_bits(const float* xf, int g_rt) {
  const int g = G ? G : g_rt;
  std::uint32_t m = 0;
  for (int i = 0; i < g; ++i) m = std::max(m, f2u(xf[i]) & 0x7FFFFFFFu);
  return m;
}

template <DType OUT>
MXQ_INLINE void store_out(void* row, std::int64_t k0, std::int64_t n, const std::uint32_t* bits) {
  if constexpr (OUT == DType::f32) {
    std::memcpy(static_cast<std::uint32_t*>(row) + k0, bits, n * 4);
  } else {
    std::uint16_t* d = static_cast<std::uint16_t*>(row) + k0;
    for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<std::uint16_t>(bits[i]);
  }
}

MXQ_INLINE void* row_ptr(const Tensor& t, std::int64_t r) {
  return static_cast<char*>(t.data) + r * t.stride() * dtype_size(t.dtype);
}

// ---- the MX block scale -----------------------------------------------------------------------------------
// Returns the scale exponent, or 128 for a non-finite block. Applies the abs_max pre-multiplier.
template <int G>
MXQ_INLINE int mx_block_exp(const Problem& p, float* xf) {
  const std::uint32_t am = amax_bits<G>(xf, p.g);
  if (am >= 0x7F800000u) return 128;
  int e = -127;
  if (am != 0) {
    const float q = p.opt.rule == ScaleRule::quest ? quest_arg(xf, p.g) : 0.0f;
    e = mx_scale_exp(p.opt.rule, u2f(am), q, p.elem);
  }
  if (p.opt.rule == ScaleRule::qutlass_absmax)
    for (int i = 0; i < p.g; ++i) xf[i] = 3.0f * xf[i];
  return e;
}

// Scalar-codec block quantizer (stochastic rounding, NVFP4): exactly the reference's arithmetic.
MXQ_INLINE void quantize_block_scalar(const Problem& p, std::int64_t r, std::int64_t b, float* xf, std::uint32_t* codes,
                                      std::uint8_t& scale_byte, std::uint32_t* keep) {
  const int g = p.g;
  const std::uint32_t am = amax_bits<0>(xf, g);
  if (am >= 0x7F800000u) {
    scale_byte = p.nvfp4() ? kE4M3NaN : kE8M0NaN;
    for (int i = 0; i < g; ++i) codes[i] = keep[i] = 0;
    return;
  }
  const std::int64_t j0 = p.opt.offset + r * p.K + b * g;
  if (p.nvfp4()) {
    const std::uint32_t sc = nvfp4_block_scale_code(u2f(am), p.S);
    const float m = nvfp4_multiplier(sc, p.S);
    scale_byte = static_cast<std::uint8_t>(sc);
    for (int i = 0; i < g; ++i) {
      const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, j0 + i, p.sr_bits) : 0u;
      codes[i] = nvfp4_encode(f2u(xf[i]), m, p.stochastic, rnd);
      keep[i] = std::fabs(xf[i] * m) < 6.0f;
    }
    return;
  }
  const int e = mx_block_exp<0>(p, xf);
  scale_byte = static_cast<std::uint8_t>(e + kE8M0Bias);
  const float inv = pow2f(-e), maxv = u2f(max_value_bits(p.elem));
  for (int i = 0; i < g; ++i) {
    const std::uint32_t rnd = p.stochastic ? sr_bits(p.opt.seed, j0 + i, p.sr_bits) : 0u;
    codes[i] = encode_scaled(f2u(xf[i]), e, p.elem, p.stochastic, rnd);
    keep[i] = std::fabs(xf[i]) * inv < maxv;
  }
}

// ---- dispatch: runtime enums -> template parameters ------------------------------------------------------------

// Group size 32 (every MX format's default) is compiled with a constant trip count; others run the
// same code with a runtime count.
template <class F>
void dispatch_group(int g, F&& f) {
  if (g == 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 0>{});
}

}  // namespace
}  // namespace mxq::cpu
