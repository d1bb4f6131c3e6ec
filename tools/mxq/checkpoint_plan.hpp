#pragma once
// What `mxq quantize` and `mxq qdq` make of each tensor of a checkpoint, decided from the shards'
// headers alone (names, dtypes, shapes) and the options: which weights are quantized and why the
// others are not, the config's ignore list, which module carries the rotation's matrix, and (given
// the weights' amax) the fused groups' shared NVFP4 global scales. Nothing here reads a file:
// checkpoint_plan_test.cc gives it tables.
#include <cstddef>
#include <cstdint>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <mxq/mxq.hpp>

#include "engine.hpp"
#include "fusion.hpp"

namespace mxq::cli {

// One tensor of a shard's header; a plan takes them shard by shard in the checkpoint's order, each
// shard's in its header's order.
struct TensorEntry {
  std::string shard, name, dtype;
  std::vector<std::int64_t> shape;
};

struct PlanOptions {
  Format format = Format::mxfp4;
  bool fake = false;                          // mxq qdq: a fake-quantized copy, no compressed-tensors layout
  std::vector<std::regex> include, exclude;   // user_pattern's
  std::pair<Rotation, int> rotation{Rotation::none, 0};
  LoaderFusion fusion;                        // the loader's fused projections (loader_fusion)
};

struct TensorPlan {
  bool quantize = false;
  std::string why;  // why not
  // A gpt-oss experts tensor X ([E, K, N], stored transposed) quantized along K into gpt-oss's MXFP4
  // layout: X_blocks U8 [E, N, K/32, 16] and X_scales U8 [E, N, K/32] (gpt_oss_experts_tensors).
  bool gpt_oss_experts = false;
};

// The two tensors gpt-oss's MXFP4 layout stores for the experts tensor `name` of shape [E, K, N].
struct ExpertsDecl {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
};
// Whether a conversion writes gpt-oss's own MXFP4 experts layout and config (docs/cli.md): MXFP4, not fake,
// a model of the gpt-oss family. plan_quantize decides it; merge decides it again from a part's manifest.
inline bool gpt_oss_layout(bool fake, bool mxfp4, const LoaderFusion& fusion) {
  return !fake && mxfp4 && fusion.experts_layout == "gpt_oss";
}
std::vector<ExpertsDecl> gpt_oss_experts_tensors(const std::string& name, const std::vector<std::int64_t>& shape);
// gpt-oss's experts tensors: X.mlp.experts.gate_up_proj / down_proj.
bool gpt_oss_experts_name(const std::string& name);

struct QuantizePlan {
  std::map<std::string, TensorPlan> tensors;          // by "<shard>/<name>"
  std::map<std::string, std::size_t> shard_tensors;   // tensors per shard
  // quantization_config's ignore list: the modules left unquantized, sorted, "lm_head" always in it.
  std::vector<std::string> ignore;
  // The weights left unquantized for their shape, name or fused group (the summary's last lines).
  std::vector<std::string> unfit;
  Engine::Sizes largest;  // of the conversions: the GPU engine's buffers, sized once
  // quantize --rotate: where the transform's matrix is stored, beside the first rotated module (as
  // compressed-tensors' save_pretrained does); empty when nothing is rotated.
  std::string rotation_shard, rotation_module;
  // --format mxfp4 on the gpt-oss family: the checkpoint takes gpt-oss's own MXFP4 layout (only the
  // experts quantized; config quant_method "mxfp4" with modules_to_not_convert = ignore).
  bool gpt_oss = false;
  bool quantized(const std::string& shard, const std::string& name) const { return tensors.at(shard + "/" + name).quantize; }
};

// The plan of every tensor. A 2-D floating X.weight is quantized unless vLLM expects its module
// unquantized (default_ignored), the family stores it transposed, --include/--exclude leave it out,
// its quantized names would be too long, its K does not fit the rotation or the format's group
// (quantize), or it is empty; a fused parameter holds one precision, so a member left unquantized
// leaves its whole group unquantized (quantize). quantize --rotate refuses (std::runtime_error,
// naming the tensor) what vLLM would rotate wrongly: MoE experts and Linear layers with a bias.
// gpt-oss (PlanOptions.fusion.experts_layout "gpt_oss", quantize --format mxfp4): only the experts'
// X.mlp.experts.gate_up_proj [E, H, 2I] and down_proj [E, I, H] are quantized (gpt-oss's MXFP4 layout
// holds nothing else); a malformed pair (not 3-D floating, E/H/I not matching, H or I not a multiple of
// 32, empty, one without the other) is refused (std::runtime_error naming the tensor); a pair one of
// which --include/--exclude leave out is left unquantized whole, its experts module in the ignore list.
QuantizePlan plan_quantize(const std::vector<TensorEntry>& tensors, const PlanOptions& o);

// Modules vLLM expects unquantized (docs/cli.md): the LM head, embeddings, MoE routers,
// vision towers. Plain string comparisons, no std::regex: names come from the file.
bool default_ignored(const std::string& module);

// A --include/--exclude pattern (ECMAScript), or an error naming the flag and the pattern.
std::regex user_pattern(const std::string& flag, const std::string& s);

// The amax of a fused group as tensor_amax would give it over the members' weights side by side: NaN
// if any member's is NaN, else the largest (+Inf included).
float group_amax_of(float a, float b);

// NVFP4: the amax a quantized module's global scale is computed from: its fused group's (every
// member then shares one scale, as the loader's fused parameter needs) or, fused with nothing, its own.
struct ScaleAmax {
  float amax = 0;
  std::string group;  // the fused group, "" when the module's own
};
// amax: each quantized module's tensor amax (of its rotated weight under --rotate).
std::map<std::string, ScaleAmax> global_scale_amax(const LoaderFusion& fusion, const std::map<std::string, float>& amax);

}  // namespace mxq::cli
