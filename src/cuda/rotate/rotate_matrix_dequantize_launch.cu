// dequantize with a rotation by a runtime matrix (decode to fp32, rotate by R^-1 on the FP64 tensor
// cores, round once to the output dtype), and the tensor amax of a matrix-rotated tensor (NVFP4's
// computed tensor scale): cuda/rotate/matrix.cuh.
#include "core/dispatch.hpp"
#include "cuda/common/rotation.cuh"
#include "cuda/dequantize/dequantize_chunk.cuh"
#include "cuda/dequantize/dequantize_launch.cuh"
#include "cuda/rotate/matrix_launch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {
namespace {

// The output's dtype is m.dt (a warp-uniform choice at each store).
template <class Fmt>
__global__ void __launch_bounds__(kMatrixThreads) matrix_dequant_kernel(const Params p, const MatrixArgs m) {
  matrix_tiles(
      p, m,
      [&](const Coord& c, u32 (&v)[kMatrixChunk]) {
        if (c.active && c.k0 < p.K) {
          dequant_f32<Fmt, kMatrixChunk>(p, c, v);
        } else {
#pragma unroll
          for (int e = 0; e < kMatrixChunk; ++e) v[e] = 0;
        }
      },
      [&](const Coord& c, const u32 (&y)[kMatrixChunk]) {
        if (!c.active || c.k0 >= p.K) return;
        if (m.dt == DType::bf16) store_rounded_chunk<DType::bf16, kMatrixChunk>(p, c, y);
        else if (m.dt == DType::f16) store_rounded_chunk<DType::f16, kMatrixChunk>(p, c, y);
        else store_rounded_chunk<DType::f32, kMatrixChunk>(p, c, y);
      });
}

// max |x R| (fp32 bits) atomicMax'ed into *m.acc, one atomic per warp. BW: 0, the exact product; 4 or
// 8, the bf16 product in blocks of BW warps.
template <int BW>
__global__ void __launch_bounds__(BW ? 32 * BW : kMatrixThreads, BW == 8 ? 2 : 0) matrix_amax_kernel(const Params p, const MatrixArgs m) {
  u32 am = 0;
  const auto finish = [&](const Coord&, const u32 (&y)[kMatrixChunk]) {
#pragma unroll
    for (int e = 0; e < kMatrixChunk; ++e) am = umax(am, y[e] & 0x7FFFFFFFu);
  };
  if constexpr (BW != 0) matrix_tiles_bf16<BW>(p, m, finish);
  else matrix_tiles(p, m, [&](const Coord& c, u32 (&v)[kMatrixChunk]) { matrix_load(p, m, c, v); }, finish);
  am = warp_max(am);
  if ((threadIdx.x & 31u) == 0) atomicMax(m.acc, am);
}

}  // namespace

void enqueue_matrix_amax(const char* fn, const QuantOptions& o, DType dt, const Params& k, u32* acc, cudaStream_t s) {
  check(cudaMemsetAsync(acc, 0, sizeof(u32), s), fn, "zeroing the amax accumulator");
  if (k.total == 0) return;
  Params a = k;
  core::dispatch_dtype(dt, [&](auto dtc) { a.x_vec = aligned(a.x, a.x_stride, vec_align<decltype(dtc)::value, kMatrixChunk>()); });
  MatrixArgs m = matrix_args(o, false, dt);
  m.acc = acc;
  if (!m.bf16) launch_matrix_kernel<matrix_amax_kernel<0>>(fn, a, m, s, "matrix-rotated amax kernel");
  else if (matrix_bf16_warps(fn, a.rot_size, /*nvfp4=*/true) == 8) launch_matrix_kernel<matrix_amax_kernel<8>, 8>(fn, a, m, s, "matrix-rotated amax kernel (bf16)");
  else launch_matrix_kernel<matrix_amax_kernel<4>, 4>(fn, a, m, s, "matrix-rotated amax kernel (bf16)");
}

void dequantize_matrix(const core::Problem& p, const QuantizedIn& q, const Tensor& y) {
  DequantLaunch l = dequant_launch(p, q, y, matrix_plan());
  set_rotation(l.k, p.opt);
  core::dispatch_dtype(y.dtype, [&](auto dtc) { l.k.y_vec = aligned(l.k.y, l.k.y_stride, vec_align<decltype(dtc)::value, kMatrixChunk>()); });
  const MatrixArgs m = matrix_args(p.opt, true, y.dtype);
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    launch_matrix_kernel<matrix_dequant_kernel<decltype(fmt)>>(p.fn, l.k, m, stream_of(p), "matrix-rotated dequantize kernel");
  });
}

}  // namespace mxq::cuda
