#pragma once
// The dispatch of the rotated block_kernel launches (rotate_quantize_launch.cu, rotate_qdq_launch.cu).
// To bound the kernels compiled, only the most used choice (an amax rule, round to nearest even) is
// static, at the fast chunk width (and for QDQ at 8 too, small_qdq_plan's width); every other rule
// and rounding, and quantize's 8-element chunks of 2-byte dtypes, take the runtime choices.
#include "cuda/quantize/dispatch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

template <bool QDQ>
void launch_rotated(const char* fn, const core::Problem& p, DType dt, const Plan& pl, Params& k, cudaStream_t s) {
  dispatch_block(p, dt, pl, k, [&](auto fmt, auto dtc, auto cc) {
    using Fmt = decltype(fmt);
    constexpr DType DT = decltype(dtc)::value;
    constexpr int C = decltype(cc)::value;
    if constexpr (C >= 8) {
      // NOTE: blocks per SM from the occupancy (three at 16-element chunks). Measured on the H200
      // (2026-12-04, MXQ_CUDA_BLOCKS_PER_SM): the rotated QDQ ran 2-3% faster at three blocks than
      // at the two the plain QDQ takes (MXFP4 had128 8192^2: 109.3 against 112.9 us), four the same.
      const int cap = blocks_per_sm_override() > 0 ? blocks_per_sm_override() : 0;
      auto launch = [&](auto ch) {
        constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch), false, true>;
        k.blocks = wave_grid<kernel>(fn, k.total, cap);
        kernel<<<k.blocks, kThreads, 0, s>>>(k);
      };
      // QDQ also at 8-element chunks of 2-byte dtypes: the width small launches take (small_qdq_plan).
      if constexpr (C == fast_chunk<DT>() || (QDQ && C == 8))
        if (!p.stochastic && scale_choice(p.opt.rule) == ScaleChoice::amax) return launch(Choices<ScaleChoice::amax, RoundChoice::rne>{});
      launch(Choices<ScaleChoice::runtime, RoundChoice::runtime>{});
    } else {
      throw Error(Error::Code::internal, std::string(fn) + ": a rotated launch with chunks of 2 (groups of 2 or 4)");
    }
  });
  check_launch(fn, QDQ ? "rotated qdq kernel" : "rotated quantize kernel");
}

}  // namespace mxq::cuda
