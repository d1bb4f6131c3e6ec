// The plan of `mxq quantize` and `mxq qdq` from tables of tensors, no files: what each tensor becomes
// and why, the config's ignore list, fused groups kept at one precision, --rotate's refusals and the
// module its matrix is stored beside, the engine's largest buffers, and the fused groups' shared
// NVFP4 global-scale amax.
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_plan.hpp"
#include "fusion.hpp"
#include "safetensors.hpp"

using mxq::Format;
using mxq::Rotation;
using mxq::cli::PlanOptions;
using mxq::cli::QuantizePlan;
using mxq::cli::TensorEntry;

namespace {

constexpr const char* kA = "model-00001-of-00002.safetensors";
constexpr const char* kB = "model-00002-of-00002.safetensors";

// A Llama-like checkpoint of two shards: q/k of layer 0 in the first, v in the second (one fused
// qkv_proj across shards), and every kind of tensor a plan tells apart.
const std::vector<TensorEntry> kLlama = {
    {kA, "model.embed_tokens.weight", "BF16", {100, 128}},
    {kA, "model.layers.0.input_layernorm.weight", "BF16", {128}},
    {kA, "model.layers.0.self_attn.q_proj.weight", "BF16", {64, 128}},
    {kA, "model.layers.0.self_attn.k_proj.weight", "F16", {32, 128}},
    {kB, "model.layers.0.self_attn.v_proj.weight", "F32", {32, 128}},
    {kB, "model.layers.0.self_attn.o_proj.weight", "BF16", {128, 64}},
    {kB, "model.layers.0.mlp.gate.weight", "BF16", {8, 128}},         // an MoE router
    {kB, "model.layers.0.mlp.odd_proj.weight", "BF16", {8, 48}},      // K = 48: a multiple of 16, not of 32
    {kB, "model.layers.0.mlp.empty_proj.weight", "BF16", {0, 64}},
    {kB, "model.layers.0.mlp.codes.weight", "I8", {8, 64}},           // not floating
    {kB, "lm_head.weight", "BF16", {100, 128}},
};

PlanOptions options(Format f, bool fake = false, const char* config = R"({"architectures": ["LlamaForCausalLM"]})") {
  PlanOptions o;
  o.format = f;
  o.fake = fake;
  o.fusion = mxq::cli::loader_fusion(config ? std::optional<nlohmann::json>(nlohmann::json::parse(config)) : std::nullopt);
  return o;
}

// "" when quantized, else why not.
std::string why(const QuantizePlan& p, const std::string& shard, const std::string& name) {
  const mxq::cli::TensorPlan& t = p.tensors.at(shard + "/" + name);
  return t.quantize ? "" : t.why;
}

std::string refusal(const std::vector<TensorEntry>& table, const PlanOptions& o) {
  try {
    mxq::cli::plan_quantize(table, o);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "planned without a refusal";
  return "";
}

}  // namespace

// Every tensor's fate, for each layout and for qdq (which loads as the original model: no group
// constraint of vLLM's, any K).
TEST(CheckpointPlan, EachTensorByFormat) {
  const std::string quantized;
  const std::string not_weight = "not a 2-D floating weight", vllm = "left unquantized for vLLM (head, embedding, router, vision)";
  struct Row {
    const char* shard;
    const char* name;
    std::string mxfp4, nvfp4, qdq;
  };
  const std::vector<Row> rows = {
      {kA, "model.embed_tokens.weight", vllm, vllm, vllm},
      {kA, "model.layers.0.input_layernorm.weight", not_weight, not_weight, not_weight},
      {kA, "model.layers.0.self_attn.q_proj.weight", quantized, quantized, quantized},
      {kA, "model.layers.0.self_attn.k_proj.weight", quantized, quantized, quantized},
      {kB, "model.layers.0.self_attn.v_proj.weight", quantized, quantized, quantized},
      {kB, "model.layers.0.self_attn.o_proj.weight", quantized, quantized, quantized},
      {kB, "model.layers.0.mlp.gate.weight", vllm, vllm, vllm},
      {kB, "model.layers.0.mlp.odd_proj.weight", "K = 48 is not a multiple of 32 (vLLM could not load it)", quantized, quantized},
      {kB, "model.layers.0.mlp.empty_proj.weight", "empty weight [0, 64]", "empty weight [0, 64]", "empty weight [0, 64]"},
      {kB, "model.layers.0.mlp.codes.weight", not_weight, not_weight, not_weight},
      {kB, "lm_head.weight", vllm, vllm, vllm},
  };
  const QuantizePlan mx = mxq::cli::plan_quantize(kLlama, options(Format::mxfp4));
  const QuantizePlan nv = mxq::cli::plan_quantize(kLlama, options(Format::nvfp4));
  const QuantizePlan fq = mxq::cli::plan_quantize(kLlama, options(Format::mxfp6_e3m2, true));
  for (const QuantizePlan* p : {&mx, &nv, &fq}) ASSERT_EQ(p->tensors.size(), rows.size());
  for (const Row& r : rows) {
    EXPECT_EQ(why(mx, r.shard, r.name), r.mxfp4) << "mxfp4 " << r.name;
    EXPECT_EQ(why(nv, r.shard, r.name), r.nvfp4) << "nvfp4 " << r.name;
    EXPECT_EQ(why(fq, r.shard, r.name), r.qdq) << "qdq " << r.name;
  }
  EXPECT_EQ(mx.shard_tensors, (std::map<std::string, std::size_t>{{kA, 4}, {kB, 7}}));
  EXPECT_EQ(mx.unfit, (std::vector<std::string>{"model.layers.0.mlp.odd_proj.weight", "model.layers.0.mlp.empty_proj.weight"}));
  EXPECT_EQ(nv.unfit, (std::vector<std::string>{"model.layers.0.mlp.empty_proj.weight"}));
  // the config's ignore list: sorted, without duplicates, the modules (not tensors) left unquantized
  EXPECT_EQ(mx.ignore, (std::vector<std::string>{"lm_head", "model.embed_tokens", "model.layers.0.mlp.empty_proj",
                                                 "model.layers.0.mlp.gate", "model.layers.0.mlp.odd_proj"}));
  EXPECT_EQ(nv.ignore, (std::vector<std::string>{"lm_head", "model.embed_tokens", "model.layers.0.mlp.empty_proj",
                                                 "model.layers.0.mlp.gate"}));
  EXPECT_TRUE(mx.rotation_shard.empty() && mx.rotation_module.empty());
}

// "lm_head" is always in the ignore list (vLLM's loaders look it up there), first when the
// checkpoint has no such tensor; a module named twice is listed once.
TEST(CheckpointPlan, IgnoreListAlwaysHoldsLmHead) {
  const std::vector<TensorEntry> table = {{kA, "a.proj.weight", "BF16", {8, 64}},
                                          {kA, "z.proj.weight", "BF16", {8, 40}},
                                          {kB, "z.proj.weight", "BF16", {8, 40}},  // (open_checkpoint refuses this; the plan copes)
                                          {kB, "b.embed.weight", "BF16", {8, 64}}};
  const QuantizePlan p = mxq::cli::plan_quantize(table, options(Format::mxfp4, false, nullptr));
  EXPECT_EQ(p.ignore, (std::vector<std::string>{"lm_head", "b.embed", "z.proj"}));
  EXPECT_EQ(why(p, kA, "a.proj.weight"), "");
}

// A fused parameter holds one precision: a member left unquantized leaves every member of its
// group unquantized (in any shard), each saying why; other groups and layers are untouched. qdq
// has no such constraint.
TEST(CheckpointPlan, FusedGroupsKeepOnePrecision) {
  PlanOptions o = options(Format::nvfp4);
  o.exclude = {mxq::cli::user_pattern("--exclude", R"(k_proj)")};
  const QuantizePlan p = mxq::cli::plan_quantize(kLlama, o);
  const std::string group = "model.layers.0.self_attn.qkv_proj", k = "model.layers.0.self_attn.k_proj.weight";
  EXPECT_EQ(why(p, kA, k), "matched by --exclude");
  const std::string fused = "fused into " + group + " with " + k + ", which is left unquantized";
  EXPECT_EQ(why(p, kA, "model.layers.0.self_attn.q_proj.weight"), fused);
  EXPECT_EQ(why(p, kB, "model.layers.0.self_attn.v_proj.weight"), fused);
  EXPECT_EQ(why(p, kB, "model.layers.0.self_attn.o_proj.weight"), "");
  EXPECT_EQ(p.unfit, (std::vector<std::string>{"model.layers.0.mlp.empty_proj.weight",
                                               "model.layers.0.self_attn.q_proj.weight (" + fused + ")",
                                               "model.layers.0.self_attn.v_proj.weight (" + fused + ")"}));
  EXPECT_EQ(p.ignore, (std::vector<std::string>{"lm_head", "model.embed_tokens", "model.layers.0.mlp.empty_proj",
                                                "model.layers.0.mlp.gate", "model.layers.0.self_attn.k_proj",
                                                "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}));
  o.fake = true;
  const QuantizePlan f = mxq::cli::plan_quantize(kLlama, o);
  EXPECT_EQ(why(f, kA, k), "matched by --exclude");
  EXPECT_EQ(why(f, kA, "model.layers.0.self_attn.q_proj.weight"), "");
  EXPECT_EQ(why(f, kB, "model.layers.0.self_attn.v_proj.weight"), "");
}

// --include keeps only what matches (searched anywhere in the name); --exclude wins over it.
TEST(CheckpointPlan, IncludeAndExclude) {
  PlanOptions o = options(Format::mxfp4, true);
  o.include = {mxq::cli::user_pattern("--include", R"(self_attn\.(q|o)_proj)"), mxq::cli::user_pattern("--include", "odd")};
  o.exclude = {mxq::cli::user_pattern("--exclude", "^model\\.layers\\.0\\.self_attn\\.o")};
  const QuantizePlan p = mxq::cli::plan_quantize(kLlama, o);
  EXPECT_EQ(why(p, kA, "model.layers.0.self_attn.q_proj.weight"), "");
  EXPECT_EQ(why(p, kB, "model.layers.0.mlp.odd_proj.weight"), "");
  EXPECT_EQ(why(p, kA, "model.layers.0.self_attn.k_proj.weight"), "not matched by --include");
  EXPECT_EQ(why(p, kB, "model.layers.0.self_attn.o_proj.weight"), "matched by --exclude");
  EXPECT_EQ(why(p, kA, "model.embed_tokens.weight"), "left unquantized for vLLM (head, embedding, router, vision)");
  try {
    mxq::cli::user_pattern("--exclude", "(a)\\1");
    ADD_FAILURE() << "a back-reference accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--exclude '(a)\\1': not a usable regular expression"), std::string::npos) << e.what();
  }
}

// GPT-2's Conv1D weights are stored [K, N]: left unquantized for that family only.
TEST(CheckpointPlan, TransposedWeightsOfTheFamily) {
  const std::vector<TensorEntry> table = {{kA, "transformer.h.0.attn.c_attn.weight", "BF16", {64, 192}},
                                          {kA, "transformer.h.0.mlp.c_fc.weight", "BF16", {64, 256}},
                                          {kA, "transformer.h.0.extra.weight", "BF16", {64, 64}}};
  const std::string conv1d = "a Conv1D weight stored transposed ([K, N]) in this model family, not a Linear weight";
  const QuantizePlan g = mxq::cli::plan_quantize(table, options(Format::nvfp4, false, R"({"model_type": "gpt2"})"));
  EXPECT_EQ(why(g, kA, "transformer.h.0.attn.c_attn.weight"), conv1d);
  EXPECT_EQ(why(g, kA, "transformer.h.0.mlp.c_fc.weight"), conv1d);
  EXPECT_EQ(why(g, kA, "transformer.h.0.extra.weight"), "");
  EXPECT_EQ(g.unfit.front(), "transformer.h.0.attn.c_attn.weight (" + conv1d + ")");
  const QuantizePlan l = mxq::cli::plan_quantize(table, options(Format::nvfp4));
  EXPECT_EQ(why(l, kA, "transformer.h.0.attn.c_attn.weight"), "");
}

// quantize leaves a module whose quantized tensors' names would pass the reader's limit; qdq keeps
// the name as it is and quantizes.
TEST(CheckpointPlan, NamesTooLongForTheQuantizedTensors) {
  const std::string fits = std::string(mxq::st::kMaxNameBytes - 20, 'a'), too_long = std::string(mxq::st::kMaxNameBytes - 19, 'b');
  const std::vector<TensorEntry> table = {{kA, fits + ".weight", "BF16", {8, 64}}, {kA, too_long + ".weight", "BF16", {8, 64}}};
  const QuantizePlan p = mxq::cli::plan_quantize(table, options(Format::nvfp4));
  EXPECT_EQ(why(p, kA, fits + ".weight"), "");
  EXPECT_EQ(why(p, kA, too_long + ".weight"), "name too long for its quantized tensors (limit 1024 bytes)");
  EXPECT_EQ(p.ignore, (std::vector<std::string>{"lm_head", too_long}));
  EXPECT_EQ(why(mxq::cli::plan_quantize(table, options(Format::nvfp4, true)), kA, too_long + ".weight"), "");
}

// --rotate: K must be a multiple of the rotation size; the matrix goes beside the first rotated
// module in the checkpoint's order (shard by shard, each in its header's order, not by name); MoE
// experts and Linear layers with a bias are refused for quantize, accepted for qdq.
TEST(CheckpointPlan, Rotation) {
  const std::vector<TensorEntry> table = {{kB, "m.z_proj.weight", "BF16", {8, 96}},  // 96: not a multiple of 64
                                          {kB, "m.y_proj.weight", "BF16", {8, 128}},
                                          {kA, "m.a_proj.weight", "BF16", {8, 128}}};
  PlanOptions o = options(Format::mxfp4, false, nullptr);
  o.rotation = {Rotation::hadamard, 64};
  const QuantizePlan p = mxq::cli::plan_quantize(table, o);
  EXPECT_EQ(why(p, kB, "m.z_proj.weight"), "K = 96 is not a multiple of the rotation size 64");
  EXPECT_EQ(p.rotation_shard, kB);
  EXPECT_EQ(p.rotation_module, "m.y_proj");
  o.fake = true;
  EXPECT_TRUE(mxq::cli::plan_quantize(table, o).rotation_shard.empty()) << "qdq stores no matrix";
  o.fake = false;
  o.exclude = {mxq::cli::user_pattern("--exclude", "proj")};
  const QuantizePlan none = mxq::cli::plan_quantize(table, o);
  EXPECT_TRUE(none.rotation_shard.empty() && none.rotation_module.empty()) << "nothing rotated, no matrix";

  const std::vector<TensorEntry> moe = {{kA, "m.layers.0.mlp.experts.3.up_proj.weight", "BF16", {8, 64}}};
  const std::vector<TensorEntry> bias = {{kA, "m.q_proj.weight", "BF16", {8, 64}}, {kB, "m.q_proj.bias", "BF16", {8}}};
  o = options(Format::nvfp4, false, nullptr);
  o.rotation = {Rotation::hadamard, 32};
  EXPECT_NE(refusal(moe, o).find("--rotate: m.layers.0.mlp.experts.3.up_proj.weight is an MoE expert weight"), std::string::npos);
  EXPECT_NE(refusal(bias, o).find("--rotate: m.q_proj has a bias"), std::string::npos);
  o.exclude = {mxq::cli::user_pattern("--exclude", "experts|q_proj")};  // left unquantized: not rotated, accepted
  EXPECT_NO_THROW(mxq::cli::plan_quantize(moe, o));
  EXPECT_NO_THROW(mxq::cli::plan_quantize(bias, o));
  o.exclude.clear();
  o.fake = true;
  EXPECT_NO_THROW(mxq::cli::plan_quantize(moe, o));
  EXPECT_NO_THROW(mxq::cli::plan_quantize(bias, o));
}

// The engine's buffers: the largest input, output (codes; qdq: the input's size), scales and
// element count over the quantized tensors.
TEST(CheckpointPlan, LargestConversion) {
  const std::vector<TensorEntry> table = {{kA, "a.weight", "F32", {16, 256}}, {kA, "b.weight", "BF16", {64, 96}},
                                          {kA, "big.embed.weight", "F32", {1000, 1000}}};  // not quantized
  const QuantizePlan q = mxq::cli::plan_quantize(table, options(Format::mxfp4, false, nullptr));
  EXPECT_EQ(q.largest.x, 16u * 256 * 4);
  EXPECT_EQ(q.largest.y, 64u * 48);
  EXPECT_EQ(q.largest.scales, 64u * 3);
  EXPECT_EQ(q.largest.elems, 64u * 96);
  const QuantizePlan f = mxq::cli::plan_quantize(table, options(Format::nvfp4, true, nullptr));
  EXPECT_EQ(f.largest.y, 16u * 256 * 4);
  EXPECT_EQ(f.largest.scales, 64u * 6);
}

// The NVFP4 global scale's amax: a fused group's members share the largest of their amax (NaN if
// any is NaN, +Inf if any is infinite); a module fused with nothing keeps its own; the same member
// names of another layer are another group.
TEST(CheckpointPlan, GlobalScaleAmaxOfFusedGroups) {
  const float inf = std::numeric_limits<float>::infinity();
  const auto fusion = mxq::cli::loader_fusion(nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"]})"));
  const std::map<std::string, float> amax = {
      {"l0.self_attn.q_proj", 1.0f}, {"l0.self_attn.k_proj", 3.0f}, {"l0.self_attn.v_proj", 2.0f},
      {"l0.self_attn.o_proj", 5.0f}, {"l0.mlp.gate_proj", 0.5f},    {"l0.mlp.up_proj", NAN},
      {"l1.self_attn.q_proj", 0.25f}, {"l1.self_attn.k_proj", inf},  {"l1.mlp.down_proj", 7.0f}};
  const auto s = mxq::cli::global_scale_amax(fusion, amax);
  ASSERT_EQ(s.size(), amax.size());
  struct Row {
    const char* module;
    float amax;
    const char* group;
  };
  for (const Row& r : std::vector<Row>{{"l0.self_attn.q_proj", 3.0f, "l0.self_attn.qkv_proj"},
                                       {"l0.self_attn.k_proj", 3.0f, "l0.self_attn.qkv_proj"},
                                       {"l0.self_attn.v_proj", 3.0f, "l0.self_attn.qkv_proj"},
                                       {"l0.self_attn.o_proj", 5.0f, ""},
                                       {"l0.mlp.gate_proj", NAN, "l0.mlp.gate_up_proj"},
                                       {"l0.mlp.up_proj", NAN, "l0.mlp.gate_up_proj"},
                                       {"l1.self_attn.q_proj", inf, "l1.self_attn.qkv_proj"},
                                       {"l1.self_attn.k_proj", inf, "l1.self_attn.qkv_proj"},
                                       {"l1.mlp.down_proj", 7.0f, ""}}) {
    const mxq::cli::ScaleAmax& a = s.at(r.module);
    if (std::isnan(r.amax)) EXPECT_TRUE(std::isnan(a.amax)) << r.module << ": " << a.amax;
    else EXPECT_EQ(a.amax, r.amax) << r.module;
    EXPECT_EQ(a.group, r.group) << r.module;
  }
  // NaN wins whichever side it is on; otherwise the larger, +Inf included
  EXPECT_TRUE(std::isnan(mxq::cli::group_amax_of(NAN, inf)));
  EXPECT_TRUE(std::isnan(mxq::cli::group_amax_of(inf, NAN)));
  EXPECT_EQ(mxq::cli::group_amax_of(2.0f, inf), inf);
  EXPECT_EQ(mxq::cli::group_amax_of(2.0f, 1.0f), 2.0f);
}

// The modules vLLM expects unquantized, by name alone.
TEST(CheckpointPlan, DefaultIgnored) {
  for (const char* m : {"lm_head", "model.lm_head", "model.embed_tokens", "transformer.wpe_embed", "model.layers.3.mlp.gate",
                        "model.layers.3.mlp.router", "model.layers.3.mlp.shared_expert_gate", "visual.blocks.0.attn.qkv",
                        "vision_tower.encoder.fc1"})
    EXPECT_TRUE(mxq::cli::default_ignored(m)) << m;
  for (const char* m : {"model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj", "lm_head_proj", "model.layers.0.self_attn.q_proj",
                        "transformer.wte"})
    EXPECT_FALSE(mxq::cli::default_ignored(m)) << m;
}
