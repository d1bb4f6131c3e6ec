#include "compressed_tensors.hpp"

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "fail.hpp"
#include "json_limits.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

QuantOptions with_rotation(QuantOptions o, Rotation r, int n, std::uint64_t seed) {
  o.rotation = r;
  o.rotation_size = n;
  o.rotation_seed = seed;
  return o;
}

// ---- the writer -------------------------------------------------------------------------------------

const char* compressed_tensors_format(Format f) {
  return f == Format::nvfp4 ? "nvfp4-pack-quantized" : f == Format::mxfp8_e4m3 ? "mxfp8-quantized" : "mxfp4-pack-quantized";
}

std::vector<TensorDecl> quantized_tensors(Format f, const std::string& module, std::int64_t N, std::int64_t K) {
  const int g = f == Format::nvfp4 ? 16 : 32;
  std::vector<TensorDecl> d;
  if (f == Format::mxfp8_e4m3) d.push_back({module + ".weight", "F8_E4M3", {N, K}});
  else d.push_back({module + ".weight_packed", "U8", {N, K / 2}});
  d.push_back({module + ".weight_scale", f == Format::nvfp4 ? "F8_E4M3" : "U8", {N, K / g}});
  if (f == Format::nvfp4) d.push_back({module + ".weight_global_scale", "F32", {1}});
  return d;
}

std::string rotation_matrix_name(const std::string& module) { return module + "." + kRotationScheme + "_input.weight"; }

std::vector<float> hadamard_matrix(int n) {
  std::vector<float> h(std::size_t(n) * n);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) h[std::size_t(i) * n + j] = (__builtin_popcount(unsigned(i & j)) & 1) ? -1.0f : 1.0f;
  return h;
}

json gpt_oss_quantization_config(const std::vector<std::string>& ignore) {
  return json{{"quant_method", "mxfp4"}, {"modules_to_not_convert", ignore}};
}

json quantization_config(Format format, const std::vector<std::string>& ignore, int rotation_size) {
  const int g = format == Format::nvfp4 ? 16 : 32;
  const std::string ct_format = compressed_tensors_format(format);
  json weights = {{"num_bits", format == Format::mxfp8_e4m3 ? 8 : 4},
                  {"type", "float"},
                  {"strategy", format == Format::nvfp4 ? "tensor_group" : "group"},
                  {"group_size", g},
                  {"symmetric", true},
                  {"dynamic", false},
                  {"scale_dtype", format == Format::nvfp4 ? "torch.float8_e4m3fn" : "torch.uint8"}};
  json qc = {{"quant_method", "compressed-tensors"},
             {"format", ct_format},
             {"quantization_status", "compressed"},
             {"ignore", ignore},
             {"config_groups",
              {{"group_0",
                {{"targets", {"Linear"}},
                 {"format", ct_format},
                 {"weights", weights},
                 {"input_activations", nullptr},
                 {"output_activations", nullptr}}}}},
             {"kv_cache_scheme", nullptr},
             {"sparsity_config", json::object()},
             {"transform_config", json::object()},
             {"global_compression_ratio", nullptr}};
  if (rotation_size) {
    // compressed-tensors' TransformConfig (docs/cli.md "--rotate"): the input of every quantized Linear
    // rotated online by H / sqrt(RS) per head_dim = RS block, the weight's input side already rotated.
    const json ign = ignore;
    qc["transform_config"] = {
        {"config_groups",
         {{kRotationScheme,
           {{"type", "hadamard"},
            {"apply",
             {{{"targets", {"Linear"}}, {"location", "input"}, {"inverse", false}, {"ignore", ign}},
              {{"targets", {"Linear"}}, {"location", "weight_input"}, {"inverse", true}, {"ignore", ign}}}},
            {"randomize", false},
            {"requires_grad", false},
            {"head_dim", rotation_size},
            {"precision", "torch.float32"}}}}}};
  }
  return qc;
}

