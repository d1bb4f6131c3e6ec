// quantize and QDQ with a rotation by a runtime matrix (cuda/rotate/matrix.cuh): each warp tile is
// rotated on the FP64 tensor cores, then its chunks take the rotated launches' chunk code (fp32
// chunks; QDQ's outputs rounded to the view's dtype), with the runtime rule and rounding.
#include <type_traits>

#include "core/dispatch.hpp"
#include "cuda/quantize/choices.cuh"
#include "cuda/quantize/mx_chunk.cuh"
#include "cuda/quantize/nvfp4_chunk.cuh"
#include "cuda/rotate/matrix_launch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {
namespace {

using RuntimeChoices = Choices<ScaleChoice::runtime, RoundChoice::runtime>;

// ODT: QDQ's output dtype (quantize: f32, unused; the input's dtype is m.dt at run time). BW: 0, the
// exact product; 4 or 8, the bf16 product (bf16 input; matrix_bf16.cuh) in blocks of BW warps (8: two
// blocks per SM, so at most 128 registers).
template <class Fmt, DType ODT, bool QDQ, int BW = 0>
__global__ void __launch_bounds__(BW ? 32 * BW : kMatrixThreads, BW == 8 ? 2 : 0) matrix_quant_kernel(const Params p, const MatrixArgs m) {
  __shared__ NvTables nvt;
  NvScale nv;
  if constexpr (Fmt::nvfp4) {
    nv = nv_scale(p);
    fill_nv_tables<ODT, QDQ>(nv, nvt);  // every thread reaches its barrier
  }
  const auto finish = [&](const Coord& c, const u32 (&y)[kMatrixChunk]) {
    if constexpr (Fmt::nvfp4) nvfp4_chunk<DType::f32, kMatrixChunk, QDQ, RuntimeChoices, ODT>(p, c, nv, nvt, y);
    else mx_chunk<Fmt, DType::f32, kMatrixChunk, QDQ, RuntimeChoices, ODT>(p, c, y);
  };
  if constexpr (BW != 0) {
    matrix_tiles_bf16<BW>(p, m, finish);
  } else {
    matrix_tiles(p, m, [&](const Coord& c, u32 (&v)[kMatrixChunk]) { matrix_load(p, m, c, v); }, finish);
  }
}

}  // namespace

void launch_matrix(bool qdq, const char* fn, const core::Problem& p, DType dt, Params& k, cudaStream_t s) {
  const MatrixArgs m = matrix_args(p.opt, false, dt);
  core::dispatch_dtype(dt, [&](auto dtc) { k.x_vec = aligned(k.x, k.x_stride, vec_align<decltype(dtc)::value, kMatrixChunk>()); });
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    using Fmt = decltype(fmt);
    if (m.bf16) {  // bf16 data (checked at the API)
      if (qdq) k.y_vec = aligned(k.y, k.y_stride, vec_align<DType::bf16, kMatrixChunk>());
      const auto go = [&](auto w) {
        constexpr int W = decltype(w)::value;
        if (!qdq) return launch_matrix_kernel<matrix_quant_kernel<Fmt, DType::f32, false, W>, W>(fn, k, m, s, "matrix-rotated quantize kernel (bf16)");
        launch_matrix_kernel<matrix_quant_kernel<Fmt, DType::bf16, true, W>, W>(fn, k, m, s, "matrix-rotated qdq kernel (bf16)");
      };
      if (matrix_bf16_warps(fn, k.rot_size, Fmt::nvfp4) == 8) go(std::integral_constant<int, 8>{});
      else go(std::integral_constant<int, 4>{});
      return;
    }
    if (!qdq) return launch_matrix_kernel<matrix_quant_kernel<Fmt, DType::f32, false>>(fn, k, m, s, "matrix-rotated quantize kernel");
    core::dispatch_dtype(dt, [&](auto dtc) {
      constexpr DType DT = decltype(dtc)::value;
      k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, kMatrixChunk>());
      launch_matrix_kernel<matrix_quant_kernel<Fmt, DT, true>>(fn, k, m, s, "matrix-rotated qdq kernel");
    });
  });
}

}  // namespace mxq::cuda
