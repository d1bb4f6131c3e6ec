// The compressed-tensors layout as `mxq quantize` writes it and `mxq dequantize` reads it back, on a
// two-shard checkpoint the tests write: names, dtypes, shapes, index and config vLLM reads, codes and
// scales equal to the library's quantize, dequantized weights equal to its qdq, the transform_config
// and matrix of --rotate; and the reader's refusals.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "compressed_tensors.hpp"
#include "safetensors.hpp"

using namespace checkpoint_test;
using mxq::Format;

namespace {

// Rewrites one tensor's dtype in a safetensors header (same data bytes, header padded to 8).
void retag(const fs::path& file, const std::string& tensor, const std::string& dtype) {
  std::ifstream in(file, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), {});
  std::uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  json h = json::parse(std::string(b.data() + 8, n));
  ASSERT_TRUE(h.contains(tensor)) << tensor;
  h[tensor]["dtype"] = dtype;
  std::string hs = h.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');
  const std::uint64_t m = hs.size();
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&m), 8);
  out.write(hs.data(), std::streamsize(m));
  out.write(b.data() + 8 + n, std::streamsize(b.size() - 8 - n));
}

class Checkpoint : public testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(Checkpoint, QuantizeDequantizeMatchTheLibrary) {
  const std::string format = GetParam();
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_" + format + "_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const auto data = make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = format;
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string qlog = testing::internal::GetCapturedStdout();
  mxq::cli::DequantizeArgs da;
  da.in = qa.out;
  da.out = (root / "dq").string();
  ASSERT_EQ(mxq::cli::run_dequantize(da), 0);

