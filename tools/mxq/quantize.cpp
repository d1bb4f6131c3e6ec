// `mxq quantize` and `mxq qdq`: a safetensors checkpoint (one file, or a Hugging Face directory with
// model.safetensors.index.json) to the compressed-tensors layout vLLM loads, or to a fake-quantized
// copy in the weights' own dtype (docs/cli.md lists what is written). The command reads its options,
// plans from the shards' headers (checkpoint_plan), converts (checkpoint_pipeline) and writes the
// config and index (compressed_tensors, checkpoint_publish). Every output file is written into a
// staging directory and published whole, so a failure leaves no partial checkpoint.
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_pipeline.hpp"
#include "checkpoint_plan.hpp"
#include "checkpoint_publish.hpp"
#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "compressed_tensors.hpp"
#include "engine.hpp"
#include "fail.hpp"
#include "fusion.hpp"
#include "safetensors.hpp"
#include "staging.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

namespace {

// What the command line asks for, each option checked (in this order) before anything is read.
struct Request {
  Format format = Format::mxfp4;
  ScaleRule rule = ScaleRule::even;
  std::vector<std::regex> include, exclude;
  Part part;
  std::filesystem::path out_dir;  // OUT, or with --part its part's directory
  std::pair<Rotation, int> rotation{Rotation::none, 0};
};

Request request_of(const QuantizeArgs& a) {
  Request r;
  // The default MX rule is compressed-tensors' (docs/numerics.md, presets::compressed_tensors_mx):
  // even_fp4, which equals even for MXFP4; qdq of the same format uses it too, so that a fake-quantized
  // copy decodes to what the checkpoint decodes to.
  if (a.fake) {  // QDQ: every format and rule of the library
    r.format = parse_format(a.format == "mxfp8" ? "mxfp8_e4m3" : a.format);
    r.rule = r.format == Format::nvfp4        ? ScaleRule::nvfp4
             : r.format == Format::nvfp4_e5m3 ? ScaleRule::nvfp4_e5m3
             : r.format == Format::mxfp8_e4m3 ? ScaleRule::even_fp4
                                              : ScaleRule::even;
  } else if (a.format == "mxfp4") r.format = Format::mxfp4, r.rule = ScaleRule::even;
  else if (a.format == "mxfp8" || a.format == "mxfp8_e4m3")
    r.format = Format::mxfp8_e4m3, r.rule = presets::compressed_tensors_mx(Format::mxfp8_e4m3).rule;
  else if (a.format == "nvfp4") r.format = Format::nvfp4, r.rule = ScaleRule::nvfp4;
  else fail("--format '" + a.format + "': the checkpoint layouts vLLM loads are mxfp4, mxfp8 and nvfp4");
  if (!a.rule.empty()) {
    if (r.format == Format::nvfp4)
      fail("--rule: the tool's nvfp4 takes the NVFP4 recipe only (E4M3 block scales under the tensor scale); NVFP4 "
           "rule quest is in the library and the Python package");
    r.rule = parse_rule(a.rule);
    if (r.rule == ScaleRule::nvfp4 || (!a.fake && (r.rule == ScaleRule::quest || r.rule == ScaleRule::qutlass_absmax)))
      fail("--rule '" + a.rule + "': a checkpoint takes floor, ceil, even, rceil or even_fp4");
    if (const std::string why = rule_refusal(r.format, r.rule); !why.empty()) fail("--rule '" + a.rule + "': " + why);
  }
  for (const std::string& s : a.include) r.include.push_back(user_pattern("--include", s));
  for (const std::string& s : a.exclude) r.exclude.push_back(user_pattern("--exclude", s));

  if (a.gpus < 0) fail("--gpus " + std::to_string(a.gpus) + ": expected 0 (every visible GPU) or more");
  r.part = parse_part(a.part);
  r.out_dir = r.part.n ? part_dir(fs::path(a.out), r.part) : fs::path(a.out);
  if (a.rotate_seed && a.rotate.empty())
    fail("--rotate-seed " + std::to_string(*a.rotate_seed) + ": without --rotate rhad<RS> there are no random signs to seed");
  if (!a.rotate.empty()) {
    try {
      r.rotation = parse_rotation(a.rotate);
    } catch (const std::exception& e) {
      fail(std::string("--rotate: ") + e.what());
    }
    if (r.rotation.first == Rotation::none) fail("--rotate none: leave --rotate out for no rotation");
    if (r.format == Format::nvfp4_e5m3)
      fail("--rotate " + a.rotate + ": not defined for format nvfp4_e5m3 (the vllm-qdq-plugin's format has no rotation)");
    if (a.rotate_seed && r.rotation.first != Rotation::random_hadamard)
      fail("--rotate-seed " + std::to_string(*a.rotate_seed) + ": --rotate " + a.rotate +
           " has no random signs to seed (only rhad<RS> does)");
    // A rotated checkpoint is read through compressed-tensors' transform_config (docs/cli.md): only
    // what vLLM applies online is written.
    if (!a.fake && r.rotation.first == Rotation::random_hadamard)
      fail("--rotate " + a.rotate + ": `mxq quantize` writes the deterministic Hadamard only (had<RS>): vLLM ignores "
           "compressed-tensors' `randomize` and its random-hadamard matrices are not mxq's random signs");
  }
  return r;
}

// The shards' headers, in the checkpoint's order: what the plan is made from.
std::vector<TensorEntry> tensor_table(const Checkpoint& c) {
  std::vector<TensorEntry> table;
  for (const std::string& shard : c.shards) {
    const st::File f((c.dir / shard).string());
    for (const st::TensorInfo& t : f.view().tensors()) table.push_back({shard, t.name, t.dtype, t.shape});
  }
  return table;
}

}  // namespace

