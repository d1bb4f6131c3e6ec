#pragma once
// The CUDA backend: stream-ordered kernels for every operation, bit-exact with the CPU reference.
// Host-side functions validate that the views' memory is device memory of the current device, enqueue
// on the options' stream, allocate nothing (except tensor_amax, which returns a host value) and turn
// any CUDA error into mxq::Error(device_error). Compiled only when MXQ_HAVE_CUDA is set.
#include <string>

#include "core/problem.hpp"

namespace mxq::cuda {

bool available(std::string* why_not);

// `fn` names the public entry point for error messages.
void quantize(const char* fn, const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void dequantize(const char* fn, const core::Problem& p, const QuantizedIn& q, const Tensor& y);
void qdq(const char* fn, const core::Problem& p, const Tensor& x, const Tensor& y);
void swizzle_scales(const Tensor& linear, const Tensor& swizzled, void* stream);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, void* stream);
float tensor_amax(const Tensor& x, void* stream);

}  // namespace mxq::cuda
