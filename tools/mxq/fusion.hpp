#pragma once
// Which weights a loader fuses into one parameter (vLLM's packed_modules_mapping and the stacked
// parameters of its weight loaders), per model family. Every member of a fused group must share one
// NVFP4 global scale: vLLM takes the largest of the members' scales for a dense layer and the first
// member's for an MoE expert's w13, so separate scales decode the other members wrongly. The table
// is docs/cli.md's "Fused projections"; fusion_test.cc checks each family.
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mxq::cli {

// Modules named `<parent>.<member>` for every member share the parameter `<parent>.<fused>`.
struct FusionRule {
  std::string fused;
  std::vector<std::string> members;
};

struct LoaderFusion {
  std::string family;  // the table's row, e.g. "bert"
  std::string source;  // what chose it: "architectures: BertModel", "model_type: bert", or why none did
  bool known = false;  // false: config.json absent or its model not in the table (the common names are used)
  std::vector<FusionRule> rules;
  // Modules whose weights the family stores transposed ([K, N], GPT-2's Conv1D): not Linear weights,
  // left unquantized.
  std::vector<std::string> transposed;
  // The layout the family's own MoE experts take when quantized, "" for none: "gpt_oss" (gpt-oss's
  // 3-D `mlp.experts.gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] written as its MXFP4
  // `_blocks` / `_scales`, docs/cli.md "gpt-oss MXFP4 experts").
  std::string experts_layout = {};
};

// The fusion rules of the model config.json describes: its `architectures` first, then `model_type`.
// Without a config, or for a model the table does not hold, the common names (q/k/v_proj,
// gate/up_proj, w1/w3) with known = false.
LoaderFusion loader_fusion(const std::optional<nlohmann::json>& config);

// Whether a module's weight is stored transposed (a leaf name of f.transposed).
bool stored_transposed(const LoaderFusion& f, const std::string& module);

// The fused parameter a module belongs to (`<parent>.<fused>`), or "" when it fuses with nothing.
std::string fused_group(const LoaderFusion& f, const std::string& module);

}  // namespace mxq::cli
