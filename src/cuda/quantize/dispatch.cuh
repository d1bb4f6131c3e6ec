#pragma once
// The one dispatch of quantize and QDQ: format, dtype, chunk width and the structural choices (scale
// rule family, rounding) become template parameters of block_kernel here and nowhere else.
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

// Launches block_kernel<QDQ> for problem p over dtype dt with the plan's chunk width on stream s. k
// holds the views; the vector flags of x and y are set here (they depend on the chunk width).
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
        const int cap = QDQ ? (p.stochastic ? 0 : 2) : (kFp8 ? 2 : 0);
        auto launch = [&](auto ch) {
          constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch)>;
          k.blocks = wave_grid<kernel>(fn, k.total, cap);
          kernel<<<k.blocks, kThreads, 0, s>>>(k);
        };
        if constexpr (C == fast_chunk<DT>()) dispatch_choices<Fmt>(p, launch);
        else launch(Choices<ScaleChoice::runtime, RoundChoice::runtime>{});
      });
    });
  });
  check_launch(fn, QDQ ? "qdq kernel" : "quantize kernel");
}

}  // namespace mxq::cuda