std::string config_with_quantization(json cfg, const json& qc) {
  cfg["quantization_config"] = qc;
  // transformers' default loading decompresses compressed-tensors weights to bf16 and, for a model
  // whose config names no dtype, builds the rest in fp32: its first forward pass then fails mixing
  // the two. A config without a dtype gets the one the decompressed weights have; an explicit other
  // dtype is the user's and stays, with a note (docs/cli.md says what to pass instead).
  const auto dtype_of = [&](const char* k) { return cfg.contains(k) && cfg[k].is_string() ? cfg[k].get<std::string>() : ""; };
  const std::string dt = !dtype_of("torch_dtype").empty() ? dtype_of("torch_dtype") : dtype_of("dtype");
  if (dt.empty()) {
    cfg["torch_dtype"] = "bfloat16";
    fmt::print("config.json: torch_dtype bfloat16 added (it named no dtype; the decompressed weights are bf16)\n");
  } else if (dt != "bfloat16") {
    fmt::print(stderr, "mxq: note: config.json says dtype {}; transformers decompresses these weights to bf16 and "
               "cannot run them in {} unless loaded with CompressedTensorsConfig(dequantize=True) or "
               "torch_dtype=torch.bfloat16 (docs/cli.md)\n", dt, dt);
  }
  return dump_json(cfg) + "\n";
}

// ---- the reader -------------------------------------------------------------------------------------

std::map<std::string, QuantizedModule> quantized_modules(const st::View& v, const std::string& path) {
  std::map<std::string, QuantizedModule> mods;
  for (const st::TensorInfo& t : v.tensors()) {
    if (!t.name.ends_with(".weight_scale")) continue;
    const std::string m = t.name.substr(0, t.name.size() - 13);
    const st::TensorInfo* packed = v.find(m + ".weight_packed");
    const st::TensorInfo* w8 = v.find(m + ".weight");
    const st::TensorInfo* gs = v.find(m + ".weight_global_scale");
    QuantizedModule md{};
    if (packed) md = {gs ? Format::nvfp4 : Format::mxfp4, packed, &t, gs, 0, 0, {}};
    else if (w8 && w8->dtype == "F8_E4M3") md = {Format::mxfp8_e4m3, w8, &t, nullptr, 0, 0, {}};
    else fail(path + ": tensor '" + t.name + "' has no X.weight_packed or F8_E4M3 X.weight beside it in this file");
    if (md.codes->shape.size() != 2 || t.shape.size() != 2)
      fail(path + ": tensor '" + md.codes->name + "': expected 2-D codes and scales");
    // The dtypes compressed-tensors writes, so that no bytes are reinterpreted (an F32 "packed" tensor
    // is not codes): FP4 codes U8; scales U8 (E8M0) or F8_E4M3 (NVFP4); the global scale one F32.
    const auto expect_dtype = [&](const st::TensorInfo& x, const char* dt, const char* what) {
      if (x.dtype != dt)
        fail(path + ": tensor '" + x.name + "': dtype " + x.dtype + ", expected " + dt + " (" + what + " of " +
             std::string(to_string(md.format)) + ")");
    };
    if (md.format != Format::mxfp8_e4m3) expect_dtype(*md.codes, "U8", "packed E2M1 codes");
    expect_dtype(t, md.format == Format::nvfp4 ? "F8_E4M3" : "U8",
                 md.format == Format::nvfp4 ? "E4M3 block scales" : "E8M0 block scales");
    if (gs) expect_dtype(*gs, "F32", "the global encode scale");
    md.N = md.codes->shape[0];
    md.K = md.format == Format::mxfp8_e4m3 ? md.codes->shape[1] : 2 * md.codes->shape[1];
    md.options = md.format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(md.format, ScaleRule::even);
    if (gs) {
      if (gs->bytes() != 4) fail(path + ": tensor '" + gs->name + "': expected one F32");
      float S;
      std::memcpy(&S, v.data(*gs).data(), 4);
      md.options.tensor_scale = S;
    }
    const Shape2 ss = scale_shape(md.options, md.N, md.K);
    if (t.shape[0] != ss.rows || t.shape[1] != ss.cols)
      fail(path + ": tensor '" + t.name + "': shape does not match codes of [" + std::to_string(md.N) + ", " +
           std::to_string(md.K) + "]");
    mods[m] = md;
  }
  return mods;
}

