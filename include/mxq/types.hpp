#pragma once
// mxq public types: formats, scale rules, options, tensor views and the error type.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace mxq {

// ---- element types and formats ------------------------------------------------------------------
enum class ElemType : std::uint8_t { e2m1, e2m3, e3m2, e4m3, e5m2, int8 };

enum class Format : std::uint8_t {
  mxfp4,       // E2M1 elements, E8M0 scale per 32
  mxfp6_e2m3,  // E2M3 elements, E8M0 scale per 32
  mxfp6_e3m2,  // E3M2 elements, E8M0 scale per 32
  mxfp8_e4m3,  // E4M3 elements, E8M0 scale per 32
  mxfp8_e5m2,  // E5M2 elements, E8M0 scale per 32
  mxint8,      // INT8 elements (value = int * 2^-6), E8M0 scale per 32
  nvfp4,       // E2M1 elements, E4M3 scale per 16, fp32 tensor scale
  nvfp4_e5m3,  // E2M1 elements, UE5M3 scale per 16 (or 32), no tensor scale (the vllm-qdq-plugin's)
};

// How the per-block scale is chosen (docs/numerics.md, "MX block scales").
enum class ScaleRule : std::uint8_t {
  floor,           // floor(log2 amax) - emax_elem   (OCP MX v1.0)
  ceil,            // ceil(log2 amax) - emax_elem
  even,            // floor(log2 RNE_mbits(amax)) - emax_elem
  rceil,           // ceil(log2(amax / max_elem))    (cuBLAS / TransformerEngine MXFP8)
  even_fp4,        // floor(log2 RNE_1(amax)) - emax_elem: even at E2M1's mantissa width, whatever the
                   // element (compressed-tensors' MX scales: its MXFP8 rule; for MXFP4 it equals even)
  quest,           // floor(log2(sigma * 2.92247856 / 6 + 1e-8))   (QuTLASS quest); with Format::nvfp4:
                   // E4M3_RN_sat(sigma * 2.92247856 / 6 + 1e-8) per block of 16, tensor scale 1
                   // (QuTLASS fusedQuantizeNv method "quest")
  qutlass_absmax,  // floor(log2(amax + 1e-8)); elements E(3 * x * 2^-e)   (QuTLASS abs_max)
  nvfp4,           // the NVFP4 recipe (E4M3 block scale, fp32 tensor scale); only with Format::nvfp4
  nvfp4_e5m3,      // UE5M3_RNE_sat(amax / 6), elements E2M1(x / s)   (vllm-qdq-plugin); only with
                   // Format::nvfp4_e5m3
};

enum class Rounding : std::uint8_t { nearest_even, stochastic };

// A rotation applied to each group of rotation_size elements before quantization (docs/numerics.md,
// "Rotation"): the normalised Hadamard transform, the randomised one (random signs from a seed), or
// a matrix given at run time (QuantOptions::rotation_matrix; every backend, the same bytes).
enum class Rotation : std::uint8_t { none, hadamard, random_hadamard, matrix };

// How Rotation::matrix computes g @ R for quantize and qdq (and NVFP4's computed tensor scale, the amax
// of the rotated tensor) (docs/numerics.md, "Runtime RS x RS matrices"):
//   exact: each element summed in double in index order and rounded once to fp32: every backend, the
//          same bytes (on the GPU: the FP64 tensor cores, far below memory speed at RS >= 64);
//   bf16:  bf16 data and a bf16 R (RS <= 128), the exact products summed in fp32 by the GPU's bf16
//          tensor cores in their own order: each element within RS * 2^-20 * sum_i |g_i R_ij| (+ RS *
//          2^-126) of the exact value while the partial sums stay in fp32's range (a group whose
//          partial sums overflow may give an infinity where the exact sum is finite), at memory speed.
//          The CPU backends compute the exact value (it is within the bound), so codes and scales may
//          differ between CPU and GPU where a value lies within the bound of a rounding boundary
//          (rotation_test traces every difference).
// dequantize's R^-1 is always summed exactly.
enum class MatrixPrecision : std::uint8_t { exact, bf16 };

// Scale tensor layout: linear [rows, ceil(K/g)] row-major, or the 128x4 swizzled layout of
// cuBLAS / CUTLASS block-scaled GEMMs (rows padded to 128, columns padded to 4, padding zero).
enum class ScaleLayout : std::uint8_t { linear, swizzled };

// i32 / i64: index tensors (MoE routing); the quantization ops take the floating dtypes only.
enum class DType : std::uint8_t { f32, f16, bf16, u8, i32, i64 };

enum class Device : std::uint8_t { cpu, cuda };

// Which implementation runs an operation.
//   automatic: the fastest backend that supports the request for the data's device;
//   reference: the plain scalar CPU reference (slow, the definition of the numerics);
//   cpu:       the fast multi-threaded CPU path;
//   cuda:      the CUDA kernels (data on the GPU).
enum class Backend : std::uint8_t { automatic, reference, cpu, cuda };

// ---- errors -----------------------------------------------------------------------------------------
class Error : public std::runtime_error {
 public:
  // device_error: a CUDA call or kernel launch failed (the message carries the CUDA error string);
  // asynchronous faults of earlier work on the device surface here too.
  enum class Code { invalid_argument, unsupported, backend_unavailable, internal, device_error };
  Error(Code code, const std::string& what) : std::runtime_error(what), code_(code) {}
  Code code() const noexcept { return code_; }

 private:
  Code code_;
};

