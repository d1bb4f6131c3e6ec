#pragma once
// The fast CPU path: every core (OpenMP), branch-free vectorisable inner loops for quantize, QDQ and
// dequantize of every format and rounding. Bit-exact with the reference.
//
// Laid out as the CUDA backend is: common/ holds what every operation uses (tiles.hpp: tiling and the
// instruction-set checks; vector_io.hpp; elements.hpp: per-element codes; fp4_lookup.hpp;
// reductions.hpp: amax and quest's statistics; sr_words.hpp: the stochastic comparison words;
// nvfp4_scale.hpp); quantize/ holds quantize.cpp and qdq.cpp and the block code they share,
// mx_blocks.hpp and nvfp4_chunk.hpp, where a function serving both takes QDQ as a template parameter
// (src/cuda/quantize/mx_chunk.cuh's form).
//
// Inside a block the MX round-to-nearest-even path is branch-free fp32/int32 code that the compiler
// vectorises (an AVX2 or AVX-512 clone is selected at run time where the CPU has it):
//   a = |x| * 2^-e                       exact, or an underflow far below the element grid
//   r = (a + C) - C, C = 1.5 * 2^(q+23)  RNE onto the grid of quantum 2^q (q from a's binade)
//   r = min(r, max_elem)                 saturation
// The same per-element arithmetic serves quantize (codes read off the rounding's bits: readoff_mag),
// NVFP4 (nvfp4_encode_rne_readoff, the division by S one IEEE division per element) and stochastic
// rounding (MX in MxFastRange and NVFP4: sr_code_unscaled, in integer arithmetic; the comparison
// words one Philox call per counter, sr_words). The exact scalar codec remains for: blocks whose
// scale lies outside MxFastRange (RNE: rne_mag/code_of, still branch-free; stochastic:
// encode_scaled_sr), INT8 and fp16-output stochastic QDQ, quest's per-block sums off the eight-block
// paths (quest_arg), and dequantize blocks holding NaN/Inf element codes (mx_dequant_bits).
#include "core/problem.hpp"

namespace mxq::cpu {

void quantize(const core::Problem& p, const Tensor& x, const QuantizedOut& out);
void dequantize(const core::Problem& p, const QuantizedIn& q, const Tensor& y);
void qdq(const core::Problem& p, const Tensor& x, const Tensor& y);
void swizzle_scales(const Tensor& linear, const Tensor& swizzled);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear);
float tensor_amax(const Tensor& x);
int max_threads();

}  // namespace mxq::cpu
