#pragma once
// The W4A16 linear's reference arithmetic before the final rounding, shared by mxq::linear's reference
// and the MoE reference (src/moe.cpp), so that each MoE expert GEMM is the dense linear's definition.
#include <cstdint>

#include <mxq/linear.hpp>

namespace mxq::ref {

// out [nrows, w.N] (fp32, dense) = for row i of the result, the row rows[i] of x (rows == nullptr: row i):
// exact products x[k] * (e2m1 * block scale) summed in fp32 in index order, / S (NVFP4, one fp32
// division), + bias[n] (bias [1, w.N] of x's dtype, or nullptr). Host memory; no validation.
void linear_f32(const Tensor& x, const std::int64_t* rows, std::int64_t nrows, const PackedWeight& w, const Tensor* bias,
                float* out);

}  // namespace mxq::ref
