// qdq on the CUDA backend: the launcher of block_kernel<QDQ = true>.
#include "cuda/backend.hpp"
#include "cuda/quantize/e5m3.hpp"
#include "cuda/layout/amax.hpp"
#include "cuda/quantize/dispatch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

void qdq(const core::Problem& p, const Tensor& x, const Tensor& y) {
  if (p.e5m3()) return qdq_e5m3(p, x, y);
  const cudaStream_t s = stream_of(p);
  const bool matrix = p.opt.rotation == Rotation::matrix;
  const Plan pl = matrix ? matrix_plan() : small_qdq_plan(p.fn, p, make_plan(p, int(dtype_size(x.dtype)), x.stride() == p.K && y.stride() == p.K));
  Params k = base_params(p, pl);
  k.x = static_cast<const std::uint8_t*>(x.data);
  k.x_stride = x.stride() * dtype_size(x.dtype);
  set_rotation(k, p.opt);
  const bool rot = k.rot_size > 0;
  k.fused_amax = !rot && fuses_amax(p, pl, x.dtype, k.x, k.x_stride);
  // The fused amax (launch_block_kernel) zeroes the accumulator itself where it needs it.
  if (!k.fused_amax && p.amax_acc) {
    if (matrix) enqueue_matrix_amax(p.fn, p.opt, x.dtype, k, p.amax_acc, s);
    else if (rot) enqueue_rotated_amax(p.fn, x.dtype, pl, k, p.amax_acc, s);
    else enqueue_amax(p.fn, x, p.amax_acc, s);
  }
  k.y = static_cast<std::uint8_t*>(y.data);
  k.y_stride = y.stride() * dtype_size(y.dtype);
  if (matrix) launch_matrix(true, p.fn, p, x.dtype, k, s);
  else if (rot) launch_rotated<true>(p.fn, p, x.dtype, pl, k, s);
  else launch_block_kernel<true>(p.fn, p, x.dtype, pl, k, s);
}

}  // namespace mxq::cuda
