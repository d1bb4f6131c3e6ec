#pragma once
// Named compatibility presets (docs/numerics.md, "Compatibility presets").
#include <mxq/types.hpp>

namespace mxq::presets {

// vllm-qdq-plugin mxfp4_qdq: E2M1, g=32, rule even, RNE.
QuantOptions vllm_mxfp4_qdq();
// vllm-qdq-plugin mxfp8_qdq: E4M3, g=32, rule floor, RNE (true RNE; see docs/numerics.md).
QuantOptions vllm_mxfp8_qdq();
// OCP MX v1.0: the spec's floor rule, for any MX format.
QuantOptions ocp_mx(Format format);
// torchao to_mx with ScaleCalculationMode FLOOR, CEIL, EVEN or RCEIL.
QuantOptions torchao_mx(Format format, ScaleRule rule);
// MXFP8 training recipe of cuBLAS / TransformerEngine / FlashInfer: E4M3, rceil.
QuantOptions mxfp8_rceil();
// compressed-tensors' MX scales (what llm-compressor writes and vLLM loads): MXFP4 or MXFP8 (E4M3)
// with the even_fp4 rule (its MXFP8 rule rounds the block amax at E2M1's mantissa width too).
QuantOptions compressed_tensors_mx(Format format);
// QuTLASS fusedQuantizeMx(method="quest") / (method="abs_max"): MXFP4, swizzled scales.
QuantOptions qutlass_mx_quest();
QuantOptions qutlass_mx_absmax();
// QuTLASS fusedQuantizeNv: NVFP4 with a caller-given global (encode) scale, swizzled scales.
QuantOptions qutlass_nv(float global_scale);

}  // namespace mxq::presets
