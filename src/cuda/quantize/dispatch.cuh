#pragma once
// The one dispatch of quantize and QDQ: format, dtype, chunk width and the structural choices (scale
// rule family, rounding) become template parameters of block_kernel here and nowhere else.
#include <cstdlib>

#include "core/dispatch.hpp"
#include "core/format_traits.hpp"
#include "cuda/common/launch.cuh"
#include "cuda/quantize/block_kernel.cuh"

namespace mxq::cuda {

// f(Choices<...>{}) for the problem's rule and rounding. Only the combinations a format accepts are
// compiled (qutlass_absmax is MXFP4-only; NVFP4 has one scale rule).
template <class Fmt, class F>
void dispatch_choices(const core::Problem& p, F&& f) {
  auto by_round = [&](auto sc) {
    constexpr ScaleChoice SC = decltype(sc)::value;
    if (p.stochastic) f(Choices<SC, RoundChoice::stochastic>{});
    else f(Choices<SC, RoundChoice::rne>{});
  };
  if constexpr (Fmt::nvfp4) {
    by_round(std::integral_constant<ScaleChoice, ScaleChoice::amax>{});
  } else {
    switch (scale_choice(p.opt.rule)) {
      case ScaleChoice::quest: return by_round(std::integral_constant<ScaleChoice, ScaleChoice::quest>{});
      case ScaleChoice::absmax:
        if constexpr (Fmt::format == Format::mxfp4) return by_round(std::integral_constant<ScaleChoice, ScaleChoice::absmax>{});
        break;  // refused by validation for other formats
      default: return by_round(std::integral_constant<ScaleChoice, ScaleChoice::amax>{});
    }
  }
}

// Whether block_kernel reduces the NVFP4 tensor amax itself (one cooperative launch) rather than an
// amax kernel before it: a flat launch at the fast chunk width with a 16-byte aligned x.
inline bool fuses_amax(const core::Problem& p, const Plan& pl, DType dt, const void* x, i64 x_stride_bytes) {
  return p.amax_acc && pl.flat && pl.C == (dt == DType::f32 ? 8 : 16) && aligned(x, x_stride_bytes, 16);
}

// MXQ_CUDA_BLOCKS_PER_SM=N (a tuning experiment, not for production): every block_kernel launch at
// most N blocks per SM instead of the measured defaults below.
inline int blocks_per_sm_override() {
  static const int n = [] {
    const char* v = std::getenv("MXQ_CUDA_BLOCKS_PER_SM");
    return v && *v ? std::atoi(v) : 0;
  }();
  return n;
}

// Launches block_kernel<QDQ> for problem p over dtype dt with the plan's chunk width on stream s. k
// holds the views; the vector flags of x and y are set here (they depend on the chunk width).
// With k.fused_amax (see fuses_amax) the kernel reduces the tensor amax itself.
// Blocks per SM: QDQ with RNE and the FP8 quantize at most 2 (wave_grid's NOTE), else the occupancy.
template <bool QDQ>
void launch_block_kernel(const char* fn, const core::Problem& p, DType dt, const Plan& pl, Params& k, cudaStream_t s) {
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    using Fmt = decltype(fmt);
    core::dispatch_dtype(dt, [&](auto dtc) {
      constexpr DType DT = decltype(dtc)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr int C = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, C>());
        if (k.y) k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, C>());
        constexpr bool kFp8 = Fmt::elem == ElemType::e4m3 || Fmt::elem == ElemType::e5m2;
        const int cap = blocks_per_sm_override() > 0 ? blocks_per_sm_override() : QDQ ? (p.stochastic ? 0 : 2) : (kFp8 ? 2 : 0);
        auto launch = [&](auto ch) {
          constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch)>;
          k.blocks = wave_grid<kernel>(fn, k.total, cap);
          kernel<<<k.blocks, kThreads, 0, s>>>(k);
        };
        if constexpr (C == fast_chunk<DT>()) {
          if constexpr (Fmt::nvfp4) {
            if (k.fused_amax) {
              // One cooperative launch (its grid-wide barrier needs every block resident: wave_grid's
              // grid is at most the resident blocks).
              return dispatch_choices<Fmt>(p, [&](auto ch) {
                constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch), true>;
                k.blocks = wave_grid<kernel>(fn, k.total, cap);
                // NOTE: three quarters of the L2 for the lines the second pass reads first; the
                // rest of it takes the streaming reads and the outputs.
                k.l2_keep_iters = i64(l2_bytes(fn)) * 3 / 4 / (i64(k.blocks) * kThreads * vec_bytes<DT, C>());
                cudaLaunchConfig_t cfg{};
                cfg.gridDim = dim3(k.blocks);
                cfg.blockDim = dim3(kThreads);
                cfg.stream = s;
                cudaLaunchAttribute attr{};
                attr.id = cudaLaunchAttributeCooperative;
                attr.val.cooperative = 1;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                check(cudaLaunchKernelEx(&cfg, kernel, k), fn, "cooperative launch of the fused-amax kernel");
              });
            }
          }
          dispatch_choices<Fmt>(p, launch);
        } else {
          launch(Choices<ScaleChoice::runtime, RoundChoice::runtime>{});
        }
      });
    });
  });
  check_launch(fn, QDQ ? "qdq kernel" : "quantize kernel");
}

}  // namespace mxq::cuda
