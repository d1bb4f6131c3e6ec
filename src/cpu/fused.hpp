#pragma once
// The fused producer ops on the CPU (every CPU backend): the producer's output into y; the entry
// layer then QDQs y in place with the chosen CPU backend, which gives the same bytes as the CUDA
// backend's single kernel.
#include "core/problem.hpp"

namespace mxq::cpu {

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y);
void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y);

}  // namespace mxq::cpu