  const bool nv = format == "nvfp4", fp8 = format == "mxfp8";
  const mxq::Format f = nv ? mxq::Format::nvfp4 : fp8 ? mxq::Format::mxfp8_e4m3 : mxq::Format::mxfp4;
  const int g = nv ? 16 : 32;
  // The shared NVFP4 scale of q/k/v: from the largest amax of the three.
  float qkv_amax = 0;
  for (const char* m : {"q_proj", "k_proj", "v_proj"})
    for (std::uint16_t h : data.at(std::string("model.layers.0.self_attn.") + m + ".weight")) {
      const std::uint32_t u = std::uint32_t(h) << 16;
      float v;
      std::memcpy(&v, &u, 4);
      qkv_amax = std::max(qkv_amax, std::fabs(v));
    }
  for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    const std::string mod = std::string("model.layers.0.self_attn.") + m;
    const auto& x = data.at(mod + ".weight");
    const std::int64_t N = std::int64_t(x.size()) / (m == std::string("o_proj") ? 64 : 128), K = std::int64_t(x.size()) / N;
    // the tool's default MX rules: compressed-tensors' (even for MXFP4, even_fp4 for MXFP8)
    mxq::QuantOptions o = nv                                ? mxq::QuantOptions::nvfp4()
                          : f == mxq::Format::mxfp8_e4m3 ? mxq::presets::compressed_tensors_mx(f)
                                                         : mxq::QuantOptions::mx(f, mxq::ScaleRule::even);
    if (nv) {
      float amax = qkv_amax;
      if (m == std::string("o_proj")) {
        amax = 0;
        for (std::uint16_t h : x) {
          const std::uint32_t u = std::uint32_t(h & 0x7FFF) << 16;
          float v;
          std::memcpy(&v, &u, 4);
          amax = std::max(amax, v);
        }
      }
      o.tensor_scale = 2688.0f / amax;
    }
    // codes and scales as the library writes them
    const mxq::Tensor xt = mxq::Tensor::of(const_cast<std::uint16_t*>(x.data()), mxq::DType::bf16, N, K);
    std::vector<std::uint8_t> codes(N * mxq::code_cols(f, K)), scales(N * (K / g));
    mxq::QuantizedOut q;
    q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, N, mxq::code_cols(f, K));
    q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, N, K / g);
    mxq::quantize(xt, q, o);
    const fs::path qd = root / "q";
    EXPECT_EQ(load(qd, mod + (fp8 ? ".weight" : ".weight_packed"), fp8 ? "F8_E4M3" : "U8", {N, fp8 ? K : K / 2}), codes) << mod;
    EXPECT_EQ(load(qd, mod + ".weight_scale", nv ? "F8_E4M3" : "U8", {N, K / g}), scales) << mod;
    if (nv) {
      const auto gs = load(qd, mod + ".weight_global_scale", "F32", {1});
      float S = 0;
      if (gs.size() == 4) std::memcpy(&S, gs.data(), 4);
      EXPECT_EQ(S, *o.tensor_scale) << mod;
    }
    // the error line: SQNR of the dequantized codes (fp32) against x, summed here in plain order
    std::vector<float> yf(x.size());
    mxq::dequantize(mxq::QuantizedIn{q.codes, q.scales}, mxq::Tensor::of(yf.data(), mxq::DType::f32, N, K), o);
    EXPECT_NE(qlog.find(mod + ".weight [" + std::to_string(N) + ", " + std::to_string(K) + "] BF16 -> " + format + ": " +
                        sqnr_text(x, yf)),
              std::string::npos)
        << mod << "\n" << qlog;
    // dequantized weights equal the library's QDQ
    std::vector<std::uint16_t> y(x.size());
    mxq::qdq(xt, mxq::Tensor::of(y.data(), mxq::DType::bf16, N, K), o);
    const auto got = load(root / "dq", mod + ".weight", "BF16", {N, K});
    EXPECT_EQ(got.size(), y.size() * 2);
    if (got.size() == y.size() * 2) EXPECT_EQ(std::memcmp(got.data(), y.data(), got.size()), 0) << mod;
  }
  // `mxq qdq` of the same format uses the same default rule: its weights are the dequantized ones
  // (for mxfp8 it used `even` while quantize wrote compressed-tensors' rule)
  qa.out = (root / "fq").string();
  qa.fake = true;
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string flog = testing::internal::GetCapturedStdout();
  for (const char* m : {"q_proj", "o_proj"}) {
    const std::string n = std::string("model.layers.0.self_attn.") + m + ".weight";
    const std::vector<std::int64_t> shape = m == std::string("o_proj") ? std::vector<std::int64_t>{128, 64} : std::vector<std::int64_t>{64, 128};
    const auto fq = load(root / "fq", n, "BF16", shape);
    EXPECT_EQ(fq, load(root / "dq", n, "BF16", shape)) << n;
    // its error line: the QDQ'd bf16 weights against the original
    std::vector<float> yf(fq.size() / 2);
    for (std::size_t i = 0; i < yf.size(); ++i) yf[i] = mxq::bf16_to_f32(std::uint16_t(fq[2 * i] | fq[2 * i + 1] << 8));
    EXPECT_NE(flog.find(n + " [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + "] BF16 -> qdq " + format +
                        ": " + sqnr_text(data.at(n), yf)),
              std::string::npos)
        << n << "\n" << flog;
  }
  // unquantized tensors are copied byte for byte
  for (const char* n : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.odd_proj.weight",
                        "model.layers.0.input_layernorm.weight"}) {
    const auto& x = data.at(n);
    std::vector<std::int64_t> shape;
    for (const Spec& s : kSpecs)
      if (s.name == n) shape = s.shape;
    const auto got = load(root / "q", n, "BF16", shape);
    EXPECT_EQ(got.size(), x.size() * 2);
    if (got.size() == x.size() * 2) EXPECT_EQ(std::memcmp(got.data(), x.data(), got.size()), 0) << n;
  }
  // config: the quantization_config, ignore list, side files
  const json cfg = json::parse(std::ifstream(root / "q" / "config.json"));
  ASSERT_TRUE(cfg.contains("quantization_config"));
  const json& qc = cfg["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "compressed-tensors");
  EXPECT_EQ(qc["format"], nv ? "nvfp4-pack-quantized" : fp8 ? "mxfp8-quantized" : "mxfp4-pack-quantized");
  EXPECT_EQ(qc["config_groups"]["group_0"]["weights"]["group_size"], g);
  const auto ign = qc["ignore"].get<std::vector<std::string>>();
  EXPECT_NE(std::find(ign.begin(), ign.end(), "lm_head"), ign.end());
  EXPECT_NE(std::find(ign.begin(), ign.end(), "model.layers.0.mlp.odd_proj"), ign.end());
  EXPECT_EQ(cfg["hidden_size"], 128);
  EXPECT_TRUE(fs::exists(root / "q" / "tokenizer.json"));
  EXPECT_FALSE(json::parse(std::ifstream(root / "dq" / "config.json")).contains("quantization_config"));
  // inspect --against: the error of each quantized module against the original checkpoint
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_inspect_against((root / "q" / "model-00001-of-00002.safetensors").string(), (root / "in").string()), 0);
  const std::string report = testing::internal::GetCapturedStdout();
  EXPECT_NE(report.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << report;
  EXPECT_NE(report.find("(dequantized)"), std::string::npos) << report;
  EXPECT_NE(report.find("4 tensors compared"), std::string::npos) << report;  // q, k (quantized), embed, norm (copies)
  // nothing temporary left behind
  for (const char* d : {"q", "dq"})
    for (const auto& e : fs::directory_iterator(root / d))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Formats, Checkpoint, testing::Values("mxfp4", "mxfp8", "nvfp4"));


