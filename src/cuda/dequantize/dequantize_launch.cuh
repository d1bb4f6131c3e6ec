#pragma once
// The host side the dequantize launches share (plain: dequantize_launch.cu; with a rotation:
// rotate/rotate_dequantize_launch.cu): the kernel parameters of a problem, and the dispatch to the
// kernel's compile-time format, output dtype and chunk size.
#include <optional>

#include "core/dispatch.hpp"
#include "cuda/common/launch.cuh"

namespace mxq::cuda {

struct DequantLaunch {
  Plan pl;
  Params k;
};

// Codes, scales and output of problem p; one thread per chunk (the rotated kernel's last warp has
// lanes past the end, which take part in the shuffles). plan: the launch's own plan (the matrix
// rotation's), else the problem's.
inline DequantLaunch dequant_launch(const core::Problem& p, const QuantizedIn& q, const Tensor& y, std::optional<Plan> plan = {}) {
  DequantLaunch l{plan ? *plan : make_plan(p, int(dtype_size(y.dtype)), y.stride() == p.K && dense_quantized(p, q.codes, q.scales, nullptr)), {}};
  Params& k = l.k;
  k = base_params(p, l.pl);
  k.codes = static_cast<std::uint8_t*>(q.codes.data);
  k.codes_stride = q.codes.stride();
  k.scales = static_cast<std::uint8_t*>(q.scales.data);
  k.scales_stride = q.scales.stride();
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.codes_vec = aligned(k.codes, k.codes_stride, p.fp4 ? l.pl.C / 2 : l.pl.C);
  k.blocks = unsigned(launch_blocks(p.fn, k.total));
  return l;
}

// launch(fmt, dt, cc): the format type, the output dtype and the chunk size as compile-time values,
// with k.y_vec set for that dtype and chunk.
template <class F>
void dispatch_dequant(const core::Problem& p, DType y_dtype, DequantLaunch& l, F&& launch) {
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    core::dispatch_dtype(y_dtype, [&](auto dt) {
      constexpr DType DT = decltype(dt)::value;
      dispatch_chunk<DT>(l.pl.C, [&](auto cc) {
        l.k.y_vec = aligned(l.k.y, l.k.y_stride, vec_align<DT, decltype(cc)::value>());
        launch(fmt, dt, cc);
      });
    });
  });
}

}  // namespace mxq::cuda