// ---- tensor views ---------------------------------------------------------------------------------
// A non-owning 2-D row-major view: `rows` rows of `cols` elements, consecutive elements of a row
// contiguous, rows `row_stride` elements apart (0 means `cols`, i.e. dense). Batched tensors are
// flattened to rows by the caller.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  Device device = Device::cpu;

  std::int64_t stride() const noexcept { return row_stride ? row_stride : cols; }

  template <class T>
  static Tensor of(T* data, DType dtype, std::int64_t rows, std::int64_t cols,
                   std::int64_t row_stride = 0, Device device = Device::cpu) {
    // NOTE: views are used for inputs and outputs alike; constness is the caller's contract.
    return Tensor{const_cast<void*>(static_cast<const void*>(data)), dtype, rows, cols, row_stride,
                  device};
  }
};

// ---- options ------------------------------------------------------------------------------------------
struct QuantOptions {
  Format format = Format::mxfp4;
  ScaleRule rule = ScaleRule::floor;
  int group_size = 0;  // 0: the format's default (32 for MX, 16 for NVFP4); else a power of two in [2, 256]
                       // (nvfp4_e5m3: 16 or 32, the plugin's)
  Rounding rounding = Rounding::nearest_even;
  std::uint64_t seed = 0;    // stochastic rounding: Philox4x32-10 key
  std::uint64_t offset = 0;  // stochastic rounding: added to each element's linear index
  // Stochastic rounding: random bits per element, 32 (exact probabilities), 16 or 8 (the rounding
  // fraction truncated to that many bits; one Philox call serves 8 or 16 elements instead of 4, as
  // hardware stochastic-rounding converts take few bits). docs/numerics.md defines each.
  int random_bits = 32;
  ScaleLayout scale_layout = ScaleLayout::linear;
  // Rotation before quantize and qdq, and its inverse after dequantize (the Hadamard modes: every
  // backend, the same bytes; the CUDA backend needs groups of 8 or more elements, Rotation::matrix
  // too): rotation_size 16, 32, 64, 128 or 256, dividing K; rotation_seed draws the signs of
  // random_hadamard.
  Rotation rotation = Rotation::none;
  int rotation_size = 0;
  std::uint64_t rotation_seed = 0;
  // Rotation::matrix: R, rotation_size x rotation_size, f32 or bf16, dense, in the memory the backend
  // reads (host memory for the CPU backends, device memory of the current device for CUDA); each group
  // g becomes g @ R, each element computed in double (products exact, added in index order) and
  // rounded once to fp32 (docs/numerics.md). rotation_inverse: R^-1 (R^T for an orthogonal R), the
  // same layout, needed by dequantize (which rotates back; R itself is needed by quantize, qdq and
  // tensor_amax only). Empty views for other rotations.
  Tensor rotation_matrix;
  Tensor rotation_inverse;
  // Rotation::matrix: how quantize, qdq and tensor_amax sum g @ R (MatrixPrecision above).
  MatrixPrecision matrix_precision = MatrixPrecision::exact;
  // NVFP4 only: the tensor ENCODE scale S (448 * 6 / amax). When absent, quantize computes it from
  // the tensor's amax; dequantize requires it.
  std::optional<float> tensor_scale;
  Backend backend = Backend::automatic;
  // CUDA backend: the cudaStream_t the operation is enqueued on (nullptr: the legacy default stream).
  // Operations never synchronise the host with it and allocate nothing, so they can be captured in
  // a CUDA graph (a capturing stream must not be the legacy default stream).
  void* stream = nullptr;
  // CUDA backend, NVFP4 without tensor_scale: 4 bytes of device memory (4-byte aligned) in which qdq
  // reduces the tensor amax (quantize uses QuantizedOut::tensor_scale instead). Operations running
  // concurrently need distinct workspaces. Not used by the CPU backends.
  void* workspace = nullptr;

  static QuantOptions mx(Format f, ScaleRule r) {
    QuantOptions o;
    o.format = f;
    o.rule = r;
    return o;
  }
  // NVFP4 with UE5M3 block scales (the vllm-qdq-plugin's nvfp4_e5m3): group_size 16 or 32, round to
  // nearest even, no tensor scale, no rotation.
  static QuantOptions nvfp4_e5m3(int group_size = 16) {
    QuantOptions o;
    o.format = Format::nvfp4_e5m3;
    o.rule = ScaleRule::nvfp4_e5m3;
    o.group_size = group_size;
    return o;
  }
  static QuantOptions nvfp4(std::optional<float> tensor_scale = std::nullopt) {
    QuantOptions o;
    o.format = Format::nvfp4;
    o.rule = ScaleRule::nvfp4;
    o.tensor_scale = tensor_scale;
    return o;
  }
};

// ---- names --------------------------------------------------------------------------------------------
std::string_view to_string(Format);
std::string_view to_string(ScaleRule);
std::string_view to_string(Rounding);
std::string_view to_string(Rotation);
std::string_view to_string(MatrixPrecision);
std::string_view to_string(ScaleLayout);
std::string_view to_string(DType);
std::string_view to_string(Backend);
std::string_view to_string(ElemType);
// Parse a name as printed by to_string; throws Error(invalid_argument) listing the valid names.
Format parse_format(std::string_view);
ScaleRule parse_rule(std::string_view);
DType parse_dtype(std::string_view);
Backend parse_backend(std::string_view);
// "none", "had<RS>" (e.g. had128) or "rhad<RS>": the rotation and its size.
std::pair<Rotation, int> parse_rotation(std::string_view);

}  // namespace mxq