// dequantize checks every quantized tensor's dtype against the format before reading its bytes: codes
// that are not U8, scales of the wrong kind and a global scale that is not F32 are refused, naming the
// tensor, what it got and what was expected.
TEST(CheckpointErrors, DequantizeRefusesTensorsOfTheWrongDtype) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_dt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  make_checkpoint(root / "in");
  for (const auto& [format, tensor, dtype, expect] :
       {std::tuple<std::string, std::string, std::string, std::string>{"mxfp4", "weight_packed", "I8", "expected U8"},
        {"mxfp4", "weight_scale", "I8", "expected U8"},
        {"nvfp4", "weight_scale", "U8", "expected F8_E4M3"},
        {"nvfp4", "weight_global_scale", "I32", "expected F32"}}) {
    SCOPED_TRACE(format + " " + tensor + " as " + dtype);
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / ("q_" + format)).string();
    qa.format = format;
    qa.overwrite = true;
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
    retag(root / ("q_" + format) / "model-00001-of-00002.safetensors", "model.layers.0.self_attn.q_proj." + tensor, dtype);
    mxq::cli::DequantizeArgs da;
    da.in = qa.out;
    da.out = (root / "dq").string();
    std::string m;
    try {
      mxq::cli::run_dequantize(da);
      ADD_FAILURE() << "accepted a " << dtype << " " << tensor;
    } catch (const std::exception& e) {
      m = e.what();
    }
    EXPECT_NE(m.find("q_proj." + tensor), std::string::npos) << m;
    EXPECT_NE(m.find(expect), std::string::npos) << m;
    EXPECT_FALSE(fs::exists(root / "dq")) << "a refused dequantize left output behind";
  }
  fs::remove_all(root);
}

