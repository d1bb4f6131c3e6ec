// dequantize on the CUDA backend: one thread per chunk, no staging (the codes are the small side).
#include "core/dispatch.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/launch.cuh"
#include "cuda/dequantize/dequantize_chunk.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y) {
  if (p.opt.rotation != Rotation::none) return dequantize_rotated(p, q, y);
  const cudaStream_t s = stream_of(p);
  const Plan pl = make_plan(p, int(dtype_size(y.dtype)), y.stride() == p.K && dense_quantized(p, q.codes, q.scales, nullptr));
  Params k = base_params(p, pl);
  k.codes = static_cast<std::uint8_t*>(q.codes.data);
  k.codes_stride = q.codes.stride();
  k.scales = static_cast<std::uint8_t*>(q.scales.data);
  k.scales_stride = q.scales.stride();
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  k.codes_vec = aligned(k.codes, k.codes_stride, p.fp4 ? pl.C / 2 : pl.C);
  k.blocks = unsigned(launch_blocks(p.fn, k.total));
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    using Fmt = decltype(fmt);
    core::dispatch_dtype(y.dtype, [&](auto dt) {
      constexpr DType DT = decltype(dt)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr int C = decltype(cc)::value;
        k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, C>());
        dequant_kernel<Fmt, DT, C><<<k.blocks, kThreads, 0, s>>>(k);
      });
    });
  });
  check_launch(p.fn, "dequantize kernel");
}

}  // namespace mxq::cuda
