// The loaders' fused projections (fusion.hpp) per model family, and `mxq quantize` giving every
// member of a fused parameter one NVFP4 global scale and one precision.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "commands.hpp"
#include "convert.hpp"
#include "fusion.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;
namespace st = mxq::st;
using json = nlohmann::json;
using mxq::cli::fused_group;
using mxq::cli::loader_fusion;

namespace {

mxq::cli::LoaderFusion of(const char* config) { return loader_fusion(json::parse(config)); }

// Every module of `same` lands in the group `group`; every module of `alone` in none.
void expect_groups(const mxq::cli::LoaderFusion& f, const std::vector<std::string>& same, const std::string& group,
                   const std::vector<std::string>& alone = {}) {
  for (const std::string& m : same) EXPECT_EQ(fused_group(f, m), group) << f.family << ": " << m;
  for (const std::string& m : alone) EXPECT_EQ(fused_group(f, m), "") << f.family << ": " << m;
}

}  // namespace

TEST(Fusion, DenseLlamaQwenMistral) {
  for (const char* cfg : {R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})",
                          R"({"architectures": ["Qwen2ForCausalLM"]})", R"({"architectures": ["MistralForCausalLM"]})",
                          R"({"model_type": "qwen3"})"}) {
    const auto f = of(cfg);
    EXPECT_TRUE(f.known) << cfg;
    EXPECT_EQ(f.family, "llama-like") << cfg;
    expect_groups(f, {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"},
                  "model.layers.0.self_attn.qkv_proj", {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"});
    expect_groups(f, {"model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"}, "model.layers.3.mlp.gate_up_proj");
    EXPECT_NE(fused_group(f, "model.layers.0.self_attn.q_proj"), fused_group(f, "model.layers.1.self_attn.q_proj"));
  }
  EXPECT_EQ(of(R"({"architectures": ["LlamaForCausalLM"]})").source, "architectures: LlamaForCausalLM");
  EXPECT_EQ(of(R"({"model_type": "qwen3"})").source, "model_type: qwen3");
}

TEST(Fusion, MoeExpertsSharePerExpert) {
  // Qwen3-MoE / Qwen2-MoE / DeepSeek: experts and shared experts named gate_proj / up_proj
  const auto q = of(R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"})");
  expect_groups(q, {"model.layers.1.mlp.experts.7.gate_proj", "model.layers.1.mlp.experts.7.up_proj"},
                "model.layers.1.mlp.experts.7.gate_up_proj", {"model.layers.1.mlp.experts.7.down_proj", "model.layers.1.mlp.gate"});
  EXPECT_NE(fused_group(q, "model.layers.1.mlp.experts.7.gate_proj"), fused_group(q, "model.layers.1.mlp.experts.8.up_proj"));
  expect_groups(of(R"({"architectures": ["Qwen2MoeForCausalLM"]})"),
                {"model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"},
                "model.layers.0.mlp.shared_expert.gate_up_proj");
  // Mixtral: w1 (gate) and w3 (up) of each expert; w2 is the down projection
  const auto mx = of(R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})");
  EXPECT_EQ(mx.family, "mixtral");
  expect_groups(mx, {"model.layers.0.block_sparse_moe.experts.3.w1", "model.layers.0.block_sparse_moe.experts.3.w3"},
                "model.layers.0.block_sparse_moe.experts.3.w13", {"model.layers.0.block_sparse_moe.experts.3.w2"});
  expect_groups(mx, {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}, "model.layers.0.self_attn.qkv_proj");
  // DeepSeek-V2/V3 (and Kimi-K2): MLA's q_a_proj + kv_a_proj_with_mqa, experts' and shared experts' gate/up
  for (const char* cfg : {R"({"architectures": ["DeepseekV3ForCausalLM"]})", R"({"model_type": "deepseek_v2"})"}) {
    const auto d = of(cfg);
    EXPECT_EQ(d.family, "deepseek-v2/v3") << cfg;
    expect_groups(d, {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"},
                  "model.layers.0.self_attn.fused_qkv_a_proj",
                  {"model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj"});
    expect_groups(d, {"model.layers.5.mlp.experts.0.gate_proj", "model.layers.5.mlp.experts.0.up_proj"},
                  "model.layers.5.mlp.experts.0.gate_up_proj");
    expect_groups(d, {"model.layers.5.mlp.shared_experts.gate_proj", "model.layers.5.mlp.shared_experts.up_proj"},
                  "model.layers.5.mlp.shared_experts.gate_up_proj");
  }
}

TEST(Fusion, BertQueryKeyValue) {
  // all-MiniLM-L6-v2's config
  for (const char* cfg : {R"({"architectures": ["BertModel"], "model_type": "bert"})", R"({"model_type": "xlm-roberta"})",
                          R"({"architectures": ["RobertaForMaskedLM"]})"}) {
    const auto f = of(cfg);
    EXPECT_EQ(f.family, "bert") << cfg;
    expect_groups(f, {"encoder.layer.2.attention.self.query", "encoder.layer.2.attention.self.key", "encoder.layer.2.attention.self.value"},
                  "encoder.layer.2.attention.self.qkv_proj",
                  {"encoder.layer.2.attention.output.dense", "encoder.layer.2.intermediate.dense", "encoder.layer.2.output.dense",
                   "pooler.dense"});
  }
}

TEST(Fusion, FamiliesWithOtherNames) {
  // Phi-3 stores qkv_proj and gate_up_proj fused already: nothing to share
  const auto phi3 = of(R"({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})");
  EXPECT_TRUE(phi3.known);
  expect_groups(phi3, {}, "", {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"});
  // GPT-2 and the other fused-in-checkpoint families: c_attn / query_key_value are one tensor
  for (const char* cfg : {R"({"architectures": ["GPT2LMHeadModel"]})", R"({"model_type": "falcon"})", R"({"model_type": "gpt_neox"})",
                          R"({"model_type": "gpt_bigcode"})"}) {
    const auto f = of(cfg);
    EXPECT_TRUE(f.known) << cfg;
    EXPECT_TRUE(f.rules.empty()) << cfg;
    expect_groups(f, {}, "", {"transformer.h.0.attn.c_attn", "transformer.h.0.self_attention.query_key_value", "x.q_proj", "x.w1"});
  }
  // GPT-2: Conv1D weights stored [K, N], left unquantized; nothing else of any family is
  const auto gpt2 = of(R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})");
  EXPECT_EQ(gpt2.family, "gpt2");
  for (const char* m : {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc"})
    EXPECT_TRUE(mxq::cli::stored_transposed(gpt2, m)) << m;
  EXPECT_FALSE(mxq::cli::stored_transposed(of(R"({"architectures": ["LlamaForCausalLM"]})"), "transformer.h.0.attn.c_attn"));
  EXPECT_FALSE(mxq::cli::stored_transposed(of(R"({"model_type": "gpt_bigcode"})"), "transformer.h.0.attn.c_attn"));
  // Qwen (v1): mlp.w1 and mlp.w2 are gate/up (w2 is not a down projection here, as it is in Mixtral)
  const auto qwen1 = of(R"({"architectures": ["QWenLMHeadModel"], "model_type": "qwen"})");
  expect_groups(qwen1, {"transformer.h.0.mlp.w1", "transformer.h.0.mlp.w2"}, "transformer.h.0.mlp.gate_up_proj",
                {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"});
  // InternLM2: feed_forward.w1 / w3; wqkv is one tensor
  const auto il2 = of(R"({"architectures": ["InternLM2ForCausalLM"]})");
  expect_groups(il2, {"model.layers.0.feed_forward.w1", "model.layers.0.feed_forward.w3"}, "model.layers.0.feed_forward.gate_up_proj",
                {"model.layers.0.feed_forward.w2", "model.layers.0.attention.wqkv"});
}

TEST(Fusion, UnknownModelsUseTheCommonNamesAndSaySo) {
  const auto none = loader_fusion(std::nullopt);
  EXPECT_FALSE(none.known);
  EXPECT_EQ(none.source, "no config.json");
  expect_groups(none, {"a.q_proj", "a.k_proj", "a.v_proj"}, "a.qkv_proj");
  expect_groups(none, {"e.0.w1", "e.0.w3"}, "e.0.w13", {"e.0.w2"});
  const auto foo = of(R"({"architectures": ["FooForCausalLM"], "model_type": "foo"})");
  EXPECT_FALSE(foo.known);
  EXPECT_NE(foo.source.find("FooForCausalLM"), std::string::npos) << foo.source;
  EXPECT_NE(foo.source.find("'foo'"), std::string::npos) << foo.source;
  // malformed fields are ignored, not thrown on
  EXPECT_FALSE(of(R"({"architectures": "BertModel", "model_type": 3})").known);
  EXPECT_TRUE(of(R"({"architectures": [3, "BertModel"]})").known);
}

namespace {

fs::path scratch(const std::string& tag) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_fusion_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(root);
  return root;
}

// A one-file checkpoint of bf16 [N, K] weights (each scaled by its factor) with a config.json.
std::map<std::string, std::vector<std::uint16_t>> write_model(const fs::path& dir, const std::map<std::string, float>& weights,
                                                              const std::string& config, std::int64_t N, std::int64_t K) {
  fs::create_directories(dir);
  std::map<std::string, std::vector<std::uint16_t>> data;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  st::Writer w((dir / "model.safetensors").string());
  for (const auto& [n, s] : weights) w.declare(n, "BF16", {N, K});
  for (const auto& [n, s] : weights) {
    auto& v = data[n];
    v.resize(N * K);
    for (auto& x : v) x = mxq::f32_to_bf16(nd(rng) * s);
    w.write(n, {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
  }
  w.commit();
  std::ofstream(dir / "config.json") << config;
  return data;
}

float global_scale_of(const fs::path& file, const std::string& module) {
  const st::File f(file.string());
  const st::TensorInfo* t = f.view().find(module + ".weight_global_scale");
  if (!t) return NAN;
  float S;
  std::memcpy(&S, f.view().data(*t).data(), 4);
  return S;
}

float amax_of(const std::vector<std::uint16_t>& v, std::int64_t N, std::int64_t K) {
  return mxq::tensor_amax(mxq::Tensor::of(v.data(), mxq::DType::bf16, N, K));
}

}  // namespace

// MiniLM-shaped: BERT's query/key/value get one global scale (the largest amax of the three; they
// used to get one each), the attention output its own; the log names the family.
TEST(FusionQuantize, BertQueryKeyValueShareOneGlobalScale) {
  const fs::path root = scratch("bert");
  const std::int64_t N = 32, K = 64;
  const std::string p = "encoder.layer.0.";
  auto w = write_model(root / "in",
                       {{p + "attention.self.query.weight", 1.0f}, {p + "attention.self.key.weight", 3.0f},
                        {p + "attention.self.value.weight", 0.5f}, {p + "attention.output.dense.weight", 2.0f}},
                       R"({"architectures": ["BertModel"], "model_type": "bert"})", N, K);
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "nvfp4";
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string log = testing::internal::GetCapturedStdout();
  EXPECT_NE(log.find("fused projections: bert (architectures: BertModel)"), std::string::npos) << log;
  const fs::path qf = root / "q" / "model.safetensors";
  float amax = 0;
  for (const char* m : {"query", "key", "value"}) amax = std::max(amax, amax_of(w[p + "attention.self." + m + ".weight"], N, K));
  for (const char* m : {"query", "key", "value"})
    EXPECT_EQ(global_scale_of(qf, p + "attention.self." + m), mxq::nvfp4_tensor_scale_from_amax(amax)) << m;
  EXPECT_EQ(global_scale_of(qf, p + "attention.output.dense"),
            mxq::nvfp4_tensor_scale_from_amax(amax_of(w[p + "attention.output.dense.weight"], N, K)));
  EXPECT_NE(global_scale_of(qf, p + "attention.output.dense"), global_scale_of(qf, p + "attention.self.query"));
  fs::remove_all(root);
}

// A NaN anywhere in one member (here not at its first element, which a running maximum would forget)
// gives the whole group the contract's S = 1; Mixtral's w2 keeps its own scale, w1/w3 share one.
TEST(FusionQuantize, NanInOneMemberGivesTheGroupScaleOne) {
  const fs::path root = scratch("nan");
  const std::int64_t N = 16, K = 64;
  const std::string e = "model.layers.0.block_sparse_moe.experts.0.";
  const fs::path in = root / "in";
  auto w = write_model(in, {{e + "w1.weight", 1.0f}, {e + "w2.weight", 1.0f}, {e + "w3.weight", 4.0f}},
                       R"({"architectures": ["MixtralForCausalLM"]})", N, K);
  // put a NaN in the middle of w1
  w[e + "w1.weight"][N * K / 2] = 0x7FC0;
  {
    st::Writer wr((in / "model.safetensors").string());
    for (const auto& [n, v] : w) wr.declare(n, "BF16", {N, K});
    for (const auto& [n, v] : w) wr.write(n, {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
    wr.commit();
  }
  mxq::cli::QuantizeArgs qa;
  qa.in = in.string();
  qa.out = (root / "q").string();
  qa.format = "nvfp4";
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  testing::internal::GetCapturedStderr();
  const fs::path qf = root / "q" / "model.safetensors";
  EXPECT_EQ(global_scale_of(qf, e + "w1"), 1.0f);
  EXPECT_EQ(global_scale_of(qf, e + "w3"), 1.0f);
  EXPECT_EQ(global_scale_of(qf, e + "w2"), mxq::nvfp4_tensor_scale_from_amax(amax_of(w[e + "w2.weight"], N, K)));
  EXPECT_NE(global_scale_of(qf, e + "w2"), 1.0f);
  fs::remove_all(root);
}

// One precision per fused parameter: excluding k_proj leaves q_proj and v_proj unquantized too
// (vLLM refuses a fused layer whose shards differ), in every format; they are listed and ignored.
TEST(FusionQuantize, AMemberLeftUnquantizedLeavesItsGroupUnquantized) {
  const fs::path root = scratch("precision");
  const std::int64_t N = 16, K = 64;
  const std::string a = "model.layers.0.self_attn.";
  write_model(root / "in",
              {{a + "q_proj.weight", 1.0f}, {a + "k_proj.weight", 1.0f}, {a + "v_proj.weight", 1.0f}, {a + "o_proj.weight", 1.0f}},
              R"({"architectures": ["LlamaForCausalLM"]})", N, K);
  for (const char* format : {"mxfp4", "mxfp8", "nvfp4"}) {
    const fs::path out = root / format;
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = out.string();
    qa.format = format;
    qa.exclude = {"k_proj"};
    testing::internal::CaptureStdout();
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0) << format;
    const std::string log = testing::internal::GetCapturedStdout();
    const st::File f((out / "model.safetensors").string());
    for (const char* m : {"q_proj", "k_proj", "v_proj"}) {
      const st::TensorInfo* t = f.view().find(a + m + ".weight");
      ASSERT_NE(t, nullptr) << format << " " << m;
      EXPECT_EQ(t->dtype, "BF16") << format << " " << m;
      EXPECT_EQ(f.view().find(a + m + ".weight_scale"), nullptr) << format << " " << m;
    }
    EXPECT_NE(f.view().find(a + "o_proj.weight_scale"), nullptr) << format;
    EXPECT_NE(log.find(a + "q_proj.weight (fused into " + a + "qkv_proj with " + a + "k_proj.weight"), std::string::npos) << log;
    const json cfg = json::parse(std::ifstream(out / "config.json"));
    const auto& ignore = cfg["quantization_config"]["ignore"];
    for (const char* m : {"q_proj", "k_proj", "v_proj"})
      EXPECT_NE(std::find(ignore.begin(), ignore.end(), a + m), ignore.end()) << format << " " << m;
  }
  fs::remove_all(root);
}

// Without a config.json (or for a model not in the table) the common names are used and stderr says so.
TEST(FusionQuantize, UnknownModelWarns) {
  const fs::path root = scratch("unknown");
  write_model(root / "in", {{"l.q_proj.weight", 1.0f}, {"l.k_proj.weight", 2.0f}}, R"({"architectures": ["FooForCausalLM"]})", 16, 64);
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "nvfp4";
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("FooForCausalLM"), std::string::npos) << said;
  EXPECT_NE(said.find("not known to mxq"), std::string::npos) << said;
  EXPECT_EQ(global_scale_of(root / "q" / "model.safetensors", "l.q_proj"), global_scale_of(root / "q" / "model.safetensors", "l.k_proj"));
  fs::remove_all(root);
}

// GPT-2's Conv1D weights ([K, N]) are not quantized along the wrong axis: copied, listed and ignored.
TEST(FusionQuantize, Gpt2Conv1DWeightsAreLeftUnquantized) {
  const fs::path root = scratch("gpt2");
  write_model(root / "in", {{"transformer.h.0.attn.c_attn.weight", 1.0f}, {"transformer.h.0.mlp.c_fc.weight", 1.0f}},
              R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})", 64, 96);
  for (const bool fake : {false, true}) {
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / (fake ? "fq" : "q")).string();
    qa.format = "mxfp4";
    qa.fake = fake;
    testing::internal::CaptureStdout();
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
    const std::string log = testing::internal::GetCapturedStdout();
    EXPECT_NE(log.find("transformer.h.0.attn.c_attn.weight (a Conv1D weight stored transposed"), std::string::npos) << log;
    const st::File f((root / qa.out / "model.safetensors").string());
    for (const char* n : {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"}) {
      ASSERT_NE(f.view().find(std::string(n) + ".weight"), nullptr) << n;
      EXPECT_EQ(f.view().find(std::string(n) + ".weight_scale"), nullptr) << n;
    }
  }
  fs::remove_all(root);
}