// mxq quantize --rotate had<RS>: each quantized weight stored as the library's rotated quantization,
// compressed-tensors' transform_config naming the online input rotation (ignore = the unquantized
// modules), the +-1 Sylvester matrix stored once; what vLLM would get wrong is refused.
TEST(CheckpointQuantize, RotateWritesTheTransformConfigAndRotatedWeights) {
  const fs::path root = scratch("quantize_rotate");
  const auto data = make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "mxfp4";
  qa.rotate = "had32";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string name = "model.layers.0.self_attn.q_proj";
  mxq::QuantOptions o = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
  o.rotation = mxq::Rotation::hadamard;
  o.rotation_size = 32;
  std::vector<std::uint8_t> codes(64 * 64), scales(64 * 4);
  mxq::QuantizedOut q;
  q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, 64, 64);
  q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, 64, 4);
  mxq::quantize(mxq::Tensor::of(const_cast<std::uint16_t*>(data.at(name + ".weight").data()), mxq::DType::bf16, 64, 128), q, o);
  EXPECT_EQ(load(qa.out, name + ".weight_packed", "U8", {64, 64}), codes) << "rotated codes";
  EXPECT_EQ(load(qa.out, name + ".weight_scale", "U8", {64, 4}), scales) << "rotated scales";
  const json qc = json::parse(std::ifstream(root / "q" / "config.json"))["quantization_config"];
  const json& tc = qc["transform_config"]["config_groups"]["mxq"];
  EXPECT_EQ(tc["type"], "hadamard");
  EXPECT_EQ(tc["head_dim"], 32);
  EXPECT_EQ(tc["randomize"], false);
  ASSERT_EQ(tc["apply"].size(), 2u);
  EXPECT_EQ(tc["apply"][0]["location"], "input");
  EXPECT_EQ(tc["apply"][0]["inverse"], false);
  EXPECT_EQ(tc["apply"][1]["location"], "weight_input");
  EXPECT_EQ(tc["apply"][1]["inverse"], true);
  EXPECT_EQ(tc["apply"][0]["ignore"], qc["ignore"]) << "the transform skips exactly the unquantized modules";
  const json ign = qc["ignore"];
  EXPECT_NE(std::find(ign.begin(), ign.end(), "model.layers.0.mlp.odd_proj"), ign.end()) << "K = 40: not rotated";
  // the matrix: once, +-1, Sylvester order
  const json wm = json::parse(std::ifstream(root / "q" / "model.safetensors.index.json"))["weight_map"];
  int mats = 0;
  for (const auto& [k, v] : wm.items())
    if (k.ends_with(".mxq_input.weight")) {
      ++mats;
      const std::vector<std::uint8_t> b = load(qa.out, k, "F32", {32, 32});
      std::vector<float> h(32 * 32);
      std::memcpy(h.data(), b.data(), b.size());
      for (int i = 0; i < 32; ++i)
        for (int j = 0; j < 32; ++j) ASSERT_EQ(h[i * 32 + j], (__builtin_popcount(unsigned(i & j)) & 1) ? -1.0f : 1.0f) << i << " " << j;
    }
  EXPECT_EQ(mats, 1);
  // mxq dequantize rotates the weights back (the bytes of `mxq qdq --rotate`), drops the matrix and the
  // transform; a transform mxq could not undo is refused
  mxq::cli::DequantizeArgs da;
  da.in = qa.out;
  da.out = (root / "dq").string();
  ASSERT_EQ(mxq::cli::run_dequantize(da), 0);
  mxq::cli::QuantizeArgs fa = qa;
  fa.fake = true;
  fa.out = (root / "fq").string();
  ASSERT_EQ(mxq::cli::run_quantize(fa), 0);
  for (const std::string m : {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"}) {
    const std::vector<std::int64_t> shape = m.ends_with("q_proj") ? std::vector<std::int64_t>{64, 128} : std::vector<std::int64_t>{128, 64};
    EXPECT_EQ(load(da.out, m + ".weight", "BF16", shape), load(fa.out, m + ".weight", "BF16", shape)) << m << ": rotated back";
  }
  const json dwm = json::parse(std::ifstream(root / "dq" / "model.safetensors.index.json"))["weight_map"];
  for (const auto& [k, v] : dwm.items()) EXPECT_FALSE(k.ends_with("_input.weight")) << k;
  EXPECT_FALSE(json::parse(std::ifstream(root / "dq" / "config.json")).contains("quantization_config"));
  {
    json cfg = json::parse(std::ifstream(root / "q" / "config.json"));
    cfg["quantization_config"]["transform_config"]["config_groups"]["mxq"]["randomize"] = true;
    std::ofstream(root / "q" / "config.json") << cfg.dump();
    da.out = (root / "dq2").string();
    try {
      mxq::cli::run_dequantize(da);
      ADD_FAILURE() << "a randomized transform accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("randomized"), std::string::npos) << e.what();
    }
  }
  // refusals
  qa.out = (root / "r").string();
  qa.rotate = "rhad32";
  EXPECT_NE(quantize_failure(qa, "--rotate rhad32").find("deterministic Hadamard"), std::string::npos);
  qa.rotate = "had32";
  {  // a bias on a rotated Linear
    const fs::path in = root / "bias";
    fs::create_directories(in);
    st::Writer w((in / "model.safetensors").string());
    std::vector<std::uint16_t> wv(32 * 64, to_bf16(0.5f)), bv(32, to_bf16(0.1f));
    w.declare("model.layers.0.self_attn.q_proj.weight", "BF16", {32, 64});
    w.declare("model.layers.0.self_attn.q_proj.bias", "BF16", {32});
    w.write("model.layers.0.self_attn.q_proj.weight", {reinterpret_cast<const std::uint8_t*>(wv.data()), wv.size() * 2});
    w.write("model.layers.0.self_attn.q_proj.bias", {reinterpret_cast<const std::uint8_t*>(bv.data()), bv.size() * 2});
    w.commit();
    qa.in = in.string();
    EXPECT_NE(quantize_failure(qa, "--rotate over a bias").find("has a bias"), std::string::npos);
  }
  {  // per-expert Linear weights of an MoE block
    const fs::path in = root / "moe";
    fs::create_directories(in);
    st::Writer w((in / "model.safetensors").string());
    std::vector<std::uint16_t> wv(32 * 64, to_bf16(0.5f));
    w.declare("model.layers.0.mlp.experts.0.up_proj.weight", "BF16", {32, 64});
    w.write("model.layers.0.mlp.experts.0.up_proj.weight", {reinterpret_cast<const std::uint8_t*>(wv.data()), wv.size() * 2});
    w.commit();
    qa.in = in.string();
    EXPECT_NE(quantize_failure(qa, "--rotate over MoE experts").find("MoE expert"), std::string::npos);
  }
}

