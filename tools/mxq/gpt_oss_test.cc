// `mxq quantize --format mxfp4` on a gpt-oss checkpoint: the experts written in gpt-oss's own MXFP4
// layout (docs/cli.md "gpt-oss MXFP4 experts"), read here as transformers' loader reads it (low
// nibble first, E8M0 scale bytes with bias 127) and compared with the library's MXFP4 QDQ of the
// transposed bf16 weights; malformed experts are refused naming the tensor.
#include <functional>
#include <optional>

#include "checkpoint_test_util.hpp"

namespace {

using namespace checkpoint_test;

constexpr std::int64_t kE = 4, kH = 64, kI = 64;

// A tiny gpt-oss-shaped checkpoint: experts [E, H, 2I] / [E, I, H] with biases, attention, router.
std::map<std::string, std::vector<std::uint16_t>> write_gpt_oss(const fs::path& dir,
                                                                std::vector<std::pair<std::string, std::vector<std::int64_t>>> ts = {}) {
  fs::create_directories(dir);
  if (ts.empty())
    ts = {{"model.embed_tokens.weight", {100, kH}},
          {"model.layers.0.self_attn.q_proj.weight", {kH, kH}},
          {"model.layers.0.mlp.router.weight", {kE, kH}},
          {"model.layers.0.mlp.router.bias", {kE}},
          {"model.layers.0.mlp.experts.gate_up_proj", {kE, kH, 2 * kI}},
          {"model.layers.0.mlp.experts.gate_up_proj_bias", {kE, 2 * kI}},
          {"model.layers.0.mlp.experts.down_proj", {kE, kI, kH}},
          {"model.layers.0.mlp.experts.down_proj_bias", {kE, kH}},
          {"lm_head.weight", {100, kH}}};
  std::map<std::string, std::vector<std::uint16_t>> data;
  std::mt19937 rng(38);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  st::Writer w((dir / "model.safetensors").string());
  for (const auto& [name, shape] : ts) {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    auto& v = data[name];
    v.resize(std::size_t(n));
    for (auto& x : v) x = to_bf16(nd(rng));
    w.declare(name, "BF16", shape);
  }
  for (const auto& [name, shape] : ts)
    w.write(name, {reinterpret_cast<const std::uint8_t*>(data[name].data()), data[name].size() * 2});
  w.commit();
  std::ofstream(dir / "config.json") << R"({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})";
  return data;
}

// transformers' reading of gpt-oss's blocks: element 2j of a block row from the low nibble of byte j,
// 2j + 1 from the high one, times 2^(scale - 127)
std::vector<float> decode_blocks(const std::vector<std::uint8_t>& blocks, const std::vector<std::uint8_t>& scales,
                                 std::int64_t rows, std::int64_t K) {
  static const float lut[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  std::vector<float> y(std::size_t(rows * K));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::uint8_t b = blocks[std::size_t(r * K / 2 + k / 2)];
      const float s = std::ldexp(1.0f, int(scales[std::size_t(r * K / 32 + k / 32)]) - 127);
      y[std::size_t(r * K + k)] = lut[k % 2 ? b >> 4 : b & 15] * s;
    }
  return y;
}

// the library's MXFP4 quantize-dequantize (rule even, the tool's) of x [E, K, N] transposed to [E, N, K]
std::vector<float> qdq_transposed(const std::vector<std::uint16_t>& x, std::int64_t E, std::int64_t K, std::int64_t N) {
  std::vector<std::uint16_t> t(x.size());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t n = 0; n < N; ++n) t[std::size_t((e * N + n) * K + k)] = x[std::size_t((e * K + k) * N + n)];
  const std::int64_t rows = E * N;
  const mxq::QuantOptions o = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
  std::vector<std::uint8_t> codes(std::size_t(rows * K / 2)), scales(std::size_t(rows * K / 32));
  mxq::QuantizedOut q;
  q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, rows, K / 2);
  q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, rows, K / 32);
  mxq::quantize(mxq::Tensor::of(t.data(), mxq::DType::bf16, rows, K), q, o);
  std::vector<float> y(t.size());
  mxq::dequantize(mxq::QuantizedIn{q.codes, q.scales}, mxq::Tensor::of(y.data(), mxq::DType::f32, rows, K), o);
  return y;
}