int run_quantize(const QuantizeArgs& a) {
  Phases ph;  // from here: the GPU's context, the checkpoint's headers and the output's set-up are "setup"
  const Request req = request_of(a);
  const fs::path& out_dir = req.out_dir;

  // A GPU is set up on a thread of its own while the checkpoint is opened and planned (and, with
  // cpu_while_gpu_sets_up, the first tensors convert on the CPU meanwhile): the device line comes
  // once the choice is settled.
  Engine eng(a.device, a.cpu_while_gpu_sets_up, a.gpus);
  DeviceLine device(eng);
  const Checkpoint c = open_checkpoint(a.in);
  std::optional<json> config = read_config(c, a.in);
  check_output(fs::path(a.in), out_dir, a.overwrite);
  Staging stage{out_dir, a.overwrite};
  device.say(0);
  PlanOptions po{req.format, a.fake, req.include, req.exclude, req.rotation, loader_fusion(config)};
  const LoaderFusion& fusion = po.fusion;
  if (!a.fake) {
    fmt::print("fused projections: {} ({})\n", fusion.family, fusion.source);
    // NOTE: NVFP4 only: there a wrong guess costs accuracy silently; for MX formats it only decides
    // which members an --exclude drags along, and a loader refuses what it cannot load.
    if (!fusion.known && req.format == Format::nvfp4)
      fmt::print(stderr, "mxq: warning: {}: the loader's fused projections are not known to mxq (docs/cli.md, \"Fused "
                 "projections\"); assuming the common names q/k/v_proj, gate/up_proj and w1/w3. A loader that fuses other "
                 "modules decodes them with another member's NVFP4 global scale\n", fusion.source);
  }

  ph.mark_setup();
  const Phases::clock::time_point plan_t0 = Phases::clock::now();
  const QuantizePlan plan = plan_quantize(tensor_table(c), po);
  eng.expect(plan.largest);  // (on the GPU's set-up thread, while the amax pass runs)
  // NVFP4: the tensor amax of each quantized weight, for the (shared) global scales
  std::map<std::string, ScaleAmax> scales;
  if (req.format == Format::nvfp4)
    scales = global_scale_amax(fusion, weight_amaxes(c, plan, req.rotation, a.rotate_seed.value_or(0)));
  ph.plan = std::chrono::duration<double>(Phases::clock::now() - plan_t0).count();

  const std::string rotated = a.rotate.empty() ? std::string() : " " + a.rotate;
  const ConvertSpec spec{req.format, req.rule, a.fake, req.rotation, a.rotate_seed.value_or(0),
                         (a.fake ? "qdq " : "") + a.format + rotated, req.part};
  Progress progress(plan.tensors.size());
  const Converted r = convert_checkpoint(eng, c, stage.dir(), plan, scales, spec, ph, progress, device);

  Finish fin;
  fin.index = c.index;
  fin.side_files = fs::is_directory(a.in);
  if (a.fake) {  // a fake-quantized checkpoint loads as the original model: every side file copied
    if (req.part.n) return finish_part(a, req.part, c, stage, fin, r.weight_map, r.bytes_out, r.n_quant, r.n_copy);
    write_finish(c, stage.dir(), fin, r.weight_map, std::uint64_t(r.bytes_out));
    stage.publish();
    fmt::print("fake-quantized {} tensors ({}), copied {} unchanged; peak memory {} MiB\n", r.n_quant, a.format, r.n_copy,
               peak_rss_mib());
    fmt::print("{}\n", ph.str());
    for (const std::string& u : plan.unfit)
      fmt::print("left unchanged (empty, stored transposed, or K not a multiple of --rotate's size): {}\n", u);
    report_not_finite(r.not_finite);
    return 0;
  }
  // config.json with the quantization_config vLLM reads (and the transform_config where a weight is rotated).
  if (req.rotation.first != Rotation::none && plan.rotation_shard.empty())
    fmt::print("--rotate: no weight is quantized, so nothing is rotated and no transform_config is written\n");
  const json qc = plan.gpt_oss ? gpt_oss_quantization_config(plan.ignore)
                               : quantization_config(req.format, plan.ignore, plan.rotation_shard.empty() ? 0 : req.rotation.second);
  if (config) {
    fin.config_name = "config.json";
    fin.config_text = config_with_quantization(*config, qc);
  } else {
    fin.side_files = false;  // a lone file: only its quantization_config.json beside it
    fin.config_name = "quantization_config.json";
    fin.config_text = dump_json(qc) + "\n";
  }
  if (req.part.n) return finish_part(a, req.part, c, stage, fin, r.weight_map, r.bytes_out, r.n_quant, r.n_copy);
  write_finish(c, stage.dir(), fin, r.weight_map, std::uint64_t(r.bytes_out));

  stage.publish();
  fmt::print("quantized {} tensors to {}, copied {} unchanged; {:.1f} MiB -> {:.1f} MiB; peak memory {} MiB\n", r.n_quant,
             a.format, r.n_copy, r.bytes_in / 1048576, r.bytes_out / 1048576, peak_rss_mib());
  fmt::print("{}\n", ph.str());
  for (const std::string& u : plan.unfit)
    fmt::print("left unquantized (empty, a shape vLLM could not load, stored transposed, or fused with a module left "
               "unquantized): {}\n", u);
  report_not_finite(r.not_finite);
  return 0;
}

}  // namespace mxq::cli
