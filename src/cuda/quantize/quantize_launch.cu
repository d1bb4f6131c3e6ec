// quantize on the CUDA backend: the launcher of block_kernel<QDQ = false>.
#include "cuda/backend.hpp"
#include "cuda/quantize/e5m3.hpp"
#include "cuda/layout/amax.hpp"
#include "cuda/quantize/dispatch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

void quantize(const core::Problem& p, const Tensor& x, const QuantizedOut& out) {
  if (p.e5m3()) return quantize_e5m3(p, x, out);
  const char* fn = p.fn;
  const cudaStream_t s = stream_of(p);
  const bool matrix = p.opt.rotation == Rotation::matrix;
  const Plan pl = matrix ? matrix_plan() : make_plan(p, int(dtype_size(x.dtype)), x.stride() == p.K && dense_quantized(p, out.codes, out.scales, &out.clip_mask));
  Params k = base_params(p, pl);
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  set_rotation(k, p.opt);
  const bool rot = k.rot_size > 0;
  k.fused_amax = !rot && fuses_amax(p, pl, x.dtype, k.x, k.x_stride);
  // The fused amax (launch_block_kernel) zeroes the accumulator itself where it needs it.
  if (!k.fused_amax && p.amax_acc) {
    if (matrix) enqueue_matrix_amax(fn, p.opt, x.dtype, k, p.amax_acc, s);
    else if (rot) enqueue_rotated_amax(fn, x.dtype, pl, k, p.amax_acc, s);
    else enqueue_amax(fn, x, p.amax_acc, s);
  }
  k.codes = static_cast<std::uint8_t*>(out.codes.data);
  k.codes_stride = out.codes.stride();
  k.scales = static_cast<std::uint8_t*>(out.scales.data);
  k.scales_stride = out.scales.stride();
  k.mask = static_cast<std::uint8_t*>(out.clip_mask.data);
  k.mask_stride = out.clip_mask.stride();
  k.codes_vec = aligned(k.codes, k.codes_stride, p.fp4 ? pl.C / 2 : pl.C);
  if (k.swizzled && (p.scale_rows_padded != p.rows || p.scale_cols_padded != p.nblocks))
    check(cudaMemsetAsync(k.scales, 0, p.scale_rows_padded * p.scale_cols_padded, s), fn, "zeroing swizzle padding");
  if (matrix) launch_matrix(false, fn, p, x.dtype, k, s);
  else if (rot) launch_rotated<false>(fn, p, x.dtype, pl, k, s);
  else launch_block_kernel<false>(fn, p, x.dtype, pl, k, s);
  // The amax -> S after the kernel read it (in place when the output is the accumulator), or S given.
  if (out.tensor_scale) enqueue_tensor_scale(fn, out.tensor_scale, p.amax_acc, p.S, s);
}

void write_empty(const core::Problem& p, const QuantizedOut& out) {
  const cudaStream_t s = stream_of(p);
  const i64 n = p.scale_rows_padded * p.scale_cols_padded;
  if (p.opt.scale_layout == ScaleLayout::swizzled && n > 0)
    check(cudaMemsetAsync(out.scales.data, 0, n, s), p.fn, "zeroing swizzle padding");
  if (out.tensor_scale) enqueue_tensor_scale(p.fn, out.tensor_scale, nullptr, p.S, s);
}

}  // namespace mxq::cuda
