#pragma once
// The rotated launches of quantize, QDQ and dequantize (docs/numerics.md, "Rotation before
// quantization"), one translation unit each, called by the plain launchers when the options carry a
// rotation. Requirements (the entry layer checks them): K a multiple of the rotation size, groups of
// 8 or more elements (chunks of 8 or 16, so that a rotation group spans at most 32 lanes); a matrix
// (and its inverse) in device memory.
#include <cuda_runtime.h>

#include "core/problem.hpp"
#include "cuda/common/launch.cuh"

namespace mxq::cuda {

// block_kernel<..., ROT = true> for problem p over dtype dt with the plan's chunk width; k holds the
// views and the rotation (set_rotation).
template <bool QDQ>
void launch_rotated(const char* fn, const core::Problem& p, DType dt, const Plan& pl, Params& k, cudaStream_t s);
// Zeroes *acc and reduces max |x R| into it as fp32 bits (the NVFP4 tensor amax of the rotated tensor).
void enqueue_rotated_amax(const char* fn, DType dt, const Plan& pl, const Params& k, u32* acc, cudaStream_t s);
// dequantize, then the inverse rotation, rounded to y's dtype.
void dequantize_rotated(const core::Problem& p, const QuantizedIn& q, const Tensor& y);

// The plan of the Rotation::matrix launches: chunks of 8, row by row (a row's padding chunks form whole
// rotation groups of zeros: cuda/rotate/matrix.cuh).
inline Plan matrix_plan() { return Plan{8, false}; }
// Rotation::matrix, k set up with matrix_plan() and set_rotation: quantize
// (qdq = false) or QDQ of x (dtype dt); the tensor amax of the rotated x into *acc (zeroed first);
// dequantize with the inverse matrix.
void launch_matrix(bool qdq, const char* fn, const core::Problem& p, DType dt, Params& k, cudaStream_t s);
void enqueue_matrix_amax(const char* fn, const QuantOptions& o, DType dt, const Params& k, u32* acc, cudaStream_t s);
void dequantize_matrix(const core::Problem& p, const QuantizedIn& q, const Tensor& y);

}  // namespace mxq::cuda
