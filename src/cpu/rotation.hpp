#pragma once
// Rotation on the CPU backends (core/rotation.hpp's arithmetic): rows in parallel through an fp32
// buffer that the quantization then reads (or that dequantize writes and this un-rotates).
#include <mxq/types.hpp>

namespace mxq::cpu {

// out[r * K + k] (fp32, dense): row r of x (any float dtype) rotated group by group, or un-rotated
// (inverse). out may be x's own data when x is that same dense fp32 buffer.
void rotate_rows(const Tensor& x, float* out, const QuantOptions& opt, bool inverse);
// max |x R| as fp32 (NaN if any rotated value is NaN, else +Inf if any is infinite), row by row: no
// copy of the tensor.
float rotated_amax(const Tensor& x, const QuantOptions& opt);
// y (its dtype) <- the dense fp32 rows v, rounded as the library rounds outputs (RNE, saturating).
void store_rows(const float* v, const Tensor& y);

}  // namespace mxq::cpu
