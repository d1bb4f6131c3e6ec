#pragma once
// The frame of the fast CPU path: tiles over OpenMP threads, the instruction sets a path may take
// (compile-time clones, run-time CPU checks and the environment switches the tests use), and the one
// turn of a runtime group size into a template parameter.
//
// Work is split into tiles of (one row, up to kTileBlocks blocks) and spread over OpenMP threads;
// every tile is independent, so results do not depend on the thread count.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(MXQ_HAVE_OPENMP)
#include <omp.h>
#endif

#include <mxq/fp_env.hpp>

#include "core/dispatch.hpp"
#include "core/fastmath.hpp"
#include "cpu/fast.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

constexpr std::int64_t kTileBlocks = 64;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MXQ_CLONES
#endif
#define MXQ_INLINE [[gnu::always_inline]] inline

// AVX2 intrinsics paths (x86 with GCC), each taken where the CPU has AVX2 (cpu_has_avx2), with a
// portable fallback beside it: NVFP4 quantize / QDQ / dequantize, quest's block statistics, Philox.
// MXQ_CPU_NO_AVX2=1 in the environment (read once) takes the fallbacks on an AVX2 CPU too: the tests
// run the CPU suites that way (tests/CMakeLists.txt, portable_*), so both paths are held to the bytes.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MXQ_CPU_AVX2 1
inline bool cpu_has_avx2() {
  static const bool has = [] {
    const char* off = std::getenv("MXQ_CPU_NO_AVX2");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    return static_cast<bool>(__builtin_cpu_supports("avx2"));
  }();
  return has;
}
// AVX-512F (Philox's 64-bit-lane form, philox8_avx512), where the CPU has it and the AVX2 paths are on;
// MXQ_CPU_NO_AVX512=1 takes the AVX2 form instead (fastmath_test compares the forms directly).
inline bool cpu_has_avx512() {
  static const bool has = [] {
    const char* off = std::getenv("MXQ_CPU_NO_AVX512");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    return cpu_has_avx2() && static_cast<bool>(__builtin_cpu_supports("avx512f"));
  }();
  return has;
}
#endif

template <class F>
void parallel_tiles(std::int64_t rows, std::int64_t nblocks, F&& f) {
  const std::int64_t per_row = (nblocks + kTileBlocks - 1) / kTileBlocks;
  const std::int64_t n = rows * per_row;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (n > 1)
#endif
  for (std::int64_t t = 0; t < n; ++t) {
    const IeeeSubnormalScope ieee;  // on the worker thread too (mxq/fp_env.hpp)
    const std::int64_t r = t / per_row, b0 = (t % per_row) * kTileBlocks;
    f(r, b0, std::min(nblocks, b0 + kTileBlocks));
  }
}

// ---- dispatch: runtime group size -> template parameter ---------------------------------------------------
// Group size 32 (every MX format's default) and, for E2M1, 16 (NVFP4's) are compiled with a constant
// trip count; others run the same code with a runtime count.
template <ElemType ET, class F>
void dispatch_group(int g, F&& f) {
  if (g == 32) return f(std::integral_constant<int, 32>{});
  if constexpr (ET == ElemType::e2m1)
    if (g == 16) return f(std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 0>{});
}

}  // namespace
}  // namespace mxq::cpu
