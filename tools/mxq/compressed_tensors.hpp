#pragma once
// The compressed-tensors layout vLLM and transformers load, both ways: what `mxq quantize` writes
// (a quantized Linear weight's tensors, the quantization_config, the transform_config and matrix of
// --rotate) and what `mxq dequantize`, `mxq inspect --against` and `mxq merge` read back (the
// quantized modules of a file, the rotation a checkpoint's weights carry). docs/cli.md lists the
// layout.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_read.hpp"
#include "engine.hpp"
#include "safetensors.hpp"

namespace mxq::cli {

// The name of mxq's transform scheme in compressed-tensors' transform_config (and of its matrix tensor,
// <module>.mxq_input.weight).
constexpr const char* kRotationScheme = "mxq";

// o with rotation r of size n (seed: random_hadamard's signs).
QuantOptions with_rotation(QuantOptions o, Rotation r, int n, std::uint64_t seed = 0);

// ---- the writer -------------------------------------------------------------------------------------

// The checkpoint format name of each layout mxq writes (quantization_config's "format").
const char* compressed_tensors_format(Format f);  // mxfp4, mxfp8_e4m3 or nvfp4

// One tensor of a shard's header as it is declared.
struct TensorDecl {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
};

// The tensors a quantized [N, K] weight of `module` becomes, in the order they are declared and
// written: its codes (X.weight_packed U8 of E2M1 pairs; MXFP8: X.weight F8_E4M3), X.weight_scale
// (E8M0 as U8; NVFP4: F8_E4M3) and NVFP4's X.weight_global_scale (one F32).
std::vector<TensorDecl> quantized_tensors(Format f, const std::string& module, std::int64_t N, std::int64_t K);

// The transform's +-1 matrix tensor, stored beside `module` (the first rotated one).
std::string rotation_matrix_name(const std::string& module);
// The Sylvester Hadamard matrix of order n, entries +-1 (the loader normalises), row-major.
std::vector<float> hadamard_matrix(int n);

// The quantization_config of format f: one group of every Linear, the modules of `ignore` left
// alone; rotation_size > 0 adds the transform_config of `mxq quantize --rotate had<RS>` (every
// quantized Linear's input rotated online, its weight's input side already rotated; the same
// ignore list).
nlohmann::json quantization_config(Format f, const std::vector<std::string>& ignore, int rotation_size);

// gpt-oss's own MXFP4 quantization_config (transformers' Mxfp4Config, vLLM's gpt-oss loader):
// {"quant_method": "mxfp4", "modules_to_not_convert": ignore}.
nlohmann::json gpt_oss_quantization_config(const std::vector<std::string>& ignore);

// config.json with quantization_config qc, as text to write. A config that names no dtype gets
// bfloat16 (the decompressed weights' dtype; said on stdout); an explicit other dtype stays, with a
// note on stderr.
std::string config_with_quantization(nlohmann::json cfg, const nlohmann::json& qc);

// ---- the reader -------------------------------------------------------------------------------------

// A quantized module of a compressed-tensors file: X.weight_scale beside X.weight_packed (FP4; NVFP4
// when X.weight_global_scale is there too) or beside an F8_E4M3 X.weight (MXFP8).
struct QuantizedModule {
  Format format;
  const st::TensorInfo *codes, *scale, *global;  // global: NVFP4 only
  std::int64_t N, K;                             // the weight's shape
  QuantOptions options;                          // what dequantizes it (NVFP4: with its tensor scale)
};

// The quantized modules of one file, by name. A scale without its codes, a global scale that is not
// one F32, or shapes that do not fit together fail with one line naming the tensor.
std::map<std::string, QuantizedModule> quantized_modules(const st::View& v, const std::string& path);

// Dequantizes one module into y ([N, K] of dtype odt), reading codes and scales in place (bytes need
// no alignment).
void dequantize_module(Engine& eng, const st::View& v, const std::string& path, const std::string& name,
                       const QuantizedModule& m, DType odt, void* y);

// The rotation a quantized checkpoint's weights carry: compressed-tensors' transform_config as `mxq
// quantize --rotate` writes it (one hadamard scheme, online input + weight_input, exact names in
// ignore), found in config.json or, beside a lone file, in quantization_config.json. size 0: none.
// Anything else that rotates weights is refused: mxq could not undo it.
struct CheckpointRotation {
  int size = 0;
  std::string scheme;
  std::set<std::string> ignore;  // modules whose weights are not rotated
  bool rotates(const std::string& module) const { return size && !ignore.count(module); }
  // A module's decoding options with the rotation undone by its dequantize.
  QuantizedModule undone(QuantizedModule md) const {
    md.options = with_rotation(md.options, Rotation::hadamard, size);
    return md;
  }
  // The matrix tensors of the scheme (not weights): <module>.<scheme>_input.weight and the like.
  bool is_matrix(const std::string& name) const {
    return size && (name.ends_with("." + scheme + "_input.weight") || name.ends_with("." + scheme + "_output.weight") ||
                    name.ends_with("." + scheme + "_input.perm"));
  }
};
CheckpointRotation checkpoint_rotation(const Checkpoint& c, const std::optional<nlohmann::json>& config, const std::string& in);

}  // namespace mxq::cli
