#pragma once
// nvfp4_e5m3 on the CUDA backend (docs/numerics.md, "NVFP4 with UE5M3 scales"): cuda::quantize, qdq and
// dequantize hand the format here (cuda/quantize/e5m3_launch.cu), before any traits dispatch.
#include "core/problem.hpp"

namespace mxq::cuda {

void quantize_e5m3(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void qdq_e5m3(const core::Problem& p, const Tensor& x, const Tensor& y);
void dequantize_e5m3(const core::Problem& p, const QuantizedIn& q, const Tensor& y);

}  // namespace mxq::cuda
