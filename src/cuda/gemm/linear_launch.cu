// cuda::linear: the entry layer has validated the views (device pointers, shapes, x 16-byte aligned).
#include <cmath>

#include "core/validate.hpp"
#include "cuda/backend.hpp"
#include "cuda/gemm/linear_launch.cuh"

namespace mxq::cuda {

void linear(const Tensor& x, const PackedWeight& w, const Tensor* bias, const Tensor& y, void* stream) {
  const int sm = compute_capability("linear");
  // The sm90a kernel runs only where the library holds sm_90a code and the device is sm_90 (the sm_90a
  // code runs on no other), unless MXQ_LINEAR_NO_WGMMA keeps the mma.sync tiles.
  const core::LinearPlan p =
      core::plan_linear(w.N, w.K, x.rows, sm, sm == 90 && gemm::wgmma_built() && !core::wgmma_disabled_by_env());
  if (p.grid_m > 65535)
    core::fail(Error::Code::unsupported, "linear", "x has " + std::to_string(x.rows) + " rows: at most " +
                                                       std::to_string(65535 * p.tokens) + " per call");
  gemm::LinearArgs a{};
  a.codes = static_cast<const uint4*>(w.codes.data);
  a.scales = static_cast<const std::uint8_t*>(w.scales.data);
  a.x = static_cast<const std::uint16_t*>(x.data);
  a.bias = bias ? static_cast<const std::uint16_t*>(bias->data) : nullptr;
  a.y = static_cast<std::uint16_t*>(y.data);
  a.M = x.rows;
  a.N = w.N;
  a.K = w.K;
  a.x_stride = x.stride();
  a.y_stride = y.stride();
  a.katoms = static_cast<int>((w.K + 63) / 64);
  a.exp_shift = w.exp_shift;
  // y = (acc * 2^d) / S (NVFP4) or acc * 2^d (MXFP4): both exact scalings of the fp32 sum but the last.
  a.mul = std::ldexp(1.0f, w.exp_shift);
  a.div = w.format == Format::nvfp4 ? w.tensor_scale : 1.0f;
  const bool nv = w.format == Format::nvfp4;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.wgmma)
    gemm::launch_linear_wgmma(a, nv, x.dtype == DType::f16, p, s);
  else if (x.dtype == DType::f16)
    gemm::launch_linear_f16(a, nv, p, s);
  else
    gemm::launch_linear_bf16(a, nv, p, s);
}

void dequantize_packed(const PackedWeight& w, const Tensor& out, void* stream) {
  const std::int64_t katoms = (w.K + 63) / 64, tiles = (w.N + 31) / 32 * 2 * katoms;
  const std::int64_t blocks = (tiles + 7) / 8;
  if (blocks > 0x7FFFFFFF) core::fail(Error::Code::unsupported, "dequantize_packed", "weight too large for one launch");
  const auto* c = static_cast<const uint4*>(w.codes.data);
  const auto* sc = static_cast<const std::uint8_t*>(w.scales.data);
  auto* o = static_cast<std::uint16_t*>(out.data);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool nv = w.format == Format::nvfp4, f16 = out.dtype == DType::f16;
  const auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(c, sc, o, w.N, w.K, int(katoms), tiles, w.exp_shift);
  };
  if (nv)
    f16 ? launch(gemm::dequantize_packed_kernel<true, true>) : launch(gemm::dequantize_packed_kernel<true, false>);
  else
    f16 ? launch(gemm::dequantize_packed_kernel<false, true>) : launch(gemm::dequantize_packed_kernel<false, false>);
  check_launch("dequantize_packed", "dequantize_packed_kernel");
}

}  // namespace mxq::cuda
