#pragma once
// W4A16 linear layers: y = x @ W^T (+ bias) with W an MXFP4 or NVFP4 weight, x and y bf16 or fp16.
//
// A weight is prepacked once (prepack) from what mxq::quantize and compressed-tensors checkpoints
// hold (packed E2M1 codes and linear or 128x4-swizzled scales) into the kernel's tile layout
// (docs/linear.md), then multiplied any number of times (linear). unpack() gives the codes and
// linear scales back, byte for byte.
//
// Numerics (docs/numerics.md, "W4A16 linear"): every product x_k * (e2m1_k * scale_k) is exact, the
// products are summed in fp32 (in an order the backend chooses), the sum is multiplied (MXFP4: by
// nothing; NVFP4: divided by the tensor encode scale S, in fp32), the bias added in fp32 and the result
// rounded once to x's dtype. Backends agree byte for byte wherever the fp32 sums are exact in any order.
#include <cstdint>

#include <mxq/ops.hpp>
#include <mxq/types.hpp>

namespace mxq {

// Geometry of a prepacked weight of logical shape [N, K] (K a multiple of the format's block size).
//   codes:  u8 [tiles, 512]: tile (r, a) holds rows 16r..16r+15 and columns 64a..64a+63, r < Np/16,
//           a < Kp/64, at row r * (Kp/64) + a; 16 bytes per lane of a warp in mma fragment order.
//   scales: u8 [tiles, 32] (MXFP4: 16 rows x 2 blocks) or [tiles, 64] (NVFP4: 16 rows x 4 blocks).
// Np = N rounded up to 32, Kp = K rounded up to 64; padding holds zero codes.
struct PackedLayout {
  std::int64_t N = 0, K = 0, Np = 0, Kp = 0;
  Shape2 codes, scales;
};
PackedLayout packed_layout(Format format, std::int64_t N, std::int64_t K);

// A prepacked weight: views of the two packed tensors (host or device memory) and the facts the
// kernel needs. prepack fills exp_shift and f16_exact; the caller sets tensor_scale for NVFP4 (the
// encode scale S of mxq::quantize / compressed-tensors' weight_global_scale; y is divided by it).
struct PackedWeight {
  Format format = Format::mxfp4;  // mxfp4 or nvfp4
  std::int64_t N = 0, K = 0;
  Tensor codes;   // u8 packed_layout(...).codes, dense
  Tensor scales;  // u8 packed_layout(...).scales, dense
  // The power of two d that keeps every block scale's bf16/fp16 multiplier normal: the kernel
  // upcasts e2m1 * scale * 2^-d and multiplies the fp32 sum by 2^d (MXFP4: d = max E8M0 exponent -
  // 127 - 1; NVFP4: 8).
  int exp_shift = 0;
  // Whether fp16 activations are exact with this weight (always for NVFP4; for MXFP4, when every block
  // with a non-zero code has a scale within 2^24 of the largest). linear() refuses fp16 otherwise.
  bool f16_exact = true;
  float tensor_scale = 1.0f;  // NVFP4 only: S (finite, > 0)
};

// Prepack a quantized weight (host memory, as mxq::quantize writes it with opt's format, group size
// and scale layout): q.codes u8 [N, K/2], q.scales linear [N, K/g] or swizzled. Writes `out`'s codes
// and scales (host memory, dense, shaped by packed_layout) and its exp_shift / f16_exact; out.format,
// N and K must be set. Supported: MXFP4 with group 32, NVFP4 with group 16. Throws
// Error(unsupported) for an MXFP4 weight whose non-zero blocks' scales span more than 2^133 (the
// kernel's bf16 operand could not hold the smallest exactly).
void prepack(const QuantizedIn& q, const QuantOptions& opt, PackedWeight& out);
// The inverse: codes u8 [N, K/2] and linear scales u8 [N, K/g] (host memory) from a prepacked weight.
void unpack(const PackedWeight& w, const QuantizedIn& q);

// y [M, N] = x [M, K] @ W^T (+ bias [1, N]), x, bias and y of one dtype (bf16 or f16). x may have a row
// stride; on CUDA, x's data and row stride must be 16-byte aligned. backend: automatic (the data's
// device), reference (host data; the definition, fp32 sums in index order) or cuda. The CUDA kernels
// need sm80 or newer; they allocate nothing and never synchronise (CUDA-graph safe).
void linear(const Tensor& x, const PackedWeight& w, const Tensor* bias, const Tensor& y,
            Backend backend = Backend::automatic, void* stream = nullptr);

// The weight as the kernel's tensor-core operand: out [N, K] (bf16 or f16, dense) = e2m1 * block scale *
// 2^-w.exp_shift, exact (fp16: when w.f16_exact). A GEMM of x with it, its fp32 sum times 2^exp_shift
// (then / S for NVFP4), is linear()'s result up to the order of the sums: the PyTorch op runs large M
// this way, through cuBLAS (docs/linear.md). Host or device memory (w's); no allocation, no sync.
void dequantize_packed(const PackedWeight& w, const Tensor& out, Backend backend = Backend::automatic,
                       void* stream = nullptr);

// The CUDA kernel configuration linear() would launch for M rows of x on a device of compute capability
// sm (major * 10 + minor; 0: the current CUDA device's, or 90 where there is none), from docs/linear.md's
// table: "kernel, tokens per tile, warps along K, ring, grid", for printing.
std::string linear_plan(const PackedWeight& w, std::int64_t M, int sm = 0);

}  // namespace mxq
