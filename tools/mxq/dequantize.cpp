// `mxq dequantize`: a compressed-tensors checkpoint (what `mxq quantize` writes) back to bf16, f16 or
// f32 weights, a rotated one rotated back, its quantization_config dropped from config.json.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_pipeline.hpp"
#include "checkpoint_publish.hpp"
#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "compressed_tensors.hpp"
#include "engine.hpp"
#include "fail.hpp"
#include "json_limits.hpp"
#include "safetensors.hpp"
#include "staging.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

int run_dequantize(const DequantizeArgs& a) {
  const DType odt = a.dtype == "bf16" ? DType::bf16 : a.dtype == "f16" ? DType::f16 : a.dtype == "f32" ? DType::f32 : DType::u8;
  if (odt == DType::u8) fail("--dtype '" + a.dtype + "': expected bf16, f16 or f32");
  const char* st_dt = odt == DType::bf16 ? "BF16" : odt == DType::f16 ? "F16" : "F32";
  const int ob = odt == DType::f32 ? 4 : 2;
  Engine eng(a.device);
  const Checkpoint c = open_checkpoint(a.in);
  std::optional<json> config = read_config(c, a.in);
  // gpt-oss's MXFP4 experts layout (what `mxq quantize --format mxfp4` writes for gpt-oss) is not a
  // compressed-tensors one: refused, rather than copying its blocks under a config that no longer says so.
  if (config && config->is_object() && config->contains("quantization_config")) {
    const json& qc = (*config)["quantization_config"];
    if (qc.is_object() && qc.contains("quant_method") && qc["quant_method"].is_string() && qc["quant_method"] == "mxfp4")
      fail(a.in + ": config.json's quantization_config has quant_method 'mxfp4' (gpt-oss's MXFP4 experts layout); "
           "mxq dequantize converts compressed-tensors checkpoints only");
  }
  // A rotated checkpoint: its weights are W @ (H / sqrt(n)); they are rotated back, the transform's
  // matrix dropped, and the config no longer names the transform.
  const CheckpointRotation rot = checkpoint_rotation(c, config, a.in);
  check_output(fs::path(a.in), fs::path(a.out), a.overwrite);
  Staging stage{fs::path(a.out), a.overwrite};
  const fs::path& out = stage.dir();
  fmt::print("device: {} ({})\n", eng.name(), eng.why());
  if (rot.size) fmt::print("rotation: hadamard, blocks of {} (transform_config scheme '{}'): rotated back\n", rot.size, rot.scheme);
  json weight_map = json::object();
  std::int64_t n_deq = 0;
  for (const std::string& shard : c.shards) {
    check_interrupted();
    const std::string path = (c.dir / shard).string();
    const st::File f(path);
    const st::View& v = f.view();
    const std::map<std::string, QuantizedModule> mods = quantized_modules(v, path);
    std::set<std::string> consumed;
    for (const auto& [m, md] : mods) {
      consumed.insert(md.codes->name);
      consumed.insert(md.scale->name);
      if (md.global) consumed.insert(md.global->name);
    }
    for (const st::TensorInfo& t : v.tensors()) {
      if (t.name.ends_with(".mlp.experts.gate_up_proj_blocks") || t.name.ends_with(".mlp.experts.down_proj_blocks"))
        fail(path + ": tensor '" + t.name + "' is in gpt-oss's MXFP4 experts layout; mxq dequantize converts "
             "compressed-tensors checkpoints only");
      if (rot.is_matrix(t.name)) {  // the transform's matrix: not part of the model
        consumed.insert(t.name);
        // ... but what it is: a matrix of another size than head_dim says which transform is wrong
        if (t.name.ends_with("_input.weight") &&
            (t.shape.size() != 2 || t.shape[0] != rot.size || t.shape[1] != rot.size))
          fail(path + ": tensor '" + t.name + "' is the transform's matrix, of shape " + st::shape_text(t.shape) +
               ", but transform_config's head_dim is " + std::to_string(rot.size) + " (a [" + std::to_string(rot.size) +
               ", " + std::to_string(rot.size) + "] matrix): the checkpoint contradicts itself");
      }
      const std::string module = t.name.ends_with(".weight") ? t.name.substr(0, t.name.size() - 7) : "";
      if (rot.size && !consumed.count(t.name) && t.shape.size() == 2 && !module.empty() && rot.rotates(module) &&
          !mods.count(module))
        fail(path + ": tensor '" + t.name + "' is not quantized and the transform_config rotates its module's weight "
             "(not in its ignore list): mxq undoes the rotation of quantized weights only");
    }
    st::Writer w((out / shard).string());
    w.metadata("format", "pt");
    for (const st::TensorInfo& t : v.tensors()) {
      if (consumed.count(t.name)) continue;
      w.declare(t.name, t.dtype, t.shape);
      weight_map[t.name] = shard;
    }
    for (const auto& [m, md] : mods) {
      w.declare(m + ".weight", st_dt, {md.N, md.K});
      weight_map[m + ".weight"] = shard;
    }
    for (const st::TensorInfo& t : v.tensors())
      if (!consumed.count(t.name)) w.write(t.name, v.data(t));
    for (const auto& [m, md] : mods) {
      check_interrupted();
      std::vector<std::uint8_t> y(md.N * md.K * ob);
      if (rot.rotates(m) && md.K % rot.size != 0)
        fail(path + ": module '" + m + "': K = " + std::to_string(md.K) + " is not a multiple of the transform's head_dim " +
             std::to_string(rot.size));
      dequantize_module(eng, v, path, m, rot.rotates(m) ? rot.undone(md) : md, odt, y.data());
      w.write(m + ".weight", y);
      ++n_deq;
    }
    w.commit();
  }
  if (c.index) {
    json idx = *c.index;
    idx["weight_map"] = weight_map;
    write_text(out / "model.safetensors.index.json", dump_json(idx) + "\n");
  }
  if (config) {
    json& cfg = *config;
    cfg.erase("quantization_config");
    copy_side_files(c, out, {"config.json"});
    write_text(out / "config.json", dump_json(cfg) + "\n");
  }
  stage.publish();
  fmt::print("dequantized {} modules to {}; peak memory {} MiB\n", n_deq, a.dtype, peak_rss_mib());
  return 0;
}

}  // namespace mxq::cli
