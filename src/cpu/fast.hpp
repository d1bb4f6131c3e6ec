#pragma once
// The fast CPU path: every core (OpenMP), branch-free vectorisable inner loops for quantize, QDQ and
// dequantize of every format and rounding (fast_common.hpp lists what stays on the scalar codec).
// Bit-exact with the reference.
#include "core/problem.hpp"

namespace mxq::cpu {

void quantize(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y);
void qdq(const core::Problem& p, const Tensor& x, const Tensor& y);
void swizzle_scales(const Tensor& linear, const Tensor& swizzled);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear);
float tensor_amax(const Tensor& x);
int max_threads();

}  // namespace mxq::cpu
