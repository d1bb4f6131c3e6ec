#pragma once
// The CUDA backend: stream-ordered kernels for every operation, bit-exact with the CPU reference.
//
// The entry layer (src/ops.cpp) has validated every argument (views, options, and with
// check_device_pointer that device views point to device memory of the current device) and planned
// the problem (NVFP4 tensor scale: given, or computed on the device into p.amax_acc; empty tensors
// never reach the backend except through write_empty). These functions enqueue on the options'
// stream, allocate nothing (except tensor_amax, which returns a host value) and turn any CUDA error
// into mxq::Error(device_error). Compiled only when MXQ_HAVE_CUDA is set.
#include <string>

#include <mxq/linear.hpp>
#include <mxq/moe.hpp>

#include "core/problem.hpp"

namespace mxq::cuda {

bool available(std::string* why_not);
// Refuses (mxq::Error(invalid_argument) naming fn and arg) a non-null pointer that is not device or
// managed memory of the current device.
void check_device_pointer(const char* fn, const char* arg, const void* ptr);

void quantize(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y);
void qdq(const core::Problem& p, const Tensor& x, const Tensor& y);
// quantize of an empty x: the tensor-scale output (p.S) and a swizzled scale tensor's padding (zeros).
void write_empty(const core::Problem& p, const QuantizedOut& out);
void swizzle_scales(const Tensor& linear, const Tensor& swizzled, void* stream);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, void* stream);
float tensor_amax(const Tensor& x, void* stream);
// The fused producer ops (cuda/fused/): y = the producer's output, QDQ'd when qdq is set (MX formats,
// or NVFP4 with its tensor scale given; round to nearest even).
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const core::Problem* qdq, void* stream);
void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y, const core::Problem* qdq, void* stream);
// The W4A16 linear (cuda/gemm/): y = x @ W^T (+ bias); x 16-byte aligned (checked by the entry layer).
void linear(const Tensor& x, const PackedWeight& w, const Tensor* bias, const Tensor& y, void* stream);
void dequantize_packed(const PackedWeight& w, const Tensor& out, void* stream);
// The W4A16 MoE (cuda/moe/): the primitives and the whole block over the caller's workspace (src/moe.cpp
// validates; x and the workspace 16- / 256-byte aligned).
void moe_route(const Tensor& ids, std::int64_t E, const Tensor& offsets, const Tensor& sorted, const Tensor& pos, const Tensor& flag,
               void* stream);
void moe_linear(const Tensor& x, bool token_rows, std::int64_t k, const PackedExperts& w, const Tensor* bias, const Tensor& offsets,
                const Tensor& sorted, const Tensor* row_scale, const Tensor& y, void* stream);
void moe_activation(const Tensor& h, MoeActivation kind, float alpha, float limit, const Tensor& a, void* stream);
void moe_combine(const Tensor& o, const Tensor& pos, std::int64_t k, const Tensor& y, void* stream);
void moe(const Tensor& x, const PackedExperts& w13, const Tensor* b13, const PackedExperts& w2, const Tensor* b2, const Tensor& topk_ids,
         const Tensor& topk_weights, MoeActivation activation, float alpha, float limit, const Tensor& y, const Tensor& workspace,
         void* stream);
// The current device's compute capability (major * 10 + minor), for the linear's plan.
int device_sm();

}  // namespace mxq::cuda