// one tensor of an output's model.safetensors (the input had no index, so neither has the output)
std::vector<std::uint8_t> load1(const fs::path& dir, const std::string& name, const std::string& dtype,
                                const std::vector<std::int64_t>& shape) {
  return load_from(dir / "model.safetensors", name, dtype, shape);
}

bool has_tensor(const fs::path& dir, const std::string& name) {
  const st::File f((dir / "model.safetensors").string());
  return f.view().find(name) != nullptr;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(GptOssQuantize, ExpertsTakeGptOssMxfp4Layout) {
  const fs::path root = scratch("gptoss");
  const auto x = write_gpt_oss(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.device = "cpu";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const fs::path q = root / "q";
  const std::string gu = "model.layers.0.mlp.experts.gate_up_proj", dn = "model.layers.0.mlp.experts.down_proj";
  const auto gb = load1(q, gu + "_blocks", "U8", {kE, 2 * kI, kH / 32, 16});
  const auto gs = load1(q, gu + "_scales", "U8", {kE, 2 * kI, kH / 32});
  const auto db = load1(q, dn + "_blocks", "U8", {kE, kH, kI / 32, 16});
  const auto ds = load1(q, dn + "_scales", "U8", {kE, kH, kI / 32});
  ASSERT_FALSE(gb.empty() || gs.empty() || db.empty() || ds.empty());
  EXPECT_TRUE(same_floats(decode_blocks(gb, gs, kE * 2 * kI, kH), qdq_transposed(x.at(gu), kE, kH, 2 * kI)));
  EXPECT_TRUE(same_floats(decode_blocks(db, ds, kE * kH, kI), qdq_transposed(x.at(dn), kE, kI, kH)));
  // everything else as it was, in bf16; no bf16 experts left
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.router.weight",
                           "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias",
                           "model.embed_tokens.weight", "lm_head.weight"}) {
    const auto v = x.at(name);
    std::vector<std::int64_t> shape;
    if (std::string(name).ends_with("_bias")) shape = {kE, std::int64_t(v.size()) / kE};
    else shape = {std::int64_t(v.size()) / kH, kH};
    const auto got = load1(q, name, "BF16", shape);
    EXPECT_EQ(got.size(), v.size() * 2) << name;
    EXPECT_EQ(std::memcmp(got.data(), v.data(), std::min(got.size(), v.size() * 2)), 0) << name;
  }
  EXPECT_FALSE(has_tensor(q, gu));
  EXPECT_FALSE(has_tensor(q, dn));
  const json cfg = json::parse(std::ifstream(q / "config.json"));
  const json& qc = cfg["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "mxfp4");
  const auto ignore = qc["modules_to_not_convert"].get<std::vector<std::string>>();
  for (const char* m : {"lm_head", "model.embed_tokens", "model.layers.0.mlp.router", "model.layers.0.self_attn.q_proj"})
    EXPECT_NE(std::find(ignore.begin(), ignore.end(), m), ignore.end()) << m;
  EXPECT_EQ(std::find(ignore.begin(), ignore.end(), "model.layers.0.mlp.experts"), ignore.end());
  fs::remove_all(root);
}

TEST(GptOssQuantize, ExcludingOneExpertsTensorLeavesThePairUnquantized) {
  const fs::path root = scratch("gptoss_excl");
  write_gpt_oss(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.device = "cpu";
  qa.exclude = {"down_proj$"};
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_TRUE(has_tensor(root / "q", "model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(has_tensor(root / "q", "model.layers.0.mlp.experts.gate_up_proj_blocks"));
  const json cfg = json::parse(std::ifstream(root / "q" / "config.json"));
  const auto ignore = cfg["quantization_config"]["modules_to_not_convert"].get<std::vector<std::string>>();
  EXPECT_NE(std::find(ignore.begin(), ignore.end(), "model.layers.0.mlp.experts"), ignore.end());
  fs::remove_all(root);
}

// --part I/N and mxq merge on a gpt-oss checkpoint (one file, so the parts split its tensors): the merged
// output, gpt-oss's experts layout included, is byte-identical to the single run.
TEST(GptOssQuantize, PartsMergeToTheSingleRun) {
  const fs::path root = scratch("gptoss_parts");
  write_gpt_oss(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "one").string();
  qa.device = "cpu";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const auto one = read_tree(qa.out);
  ASSERT_TRUE(one.count("model.safetensors"));
  for (int n : {2, 3}) {
    qa.out = (root / ("n" + std::to_string(n))).string();
    for (int i = 1; i <= n; ++i) {
      qa.part = std::to_string(i) + "/" + std::to_string(n);
      ASSERT_EQ(mxq::cli::run_quantize(qa), 0) << *qa.part;
    }
    mxq::cli::MergeArgs ma;
    ma.out = qa.out;
    ASSERT_EQ(mxq::cli::run_merge(ma), 0) << "n=" << n;
    const auto merged = read_tree(qa.out);
    EXPECT_EQ(merged.size(), one.size()) << "n=" << n;
    for (const auto& [name, bytes] : one) {
      ASSERT_TRUE(merged.count(name)) << "n=" << n << ": " << name << " missing";
      EXPECT_TRUE(merged.at(name) == bytes) << "n=" << n << ": " << name << " differs";
    }
  }
  fs::remove_all(root);
}

// Hostile gpt-oss parts: a blocks tensor of another shape, a missing scales tensor, or a manifest whose
// config names compressed-tensors for this model are refused naming what is wrong; nothing is written.
TEST(GptOssQuantize, MergeChecksTheExpertsLayout) {
  const fs::path root = scratch("gptoss_merge_bad");
  write_gpt_oss(root / "in");
  const std::string gu = "model.layers.0.mlp.experts.gate_up_proj";
  struct Case {
    std::string what, needle;
    std::function<void(const fs::path& part1)> spoil;
  };
  // part 1's model.safetensors again, tensor `name` declared with `shape` (its bytes resized) or dropped;
  // with `add`, the input's tensor of that name added as well
  const auto rewrite = [&root](const fs::path& part1, const std::string& name, std::optional<std::vector<std::int64_t>> shape,
                               const std::string& add = "") {
    const fs::path f = part1 / "model.safetensors";
    std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<std::uint8_t>>> keep;
    std::vector<std::pair<std::string, std::string>> order;
    if (!add.empty()) {
      const st::File in((root / "in" / "model.safetensors").string());
      const st::TensorInfo* t = in.view().find(add);
      const auto d = in.view().data(*t);
      keep[add] = {t->shape, std::vector<std::uint8_t>(d.begin(), d.end())};
      order.push_back({add, t->dtype});
      json m = json::parse(std::ifstream(part1 / "mxq-part.json"));
      m["weight_map"][add] = "model.safetensors";
      std::ofstream(part1 / "mxq-part.json", std::ios::trunc) << m.dump();
    }
    {
      const st::File in(f.string());
      for (const st::TensorInfo& t : in.view().tensors()) {
        if (t.name == name && !shape) continue;
        const auto d = in.view().data(t);
        std::vector<std::uint8_t> bytes(d.begin(), d.end());
        std::vector<std::int64_t> sh = t.shape;
        if (t.name == name) {
          sh = *shape;
          std::int64_t n = 1;
          for (std::int64_t v : sh) n *= v;
          bytes.resize(std::size_t(n));
        }
        keep[t.name] = {sh, bytes};
        order.push_back({t.name, t.dtype});
      }
    }
    fs::remove(f);
    st::Writer w(f.string());
    for (const auto& [n, dt] : order) w.declare(n, dt, keep[n].first);
    for (const auto& [n, dt] : order) w.write(n, keep[n].second);
    w.commit();
    if (!shape) {  // the manifest's weight map without it, so that the shard check reaches the layout
      json m = json::parse(std::ifstream(part1 / "mxq-part.json"));
      m["weight_map"].erase(name);
      std::ofstream(part1 / "mxq-part.json", std::ios::trunc) << m.dump();
    }
  };
  const std::vector<Case> cases = {
      {"blocks of another shape", "not gpt-oss's MXFP4 layout",
       [&](const fs::path& p1) { rewrite(p1, gu + "_blocks", std::vector<std::int64_t>{kE, 2 * kI, kH / 32, 8}); }},
      {"scales missing", "not gpt-oss's MXFP4 layout", [&](const fs::path& p1) { rewrite(p1, gu + "_scales", std::nullopt); }},
      {"the bf16 experts kept beside their blocks", "both copied and quantized",
       [&](const fs::path& p1) { rewrite(p1, "", std::nullopt, gu); }},
      {"a compressed-tensors config", "mxfp4 (gpt-oss) quantization_config",
       [&](const fs::path& p1) {
         for (const fs::path& part : {p1, fs::path(root / "q.part-2-of-2")}) {
           json m = json::parse(std::ifstream(part / "mxq-part.json"));
           json cfg = json::parse(m["config_text"].get<std::string>());
           cfg["quantization_config"]["quant_method"] = "compressed-tensors";
           m["config_text"] = cfg.dump();
           std::ofstream(part / "mxq-part.json", std::ios::trunc) << m.dump();
         }
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (const char* p : {".part-1-of-2", ".part-2-of-2"}) fs::remove_all(root / (std::string("q") + p));
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / "q").string();
    qa.device = "cpu";
    for (const char* part : {"1/2", "2/2"}) {
      qa.part = part;
      ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
    }
    c.spoil(root / "q.part-1-of-2");
    const std::string msg = merge_failure(root / "q", c.what);
    EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
  }
  fs::remove_all(root);
}

// mxq dequantize reads compressed-tensors checkpoints: it refuses gpt-oss's layout (with or without its
// config) instead of copying the blocks under a config that no longer names a quantization.
TEST(GptOssQuantize, DequantizeRefusesTheGptOssLayout) {
  const fs::path root = scratch("gptoss_deq");
  write_gpt_oss(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.device = "cpu";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  for (bool with_config : {true, false}) {
    if (!with_config) fs::remove(root / "q" / "config.json");
    mxq::cli::DequantizeArgs da;
    da.in = (root / "q").string();
    da.out = (root / "dq").string();
    da.device = "cpu";
    std::string msg;
    try {
      mxq::cli::run_dequantize(da);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(with_config ? "quant_method 'mxfp4'" : "gate_up_proj_blocks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("compressed-tensors checkpoints only"), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(root / "dq"));
  }
  fs::remove_all(root);
}

TEST(GptOssQuantize, MalformedExpertsAreRefusedNamingTheTensor) {
  struct Case {
    std::vector<std::pair<std::string, std::vector<std::int64_t>>> ts;
    std::string says;
  };
  const std::string gu = "model.layers.0.mlp.experts.gate_up_proj", dn = "model.layers.0.mlp.experts.down_proj";
  const std::vector<Case> cases = {
      {{{gu, {kE, kH, 2 * kI}}}, "gate_up_proj without down_proj"},
      {{{gu, {kE, kH, 2 * kI}}, {dn, {kE, kI, kH + 32}}}, "do not fit"},
      {{{gu, {kE, kH, 2 * kI}}, {dn, {kE + 1, kI, kH}}}, "do not fit"},
      {{{gu, {kE, 48, 2 * kI}}, {dn, {kE, kI, 48}}}, "not a multiple of 32"},
      {{{gu, {kE * kH, 2 * kI}}, {dn, {kE, kI, kH}}}, "expected a 3-D"},
      {{{gu, {0, kH, 2 * kI}}, {dn, {0, kI, kH}}}, "empty"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const fs::path root = scratch("gptoss_bad" + std::to_string(i++));
    write_gpt_oss(root / "in", c.ts);
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / "q").string();
    qa.device = "cpu";
    const std::string msg = quantize_failure(qa, c.says);
    EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.layers.0.mlp.experts"), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(root / "q"));
    fs::remove_all(root);
  }
}

}  // namespace
