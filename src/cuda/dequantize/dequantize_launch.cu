// dequantize on the CUDA backend: one thread per chunk, no staging (the codes are the small side).
#include "core/dispatch.hpp"
#include "cuda/backend.hpp"
#include "cuda/quantize/e5m3.hpp"
#include "cuda/dequantize/dequantize_chunk.cuh"
#include "cuda/dequantize/dequantize_launch.cuh"
#include "cuda/rotate/rotate.hpp"

namespace mxq::cuda {

void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y) {
  if (p.e5m3()) return dequantize_e5m3(p, q, y);
  if (p.opt.rotation == Rotation::matrix) return dequantize_matrix(p, q, y);
  if (p.opt.rotation != Rotation::none) return dequantize_rotated(p, q, y);
  const cudaStream_t s = stream_of(p);
  DequantLaunch l = dequant_launch(p, q, y);
  dispatch_dequant(p, y.dtype, l, [&](auto fmt, auto dt, auto cc) {
    dequant_kernel<decltype(fmt), decltype(dt)::value, decltype(cc)::value><<<l.k.blocks, kThreads, 0, s>>>(l.k);
  });
  check_launch(p.fn, "dequantize kernel");
}

}  // namespace mxq::cuda
