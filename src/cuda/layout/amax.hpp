#pragma once
// The tensor amax on the device (the NVFP4 tensor scale computed from the data) and the tensor-scale
// output, stream-ordered, for quantize_launch.cu and qdq_launch.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include <mxq/types.hpp>

namespace mxq::cuda {

// Zeroes *acc (4 bytes of device memory) and reduces max |x| into it as fp32 bits (NaN anywhere gives
// NaN, an infinity +Inf).
void enqueue_amax(const char* fn, const Tensor& x, std::uint32_t* acc, cudaStream_t s);
// Writes the NVFP4 encode scale to *ts (device): from the amax in *acc when acc is set (acc may be ts
// itself: the amax is replaced by S), else the given S.
void enqueue_tensor_scale(const char* fn, float* ts, const std::uint32_t* acc, float S, cudaStream_t s);

}  // namespace mxq::cuda
