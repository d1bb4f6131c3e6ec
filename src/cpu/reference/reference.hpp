#pragma once
// The plain CPU reference: obvious loops over rows and blocks, one element at a time, sharing only
// the scalar codec with the other backends. It defines what every backend must produce.
#include "core/problem.hpp"

namespace mxq::ref {

void quantize(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y);
void qdq(const core::Problem& p, const Tensor& x, const Tensor& y);
void swizzle_scales(const Tensor& linear, const Tensor& swizzled);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear);
float tensor_amax(const Tensor& x);

}  // namespace mxq::ref
