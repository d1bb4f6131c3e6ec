#pragma once
// mxq operations on 2-D row-major views. Every entry validates its arguments and throws
// mxq::Error naming the offending argument; nothing is written when validation fails.
#include <span>
#include <string>

#include <mxq/types.hpp>

namespace mxq {

// ---- the catalogue: every format and the scale rules each accepts --------------------------------
std::span<const Format> all_formats();  // in declaration order
// The rules format f accepts (docs/api.md, "Formats x scale rules"): floor, ceil, even and rceil for
// every MX format; even_fp4 (compressed-tensors' rule) for MXFP4 and MXFP8 E4M3 as well; quest and
// qutlass_absmax (QuTLASS's E2M1 rules) for MXFP4 as well; nvfp4 and quest for NVFP4; nvfp4_e5m3 alone for
// nvfp4_e5m3. The entry points
// refuse any other pairing with rule_refusal's sentence.
std::span<const ScaleRule> rules_for(Format f);
// Empty when f accepts r; otherwise why not, naming the formats that accept r and the rules f accepts:
// "rule 'quest' is not defined for format 'mxint8' (its constant 2.92247856 / 6 fits the E2M1 grid;
// defined for mxfp4, nvfp4); mxint8 accepts floor, ceil, even, rceil".
std::string rule_refusal(Format f, ScaleRule r);
// The rules that depend on the block amax alone: floor, ceil, even, rceil, even_fp4.
std::span<const ScaleRule> amax_rules();

// ---- format facts ------------------------------------------------------------------------------------
struct FormatInfo {
  Format format;
  ElemType elem;
  int elem_bits;         // 4, 6 or 8
  int default_group;     // 32 for MX, 16 for NVFP4
  float max_elem;        // largest finite element value
  int emax_elem;         // exponent of the largest binade
  int mbits;             // mantissa bits (6 for INT8)
  bool e8m0_scale;       // true for MX (E8M0 scale), false for NVFP4 (E4M3 scale) and nvfp4_e5m3 (UE5M3)
};
FormatInfo format_info(Format);
int group_size(const QuantOptions&);  // the effective group size

struct Shape2 {
  std::int64_t rows = 0, cols = 0;
  bool operator==(const Shape2&) const = default;
};
// Bytes per row of packed codes: ceil(K/2) for FP4, K for 6- and 8-bit elements.
std::int64_t code_cols(Format, std::int64_t K);
// Shape of the scale tensor (bytes) for the options' layout and group size.
Shape2 scale_shape(const QuantOptions&, std::int64_t rows, std::int64_t K);
// Clip mask: one bit per element, LSB first, [rows, ceil(K/8)] bytes.
Shape2 clip_mask_shape(std::int64_t rows, std::int64_t K);

// ---- quantize ----------------------------------------------------------------------------------------
struct QuantizedOut {
  Tensor codes;         // u8 [rows, code_cols(format, K)]
  Tensor scales;        // u8 scale_shape(opt, rows, K); swizzled layout must be dense
  Tensor clip_mask;     // optional (data == nullptr: not written); u8 clip_mask_shape(rows, K)
  // NVFP4: receives the encode scale S used; optional. It lives where the data lives: host memory
  // for the CPU backends, device memory for the CUDA backend (written in stream order). On CUDA,
  // quantize without opt.tensor_scale needs it (or opt.workspace) to reduce the tensor amax in.
  float* tensor_scale = nullptr;
};
void quantize(const Tensor& x, const QuantizedOut& out, const QuantOptions& opt);

// ---- dequantize --------------------------------------------------------------------------------------
struct QuantizedIn {
  Tensor codes;   // u8 [rows, code_cols(format, K)]
  Tensor scales;  // u8 scale_shape(opt, rows, K)
};
// y: [rows, K] in f32, f16 or bf16; K is taken from y. NVFP4 needs opt.tensor_scale.
void dequantize(const QuantizedIn& q, const Tensor& y, const QuantOptions& opt);

// ---- fused quantize-dequantize -----------------------------------------------------------------------
// y has x's dtype and shape; y may be x itself (same data and stride) but may not partially overlap.
// For NVFP4 without opt.tensor_scale the tensor scale is computed from x (an extra pass).
void qdq(const Tensor& x, const Tensor& y, const QuantOptions& opt);

// ---- fused producer + QDQ (activation emulation where a model's own kernel produces the tensor) -------
// The producer's output y (x's dtype and shape), QDQ'd in the same pass when `qdq` is given: the same
// bytes as qdq() of the unfused output (docs/numerics.md, "Fused producers" defines the producers' arithmetic:
// bit-exact across backends, within an ulp of transformers' modules). `qdq`: an MX format with any
// rule, or NVFP4 with opt.tensor_scale given; round to nearest even only; its backend and stream
// fields must be left default or equal the arguments. y may be the first input itself (in place).
//
// RMSNorm as transformers' LlamaRMSNorm: y = dtype(w * dtype(x / sqrt(mean(x^2) + eps))), per row;
// weight is [1, K] in x's dtype; eps finite and >= 0; K < 2^24.
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const QuantOptions* qdq = nullptr,
              Backend backend = Backend::automatic, void* stream = nullptr);
