#pragma once
// nvfp4_e5m3 on the fast CPU path (docs/numerics.md, "NVFP4 with UE5M3 scales"): tiles over the OpenMP
// threads, each block staged to fp32 and run through core/problem.hpp's nvfp4_e5m3 helpers (the scale one
// fp32 division, each element one more: the plugin's arithmetic, which no multiply-by-reciprocal form
// reproduces). cpu::quantize, qdq and dequantize hand the format here.
#include "core/problem.hpp"

namespace mxq::cpu {

void quantize_e5m3(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void qdq_e5m3(const core::Problem& p, const Tensor& x, const Tensor& y);
void dequantize_e5m3(const core::Problem& p, const QuantizedIn& q, const Tensor& y);

}  // namespace mxq::cpu