// dequantize of a rotated checkpoint whose transform_config's head_dim contradicts its stored matrix
// is refused (it used to rotate back by head_dim, the wrong size, without a word).
TEST(CheckpointErrors, DequantizeRefusesAHeadDimThatContradictsTheMatrix) {
  const fs::path root = scratch("headdim");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "mxfp4";
  qa.rotate = "had32";
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  json cfg = json::parse(std::ifstream(root / "q" / "config.json"));
  cfg["quantization_config"]["transform_config"]["config_groups"]["mxq"]["head_dim"] = 64;
  std::ofstream(root / "q" / "config.json", std::ios::trunc) << cfg.dump();
  mxq::cli::DequantizeArgs da;
  da.in = (root / "q").string();
  da.out = (root / "d").string();
  da.device = "cpu";
  std::string e;
  testing::internal::CaptureStdout();
  try {
    mxq::cli::run_dequantize(da);
  } catch (const std::exception& x) {
    e = x.what();
  }
  testing::internal::GetCapturedStdout();
  EXPECT_NE(e.find("head_dim is 64"), std::string::npos) << (e.empty() ? "accepted" : e);
  EXPECT_FALSE(fs::exists(root / "d"));
  fs::remove_all(root);
}

// ---- the layout's functions on their own, no files --------------------------------------------------
namespace {

// Safetensors bytes in memory holding the declared tensors (data zero, but for `fill`'s bytes).
std::vector<std::uint8_t> safetensors_bytes(const std::vector<mxq::cli::TensorDecl>& ts,
                                            const std::map<std::string, std::vector<std::uint8_t>>& fill = {}) {
  json h = json::object();
  std::vector<std::uint8_t> data;
  for (const auto& t : ts) {
    std::size_t n = std::size_t(st::find_dtype(t.dtype)->bytes);
    for (auto d : t.shape) n *= std::size_t(d);
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + n}}};
    const auto it = fill.find(t.name);
    if (it != fill.end()) data.insert(data.end(), it->second.begin(), it->second.end());
    else data.resize(data.size() + n, 0);
  }
  std::string hs = h.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');
  std::string b(8, '\0');  // the header's size, little-endian
  for (int i = 0; i < 8; ++i) b[i] = char((std::uint64_t(hs.size()) >> (8 * i)) & 0xff);
  b += hs;
  b.append(data.begin(), data.end());
  return std::vector<std::uint8_t>(b.begin(), b.end());
}

}  // namespace