void dequantize_module(Engine& eng, const st::View& v, const std::string& path, const std::string& name,
                       const QuantizedModule& m, DType odt, void* y) {
  const Shape2 ss = scale_shape(m.options, m.N, m.K);
  try {
    eng.dequantize(QuantizedIn{Tensor::of(const_cast<std::uint8_t*>(v.data(*m.codes).data()), DType::u8, m.N, code_cols(m.format, m.K)),
                           Tensor::of(const_cast<std::uint8_t*>(v.data(*m.scale).data()), DType::u8, ss.rows, ss.cols)},
               Tensor::of(y, odt, m.N, m.K), m.options);
  } catch (const std::exception& e) {
    fail(path + ": module '" + name + "': " + e.what());
  }
}

CheckpointRotation checkpoint_rotation(const Checkpoint& c, const std::optional<json>& config, const std::string& in) {
  CheckpointRotation r;
  json qc;
  std::string where;
  if (config && config->contains("quantization_config")) {
    qc = (*config)["quantization_config"], where = (c.dir / "config.json").string();
  } else if (!fs::is_directory(in) && fs::exists(c.dir / "quantization_config.json")) {
    qc = read_json_file(c.dir / "quantization_config.json"), where = (c.dir / "quantization_config.json").string();
  }
  if (!qc.is_object() || !qc.contains("transform_config") || !qc["transform_config"].is_object()) return r;
  const json& tc = qc["transform_config"];
  if (!tc.contains("config_groups") || !tc["config_groups"].is_object() || tc["config_groups"].empty()) return r;
  auto refuse = [&](const std::string& why) {
    fail(where + ": transform_config: " + why + "; mxq undoes only the hadamard transform `mxq quantize --rotate` writes "
         "(docs/cli.md)");
  };
  if (tc["config_groups"].size() != 1) refuse("more than one transform scheme");
  const auto first = tc["config_groups"].begin();  // an iterator kept alive (items()' proxy was a temporary)
  const std::string scheme = first.key();
  const json& g = first.value();
  if (!g.is_object() || g.value("type", std::string()) != "hadamard") refuse("scheme '" + scheme + "' is not of type hadamard");
  if (g.value("randomize", false)) refuse("scheme '" + scheme + "' is randomized");
  const json hd = g.value("head_dim", json());
  const auto valid_size = [](int n) { return n >= 16 && n <= 256 && (n & (n - 1)) == 0; };
  if (!hd.is_number_integer() || !valid_size(hd.get<int>()))
    refuse("scheme '" + scheme + "': head_dim " + hd.dump() + " (mxq rotates blocks of 16, 32, 64, 128 or 256)");
  bool weight_input = false;
  for (const json& ap : g.value("apply", json::array())) {
    const std::string loc = ap.value("location", std::string());
    if (loc != "input" && loc != "weight_input") refuse("scheme '" + scheme + "' applies at '" + loc + "'");
    if (ap.value("targets", json()) != json::array({"Linear"})) refuse("scheme '" + scheme + "' targets other than [\"Linear\"]");
    for (const json& i : ap.value("ignore", json::array())) {
      if (!i.is_string() || i.get<std::string>().starts_with("re:")) refuse("an ignore entry that is not a module name");
      if (loc == "weight_input") r.ignore.insert(i.get<std::string>());
    }
    weight_input |= loc == "weight_input";
  }
  if (!weight_input) return r;  // nothing fused into the weights: they are the model's own
  r.size = hd.get<int>();
  r.scheme = scheme;
  return r;
}

}  // namespace mxq::cli
