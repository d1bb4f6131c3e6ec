#pragma once
// The activations between the MoE's two GEMMs (docs/numerics.md, "W4A16 MoE"), one element at a time in
// fp32 from basic correctly rounded operations and mxq's own exp (fused_math.hpp), so that a backend that
// calls these gets the reference's bits. The contract allows a backend another exp (the activation may
// then differ in the last bit of its fp32 value before the final rounding); nothing else may differ.
#include "core/fused_math.hpp"

namespace mxq::core {

// silu(g) * u = g / (1 + exp(-g)) * u (vLLM's silu_and_mul: fp32, rounded once by the caller).
MXQ_HD float moe_swiglu(float g, float u) { return mul_rn(div_rn(g, add_rn(1.0f, exp_f32(-g))), u); }

// gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit),
// (u + 1) * (g * sigmoid(alpha * g)), sigmoid(z) = 1 / (1 + exp(-z)). NaN stays NaN (as torch's clamp).
MXQ_HD float moe_swiglu_oai(float g, float u, float alpha, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  const float s = div_rn(1.0f, add_rn(1.0f, exp_f32(-mul_rn(alpha, g))));
  return mul_rn(add_rn(u, 1.0f), mul_rn(g, s));
}

}  // namespace mxq::core