// What a quantized [N, K] weight becomes in each layout, and the reader finding exactly that module
// again (format, shape, NVFP4's tensor scale) in a file holding those tensors.
TEST(CompressedTensors, QuantizedTensorsReadBackAsTheirModule) {
  using mxq::cli::TensorDecl;
  struct Row {
    Format format;
    std::vector<TensorDecl> expect;
  };
  const std::vector<Row> rows = {
      {Format::mxfp4, {{"m.proj.weight_packed", "U8", {8, 32}}, {"m.proj.weight_scale", "U8", {8, 2}}}},
      {Format::mxfp8_e4m3, {{"m.proj.weight", "F8_E4M3", {8, 64}}, {"m.proj.weight_scale", "U8", {8, 2}}}},
      {Format::nvfp4,
       {{"m.proj.weight_packed", "U8", {8, 32}}, {"m.proj.weight_scale", "F8_E4M3", {8, 4}}, {"m.proj.weight_global_scale", "F32", {1}}}},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(mxq::to_string(r.format));
    const std::vector<TensorDecl> got = mxq::cli::quantized_tensors(r.format, "m.proj", 8, 64);
    ASSERT_EQ(got.size(), r.expect.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].name, r.expect[i].name);
      EXPECT_EQ(got[i].dtype, r.expect[i].dtype) << got[i].name;
      EXPECT_EQ(got[i].shape, r.expect[i].shape) << got[i].name;
    }
    std::vector<TensorDecl> file = got;
    file.push_back({"m.norm.weight", "BF16", {64}});
    const float S = 0.375f;
    std::vector<std::uint8_t> s4(4);
    std::memcpy(s4.data(), &S, 4);
    const auto bytes = safetensors_bytes(file, {{"m.proj.weight_global_scale", s4}});
    const st::View v({bytes.data(), bytes.size()}, "mem.safetensors");
    const auto mods = mxq::cli::quantized_modules(v, "mem.safetensors");
    ASSERT_EQ(mods.size(), 1u);
    const mxq::cli::QuantizedModule& m = mods.at("m.proj");
    EXPECT_EQ(m.format, r.format);
    EXPECT_EQ(m.N, 8);
    EXPECT_EQ(m.K, 64);
    EXPECT_EQ(m.codes->name, got[0].name);
    EXPECT_EQ(m.scale->name, "m.proj.weight_scale");
    EXPECT_EQ(m.global != nullptr, r.format == Format::nvfp4);
    if (r.format == Format::nvfp4) EXPECT_EQ(m.options.tensor_scale, S);
    // a scale that does not fit the codes is refused naming it
    file[1].shape = {8, 3};
    const auto bad = safetensors_bytes(file);
    try {
      mxq::cli::quantized_modules(st::View({bad.data(), bad.size()}, "bad.safetensors"), "bad.safetensors");
      ADD_FAILURE() << "a scale of the wrong shape accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("bad.safetensors: tensor 'm.proj.weight_scale': shape does not match codes of [8, 64]"),
                std::string::npos) << e.what();
    }
  }
}

