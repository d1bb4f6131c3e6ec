// The loaders' fused parameters per model family (facts read from vLLM's model definitions, 2026:
// packed_modules_mapping and the stacked_params_mapping of load_weights; no code taken from them).
#include "fusion.hpp"

#include <algorithm>

namespace mxq::cli {

namespace {

using json = nlohmann::json;

const FusionRule kQkv{"qkv_proj", {"q_proj", "k_proj", "v_proj"}};
const FusionRule kGateUp{"gate_up_proj", {"gate_proj", "up_proj"}};

struct Family {
  const char* name;
  std::vector<std::string> architectures, model_types;
  std::vector<FusionRule> rules;
  std::vector<std::string> transposed = {};
  const char* experts_layout = "";
};

// NOTE: a rule only groups modules that exist, so a family whose checkpoints already hold a fused
// tensor (Phi-3's qkv_proj / gate_up_proj) may share the llama row: nothing of it matches.
const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      // q/k/v -> qkv_proj, gate/up -> gate_up_proj (dense MLPs, every MoE expert, shared experts)
      {"llama-like",
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
        "PhiForCausalLM", "GraniteForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "OlmoeForCausalLM",
        "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM", "GPTJForCausalLM", "OPTForCausalLM",
        "MiniCPMForCausalLM", "NemotronForCausalLM", "StableLmForCausalLM", "BaichuanForCausalLM",
        "DeepseekForCausalLM", "InternLMForCausalLM", "Qwen2ForSequenceClassification", "LlamaForSequenceClassification",
        "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration", "Mistral3ForConditionalGeneration"},
       {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "phi",
        "granite", "olmo", "olmo2", "olmoe", "cohere", "cohere2", "starcoder2", "gptj", "opt", "minicpm", "nemotron",
        "stablelm", "baichuan", "deepseek", "internlm", "gemma3", "llava", "qwen2_vl", "qwen2_5_vl", "mistral3"},
       {kQkv, kGateUp}},
      // MoE experts named w1 (gate) / w2 (down) / w3 (up): each expert's w1 and w3 -> w13
      {"mixtral",
       {"MixtralForCausalLM", "PhiMoEForCausalLM"},
       {"mixtral", "phimoe"},
       {kQkv, {"w13", {"w1", "w3"}}}},
      // multi-head latent attention: q_a_proj and kv_a_proj_with_mqa -> fused_qkv_a_proj (when
      // q_lora_rank is set; without it there is no q_a_proj)
      {"deepseek-v2/v3",
       {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM"},
       {"deepseek_v2", "deepseek_v3", "kimi_k2"},
       {kGateUp, {"fused_qkv_a_proj", {"q_a_proj", "kv_a_proj_with_mqa"}}}},
      // attention.self.{query,key,value} -> qkv_proj (RoBERTa and XLM-R load through the BERT code)
      {"bert",
       {"BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification", "RobertaModel",
        "RobertaForMaskedLM", "RobertaForSequenceClassification", "XLMRobertaModel", "XLMRobertaForMaskedLM",
        "XLMRobertaForSequenceClassification"},
       {"bert", "roberta", "xlm-roberta"},
       {{"qkv_proj", {"query", "key", "value"}}}},
      // wqkv is one tensor already; feed_forward.w1 / w3 -> gate_up_proj
      {"internlm2", {"InternLM2ForCausalLM"}, {"internlm2"}, {{"gate_up_proj", {"w1", "w3"}}}},
      // Qwen (v1): c_attn is one tensor already; mlp.w2 and mlp.w1 -> gate_up_proj (w2 is NOT a down
      // projection here, as it is in Mixtral)
      {"qwen-v1", {"QWenLMHeadModel"}, {"qwen"}, {{"gate_up_proj", {"w1", "w2"}}}},
      // q/k/v (and the MLP input) stored fused already: nothing shares a scale
      {"fused-in-checkpoint",
       {"GPTBigCodeForCausalLM", "FalconForCausalLM", "GPTNeoXForCausalLM", "BloomForCausalLM", "MPTForCausalLM",
        "DbrxForCausalLM", "ChatGLMModel", "ChatGLMForConditionalGeneration"},
       {"gpt_bigcode", "falcon", "gpt_neox", "bloom", "mpt", "dbrx", "chatglm"},
       {}},
      // GPT-2: c_attn is one tensor, and its Conv1D weights are [K, N] (loaders transpose them)
      {"gpt2", {"GPT2LMHeadModel", "GPT2Model"}, {"gpt2"}, {}, {"c_attn", "c_proj", "c_fc"}},
      // gpt-oss: q/k/v -> qkv_proj; its experts are 3-D tensors ([E, H, 2I] gate/up interleaved, [E, I, H]),
      // which --format mxfp4 writes in gpt-oss's own MXFP4 layout (the only one its loaders read)
      {"gpt-oss", {"GptOssForCausalLM"}, {"gpt_oss"}, {kQkv}, {}, "gpt_oss"},
  };
  return kFamilies;
}

bool in(const std::vector<std::string>& names, const std::string& s) {
  return std::find(names.begin(), names.end(), s) != names.end();
}

}  // namespace

LoaderFusion loader_fusion(const std::optional<json>& config) {
  LoaderFusion r;
  std::vector<std::string> archs;
  std::string model_type;
  if (config) {
    if (const auto it = config->find("architectures"); it != config->end() && it->is_array())
      for (const json& a : *it)
        if (a.is_string()) archs.push_back(a.get<std::string>());
    if (const auto it = config->find("model_type"); it != config->end() && it->is_string()) model_type = it->get<std::string>();
  }
  for (const std::string& a : archs)
    for (const Family& f : families())
      if (in(f.architectures, a)) return {f.name, "architectures: " + a, true, f.rules, f.transposed, f.experts_layout};
  for (const Family& f : families())
    if (!model_type.empty() && in(f.model_types, model_type))
      return {f.name, "model_type: " + model_type, true, f.rules, f.transposed, f.experts_layout};
  r.family = "common names";
  r.rules = {kQkv, kGateUp, {"w13", {"w1", "w3"}}};
  if (!config) r.source = "no config.json";
  else {
    r.source = "architectures [";
    for (std::size_t i = 0; i < archs.size(); ++i) r.source += (i ? ", " : "") + archs[i];
    r.source += "], model_type '" + model_type + "' not in mxq's table";
  }
  return r;
}

namespace {
std::string leaf_of(const std::string& module) {
  const std::size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}
}  // namespace

bool stored_transposed(const LoaderFusion& f, const std::string& module) { return in(f.transposed, leaf_of(module)); }

std::string fused_group(const LoaderFusion& f, const std::string& module) {
  const std::size_t dot = module.rfind('.');
  const std::string leaf = leaf_of(module);
  const std::string parent = dot == std::string::npos ? "" : module.substr(0, dot + 1);
  for (const FusionRule& r : f.rules)
    if (std::find(r.members.begin(), r.members.end(), leaf) != r.members.end()) return parent + r.fused;
  return "";
}

}  // namespace mxq::cli