// SiLU-and-multiply as transformers' LlamaMLP: y = dtype(dtype(silu(gate)) * up); gate, up and y of one
// dtype and shape (views: the halves of a concatenated [rows, 2K] gate_up tensor work as row_stride 2K).
void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y, const QuantOptions* qdq = nullptr,
              Backend backend = Backend::automatic, void* stream = nullptr);

// ---- scale layouts -----------------------------------------------------------------------------------
// linear: u8 [rows, C]; swizzled: u8 [ceil(rows/128)*128, ceil(C/4)*4], dense. Padding written as 0.
// stream: the cudaStream_t for the CUDA backend (nullptr: the legacy default stream).
void swizzle_scales(const Tensor& linear, const Tensor& swizzled, Backend backend = Backend::automatic,
                    void* stream = nullptr);
void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, Backend backend = Backend::automatic,
                      void* stream = nullptr);
// Byte offset of linear scale (r, c) inside the swizzled layout with padded column count Cp.
constexpr std::int64_t swizzled_offset(std::int64_t r, std::int64_t c, std::int64_t Cp) {
  return ((r / 128) * (Cp / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
}

// ---- NVFP4 tensor scale ------------------------------------------------------------------------------
// S = (448 * 6) / amax, clamped to the largest finite float; 1 when amax is 0 or not finite.
float nvfp4_tensor_scale_from_amax(float amax);
// amax over a tensor (NaN if any element is NaN, +Inf if any is infinite). On the CUDA backend this
// returns a host value, so it synchronises with `stream` (and briefly allocates): not for graphs.
float tensor_amax(const Tensor& x, Backend backend = Backend::automatic, void* stream = nullptr);
// max |x| as quantize sees x under `opt`: after its rotation (opt.rotation; none: the plain amax), on
// opt.backend with opt.stream; NVFP4's computed tensor scale of a rotated quantize is
// nvfp4_tensor_scale_from_amax of this. With a rotation, the CPU backends only in this version
// (the CUDA backend raises Error(unsupported): a host value would synchronise; quantize and qdq
// themselves rotate on the GPU, every mode).
float tensor_amax(const Tensor& x, const QuantOptions& opt);

// ---- backend selection --------------------------------------------------------------------------------
// Which backend an operation with these arguments would run on, and why (for verbose output).
struct BackendChoice {
  Backend backend;
  std::string reason;
};
// automatic: MXQ_BACKEND (reference, cpu, cuda) when set, else the fast CPU path for host data and
// the CUDA kernels for device data. Data is never copied between host and device: a backend that
// cannot reach the data is an error (Error::Code::backend_unavailable).
BackendChoice choose_backend(Backend requested, Device data_device);

// Whether this build has the CUDA backend, and whether a usable CUDA device is present (why not, if
// not).
bool cuda_compiled();
bool cuda_available(std::string* why_not = nullptr);

}  // namespace mxq