// The quantization_config of each layout, and the transform_config --rotate adds (its ignore list the
// config's); the +-1 matrix is orthogonal up to n (H H^T = n I).
TEST(CompressedTensors, QuantizationConfigAndTransform) {
  const std::vector<std::string> ignore = {"lm_head", "model.embed_tokens"};
  for (const Format f : {Format::mxfp4, Format::mxfp8_e4m3, Format::nvfp4}) {
    SCOPED_TRACE(mxq::to_string(f));
    const json qc = mxq::cli::quantization_config(f, ignore, 0);
    const json& w = qc["config_groups"]["group_0"]["weights"];
    EXPECT_EQ(qc["quant_method"], "compressed-tensors");
    EXPECT_EQ(qc["format"], mxq::cli::compressed_tensors_format(f));
    EXPECT_EQ(qc["config_groups"]["group_0"]["format"], qc["format"]);
    EXPECT_EQ(qc["ignore"], json(ignore));
    EXPECT_EQ(w["num_bits"], f == Format::mxfp8_e4m3 ? 8 : 4);
    EXPECT_EQ(w["group_size"], f == Format::nvfp4 ? 16 : 32);
    EXPECT_EQ(w["strategy"], f == Format::nvfp4 ? "tensor_group" : "group");
    EXPECT_EQ(w["scale_dtype"], f == Format::nvfp4 ? "torch.float8_e4m3fn" : "torch.uint8");
    EXPECT_EQ(qc["transform_config"], json::object());
  }
  EXPECT_STREQ(mxq::cli::compressed_tensors_format(Format::mxfp4), "mxfp4-pack-quantized");
  EXPECT_STREQ(mxq::cli::compressed_tensors_format(Format::mxfp8_e4m3), "mxfp8-quantized");
  EXPECT_STREQ(mxq::cli::compressed_tensors_format(Format::nvfp4), "nvfp4-pack-quantized");
  const json tc = mxq::cli::quantization_config(Format::nvfp4, ignore, 64)["transform_config"]["config_groups"]["mxq"];
  EXPECT_EQ(tc["head_dim"], 64);
  EXPECT_EQ(tc["apply"][0]["ignore"], json(ignore));
  EXPECT_EQ(tc["apply"][1]["location"], "weight_input");
  EXPECT_EQ(mxq::cli::rotation_matrix_name("m.q_proj"), "m.q_proj.mxq_input.weight");
  for (const int n : {16, 64}) {
    const std::vector<float> h = mxq::cli::hadamard_matrix(n);
    ASSERT_EQ(h.size(), std::size_t(n) * n);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        float dot = 0;
        for (int k = 0; k < n; ++k) dot += h[std::size_t(i) * n + k] * h[std::size_t(j) * n + k];
        ASSERT_EQ(dot, i == j ? float(n) : 0.0f) << n << ": rows " << i << ", " << j;
      }
  }
}

// config.json gets the quantization_config; a config without a dtype gets bfloat16 (said on
// stdout), an explicit other dtype stays (a note on stderr).
TEST(CompressedTensors, ConfigDtype) {
  const json qc = mxq::cli::quantization_config(Format::mxfp4, {"lm_head"}, 0);
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const json none = json::parse(mxq::cli::config_with_quantization(json::parse(R"({"hidden_size": 8})"), qc));
  const json bf16 = json::parse(mxq::cli::config_with_quantization(json::parse(R"({"dtype": "bfloat16"})"), qc));
  const json f16 = json::parse(mxq::cli::config_with_quantization(json::parse(R"({"torch_dtype": "float16"})"), qc));
  const std::string said = testing::internal::GetCapturedStdout(), noted = testing::internal::GetCapturedStderr();
  EXPECT_EQ(none["torch_dtype"], "bfloat16");
  EXPECT_EQ(none["quantization_config"], qc);
  EXPECT_EQ(none["hidden_size"], 8);
  EXPECT_FALSE(bf16.contains("torch_dtype"));
  EXPECT_EQ(f16["torch_dtype"], "float16");
  EXPECT_NE(said.find("config.json: torch_dtype bfloat16 added"), std::string::npos) << said;
  EXPECT_NE(noted.find("config.json says dtype float16"), std::string::npos) << noted;
}
