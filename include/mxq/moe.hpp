#pragma once
// W4A16 mixture of experts: the two expert GEMMs of an MoE block with top-k routing, on MXFP4 / NVFP4
// experts prepacked into the W4A16 tile layout (docs/moe.md), bf16 / fp16 activations.
//
//   y[t] = sum_j topk_weights[t, j] * W2[e] act(W13[e] x[t] (+ b13[e])) (+ b2[e]),  e = topk_ids[t, j]
//
// Numerics (docs/numerics.md, "W4A16 MoE"): each expert GEMM is mxq::linear's arithmetic (exact products,
// fp32 sums, / S, + bias); the first is rounded to x's dtype, the activation computed in fp32 and rounded
// once, the second kept in fp32, multiplied by the routing weight, and the k slots of a token summed in
// fp32 in slot order and rounded once. The result does not depend on the order experts or pairs are
// processed in: deterministic on every backend.
//
// The pipeline is four primitives (moe_route, moe_linear, moe_activation, moe_combine) that moe() chains;
// each is public so that callers can build other pipelines (e.g. expert parallelism) and so that every
// stage is tested on its own. Vectors are views of one row: [1, n].
#include <cstdint>
#include <string_view>

#include <mxq/linear.hpp>
#include <mxq/types.hpp>

namespace mxq {

// The activation between the two GEMMs, on a row h of W13's output.
//   none:       a = h (W13 is [E, I, H]);
//   swiglu:     gate = h[:I], up = h[I:] (vLLM's w13 order), a = silu(gate) * up;
//   swiglu_oai: gate = h[0::2], up = h[1::2] (gpt-oss's interleaved rows), gate = min(gate, limit),
//               up = clamp(up, -limit, limit), a = (up + 1) * gate * sigmoid(alpha * gate).
enum class MoeActivation : std::uint8_t { none, swiglu, swiglu_oai };
std::string_view to_string(MoeActivation);
MoeActivation parse_moe_activation(std::string_view);  // "none", "swiglu", "swiglu_oai"

// E experts of logical shape [N, K], each prepacked (mxq::prepack) into the W4A16 tile layout and stored
// one expert per row. All tensors on one device.
struct PackedExperts {
  Format format = Format::mxfp4;  // mxfp4 or nvfp4
  std::int64_t E = 0, N = 0, K = 0;
  Tensor codes;         // u8 [E, Lc], Lc = packed_layout(format, N, K).codes rows * cols; row e is expert e's codes
  Tensor scales;        // u8 [E, Ls], Ls = packed_layout(format, N, K).scales rows * cols
  Tensor exp_shift;     // i32 [1, E]: each expert's PackedWeight::exp_shift
  Tensor tensor_scale;  // f32 [1, E]: each expert's NVFP4 encode scale S (1.0 for MXFP4)
  bool f16_exact = true;  // every expert's PackedWeight::f16_exact
};

// The byte counts of one expert's codes and scales (the columns of PackedExperts::codes / scales).
Shape2 packed_expert_bytes(Format format, std::int64_t N, std::int64_t K);

// Prepack E quantized weights (host memory, as mxq::quantize writes them with opt: q[e].codes u8 [N, K/2],
// q[e].scales linear or swizzled) into `out`, whose format, E, N, K are set and whose codes, scales,
// exp_shift and tensor_scale are host views shaped as above. tensor_scales: E NVFP4 encode scales
// (nullptr for MXFP4: 1.0). Fills all four tensors and f16_exact.
void prepack_experts(const QuantizedIn* q, const QuantOptions& opt, const float* tensor_scales, PackedExperts& out);

// Expert e as a PackedWeight (views into w's rows; exp_shift and tensor_scale read from w's host tensors).
// Host memory only: for device memory take codes/scales rows yourself (the facts live on the device).
PackedWeight expert(const PackedExperts& w, std::int64_t e);

// ---- the primitives ---------------------------------------------------------------------------------
// P = T * k routed pairs; pair p = t * k + j is token t's slot j. "Sorted order": the pairs grouped by
// expert, ascending expert.

// Group the pairs by expert. topk_ids [T, k] i32 or i64. Writes
//   expert_offsets i32 [1, E + 1]: expert e's pairs are sorted positions [offsets[e], offsets[e+1]);
//   sorted_pairs   i32 [1, P]:     the pair at each sorted position (within an expert any order is
//                                  allowed; the reference uses ascending pair index); positions
//                                  >= offsets[E] (dropped pairs, below) hold -1;
//   pair_pos       i32 [1, P]:     the sorted position of each pair (-1 for a dropped pair);
//   error_flag     i32 [1, 1]:     0, or 1 when some id is outside [0, E).
// Host ids (the reference): an id out of range throws Error(invalid_argument) naming the token and slot;
// nothing is written. Device ids (CUDA): the pairs with such ids are dropped (they are in no expert's
// group, never read out of bounds), error_flag is set, and the token sums only its in-range slots.
void moe_route(const Tensor& topk_ids, std::int64_t E, const Tensor& expert_offsets, const Tensor& sorted_pairs,
               const Tensor& pair_pos, const Tensor& error_flag, Backend backend = Backend::automatic, void* stream = nullptr);

// Which row of x sorted position q reads in moe_linear.
//   token:  x is [T, K], token sorted_pairs[q] / k (the first GEMM, on the routed tokens);
//   sorted: x is [P, K] in sorted order, row q (the second GEMM, on the activations).
enum class MoeRows : std::uint8_t { token, sorted };

// The grouped GEMM: for every sorted position q < offsets[E], with pair p = sorted_pairs[q] and its expert
// e (offsets[e] <= q < offsets[e + 1]), row q of y = linear(x row, W[e]) (+ bias[e]):
//   row_scale == nullptr: rounded once to x's dtype (y bf16 / f16, mxq::linear's result);
//   row_scale given:      y f32, the fp32 value (acc / S + bias) times row_scale[p / k, p % k] (converted to
//                         fp32 exactly), one multiply: the second GEMM with the routing weight fused.
// Rows q >= offsets[E] (dropped pairs) are written as zeros. x bf16 or f16 (row stride allowed); bias
// [E, N] x's dtype or nullptr; row_scale [T, k] f32, bf16 or f16 (topk_weights) or nullptr; y [P, N] dense.
// k: the routing's top-k (P = T * k). An expert with no pairs costs nothing.
void moe_linear(const Tensor& x, MoeRows rows, std::int64_t k, const PackedExperts& w, const Tensor* bias,
                const Tensor& expert_offsets, const Tensor& sorted_pairs, const Tensor* row_scale, const Tensor& y,
                Backend backend = Backend::automatic, void* stream = nullptr);

// a [P, I] = act(h [P, N13]) row by row (N13 = I for none, 2I for the SwiGLUs), h and a of one dtype
// (bf16 or f16), computed in fp32 and rounded once (docs/numerics.md). alpha, limit: swiglu_oai only
// (gpt-oss: 1.702, 7.0).
void moe_activation(const Tensor& h, MoeActivation kind, float alpha, float limit, const Tensor& a,
                    Backend backend = Backend::automatic, void* stream = nullptr);

// y[t] = sum over j = 0..k-1, in that order, of o[pair_pos[t * k + j]] (fp32), rounded once to y's dtype;
// a dropped pair (pair_pos -1) adds nothing, a token with none left gets +0. o [P, H] f32 in sorted order,
// pair_pos i32 [1, P], y [T, H] bf16 or f16.
void moe_combine(const Tensor& o, const Tensor& pair_pos, std::int64_t k, const Tensor& y,
                 Backend backend = Backend::automatic, void* stream = nullptr);

// ---- the whole block ----------------------------------------------------------------------------------
// The scratch memory the CUDA path of moe() uses: one u8 buffer of `bytes`, regions at the byte offsets
// below (each a multiple of 256). P = T * k, N13 = w13.N (2I or I), I = w2.K, H = w2.N, es = 2 (bf16/f16):
//   expert_offsets i32 [E + 1]   sorted_pairs i32 [P]   pair_pos i32 [P]   error_flag i32 [1]
//   h  es * P * N13 (the first GEMM's output, sorted order)
//   a  es * P * I   (the activation; absent (0 bytes) for MoeActivation::none, which reads h)
//   o  4 * P * H    (the second GEMM's weighted fp32 rows, sorted order)
// The reference backend takes no workspace (it allocates host memory).
struct MoeWorkspace {
  std::int64_t bytes = 0;
  std::int64_t expert_offsets = 0, sorted_pairs = 0, pair_pos = 0, error_flag = 0, h = 0, a = 0, o = 0;
};
MoeWorkspace moe_workspace(std::int64_t T, std::int64_t k, std::int64_t E, std::int64_t N13, std::int64_t I, std::int64_t H,
                           MoeActivation activation);

// y [T, H] = the MoE block on x [T, H] (bf16 or f16; y, b13, b2 the same dtype):
//   w13 [E, N13, H] (N13 = 2I for the SwiGLUs, I for none), b13 [E, N13] or nullptr,
//   w2 [E, H, I], b2 [E, H] or nullptr, one format for both,
//   topk_ids [T, k] i32 / i64, topk_weights [T, k] f32, bf16 or f16,
//   H and I multiples of the format's block (32 MXFP4, 16 NVFP4).
// workspace: u8 [1, >= moe_workspace(...).bytes] on the device (CUDA: required; the call allocates
// nothing and never synchronises, CUDA-graph safe); ignored by the reference. The CUDA path's error flag
// (an id out of range) is the workspace's error_flag word after the call.
void moe(const Tensor& x, const PackedExperts& w13, const Tensor* b13, const PackedExperts& w2, const Tensor* b2,
         const Tensor& topk_ids, const Tensor& topk_weights, MoeActivation activation, float alpha, float limit,
         const Tensor& y, const Tensor* workspace = nullptr, Backend backend = Backend::automatic, void* stream = nullptr);

}  // namespace mxq
