// mxq quantize / dequantize on a two-shard checkpoint this test writes: the files vLLM reads (names,
// dtypes, shapes, index, config) and the numbers, checked against the library's own quantize and qdq.
#include <chrono>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "convert.hpp"
#include "engine.hpp"
#include "safetensors.hpp"
#include "staging.hpp"

namespace fs = std::filesystem;
namespace st = mxq::st;
using json = nlohmann::json;

namespace {

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
  int shard;
};

const std::vector<Spec> kSpecs = {
    {"model.embed_tokens.weight", {100, 128}, 0},
    {"model.layers.0.input_layernorm.weight", {128}, 0},
    {"model.layers.0.self_attn.q_proj.weight", {64, 128}, 0},
    {"model.layers.0.self_attn.k_proj.weight", {32, 128}, 0},
    {"model.layers.0.self_attn.v_proj.weight", {32, 128}, 1},  // shares q/k's NVFP4 scale across shards
    {"model.layers.0.self_attn.o_proj.weight", {128, 64}, 1},
    {"model.layers.0.mlp.odd_proj.weight", {8, 40}, 1},  // K = 40: vLLM could not load it quantized
    {"lm_head.weight", {100, 128}, 1},
};

constexpr auto to_bf16 = mxq::f32_to_bf16;  // mxq/convert.hpp

// "SQNR 12.34 dB" of bf16 weights x against y, the tool's figure, summed in element order (the tool
// sums bands in parallel and lanes interleaved: the same figure to its two decimals).
std::string sqnr_text(const std::vector<std::uint16_t>& x, const std::vector<float>& y) {
  double e = 0, r = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double xv = mxq::bf16_to_f32(x[i]), d = double(y[i]) - xv;
    e += d * d;
    r += xv * xv;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "SQNR %.2f dB", 10 * std::log10(r / e));
  return buf;
}

std::map<std::string, std::vector<std::uint16_t>> make_checkpoint(const fs::path& dir) {
  fs::create_directories(dir);
  std::map<std::string, std::vector<std::uint16_t>> data;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  json wm = json::object();
  for (int s = 0; s < 2; ++s) {
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
    st::Writer w((dir / file).string());
    for (const Spec& sp : kSpecs)
      if (sp.shard == s) {
        w.declare(sp.name, "BF16", sp.shape);
        wm[sp.name] = file;
      }
    for (const Spec& sp : kSpecs)
      if (sp.shard == s) {
        std::int64_t n = 1;
        for (auto d : sp.shape) n *= d;
        std::vector<std::uint16_t> v(n);
        for (std::int64_t i = 0; i < n; ++i) v[i] = to_bf16(nd(rng) * (i % 37 == 3 ? 20.0f : 1.0f));
        w.write(sp.name, {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
        data[sp.name] = std::move(v);
      }
    w.commit();
  }
  std::ofstream(dir / "model.safetensors.index.json") << json{{"metadata", {{"total_size", 0}}}, {"weight_map", wm}}.dump();
  std::ofstream(dir / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 128})";
  std::ofstream(dir / "tokenizer.json") << "{}";
  return data;
}

// Loads one tensor of an output checkpoint through its index.
std::vector<std::uint8_t> load(const fs::path& dir, const std::string& name, const std::string& dtype,
                               std::vector<std::int64_t> shape) {
  json idx = json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(idx["weight_map"].contains(name)) << name;
  if (!idx["weight_map"].contains(name)) return {};
  const st::File f((dir / idx["weight_map"][name].get<std::string>()).string());
  const st::TensorInfo* t = f.view().find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
  return {f.view().data(*t).begin(), f.view().data(*t).end()};
}

// The message run_quantize fails with; a test failure (and "") when it does not fail.
std::string quantize_failure(const mxq::cli::QuantizeArgs& qa, const std::string& what) {
  try {
    mxq::cli::run_quantize(qa);
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted " << what;
  return "";
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

TEST(CheckpointErrors, OneLineNamingTheProblem) {
  mxq::cli::QuantizeArgs qa;
  qa.in = "/nonexistent/dir";
  qa.out = testing::TempDir() + "/never";
  const std::string missing = quantize_failure(qa, "a missing input");
  EXPECT_NE(missing.find("/nonexistent/dir"), std::string::npos) << missing;
  qa.format = "int3";
  EXPECT_THROW(mxq::cli::run_quantize(qa), std::exception);
}

TEST(CheckpointQdq, FakeQuantizedWeightsMatchTheLibrary) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_qdq_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const auto data = make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "fq").string();
  qa.format = "mxfp6_e3m2";
  qa.rule = "rceil";
  qa.fake = true;
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  // Every weight keeps its name, dtype and shape; the quantizable ones equal mxq::qdq, K = 40 included.
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.odd_proj.weight"}) {
    const auto& x = data.at(n);
    std::vector<std::int64_t> shape;
    for (const Spec& s : kSpecs)
      if (s.name == n) shape = s.shape;
    std::vector<std::uint16_t> y(x.size());
    mxq::qdq(mxq::Tensor::of(const_cast<std::uint16_t*>(x.data()), mxq::DType::bf16, shape[0], shape[1]),
             mxq::Tensor::of(y.data(), mxq::DType::bf16, shape[0], shape[1]),
             mxq::QuantOptions::mx(mxq::Format::mxfp6_e3m2, mxq::ScaleRule::rceil));
    const auto got = load(root / "fq", n, "BF16", shape);
    ASSERT_EQ(got.size(), y.size() * 2) << n;
    EXPECT_EQ(std::memcmp(got.data(), y.data(), got.size()), 0) << n;
  }
  const auto head = load(root / "fq", "lm_head.weight", "BF16", {100, 128});  // left alone
  ASSERT_EQ(head.size(), data.at("lm_head.weight").size() * 2);
  EXPECT_EQ(std::memcmp(head.data(), data.at("lm_head.weight").data(), head.size()), 0);
  EXPECT_FALSE(json::parse(std::ifstream(root / "fq" / "config.json")).contains("quantization_config"));
  fs::remove_all(root);
}

TEST(CheckpointErrors, CorruptShardLeavesNoOutput) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_bad_" + std::to_string(::getpid()));
  fs::remove_all(root);
  make_checkpoint(root / "in");
  const fs::path bad = root / "in" / "model-00002-of-00002.safetensors";
  fs::resize_file(bad, 200);  // truncated: the header now claims more than the file holds
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  const std::string m = quantize_failure(qa, "a truncated shard");
  EXPECT_NE(m.find("model-00002-of-00002.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(root / "q")) << "a failed conversion left output behind";
  fs::remove_all(root);
}

// A tensor at an odd offset (after a 1-byte tensor) is copied to aligned memory before quantizing.
TEST(CheckpointQuantize, MisalignedTensorInALoneFile) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_odd_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  std::vector<std::uint16_t> x(32 * 64);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = to_bf16(nd(rng));
  {
    st::Writer w((root / "odd.safetensors").string());
    w.declare("pad", "U8", {1});
    w.declare("proj.weight", "BF16", {32, 64});
    const std::uint8_t one = 7;
    w.write("pad", {&one, 1});
    w.write("proj.weight", {reinterpret_cast<const std::uint8_t*>(x.data()), x.size() * 2});
    w.commit();
  }
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "odd.safetensors").string();
  qa.out = (root / "q").string();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  std::vector<std::uint8_t> codes(32 * 32), scales(32 * 2);
  mxq::QuantizedOut q;
  q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, 32, 32);
  q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, 32, 2);
  mxq::quantize(mxq::Tensor::of(x.data(), mxq::DType::bf16, 32, 64), q,
                mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even));
  const st::File f((root / "q" / "odd.safetensors").string());
  const st::TensorInfo* packed = f.view().find("proj.weight_packed");
  ASSERT_NE(packed, nullptr);
  EXPECT_TRUE(std::equal(codes.begin(), codes.end(), f.view().data(*packed).begin()));
  EXPECT_TRUE(fs::exists(root / "q" / "quantization_config.json"));
  fs::remove_all(root);
}

namespace {
// Every regular file under dir (relative name -> bytes).
std::map<std::string, std::string> read_tree(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) {
      std::ifstream f(e.path(), std::ios::binary);
      files[fs::relative(e.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(f), {});
    }
  return files;
}
}  // namespace

// --device: an unknown name is refused; cuda without a usable GPU is refused, saying why.
TEST(CheckpointDevice, RefusesUnknownOrUnusableDevices) {
  mxq::cli::QuantizeArgs qa;
  qa.in = "/nonexistent/dir";
  qa.out = testing::TempDir() + "/never";
  qa.device = "gpu";
  const std::string unknown = quantize_failure(qa, "--device gpu");
  EXPECT_NE(unknown.find("expected cpu, cuda or auto"), std::string::npos) << unknown;
  qa.device = "cpu";
  qa.gpus = 2;
  const std::string cpu_gpus = quantize_failure(qa, "--device cpu --gpus 2");
  EXPECT_NE(cpu_gpus.find("--gpus 2 with --device cpu: expected --device cuda or auto"), std::string::npos) << cpu_gpus;
  qa.device = "cuda";
  qa.gpus = -1;
  const std::string negative = quantize_failure(qa, "--gpus -1");
  EXPECT_NE(negative.find("--gpus -1: expected 0 (every visible GPU) or more"), std::string::npos) << negative;
  qa.gpus = 0;
  if (mxq::cuda_available()) {  // more GPUs than are visible: refused whether --device is cuda or auto
    const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_gpus_" + std::to_string(::getpid()));
    fs::remove_all(root);
    make_checkpoint(root / "in");
    for (const char* dev : {"cuda", "auto"}) {
      mxq::cli::QuantizeArgs qg = qa;
      qg.in = (root / "in").string();
      qg.out = (root / "out").string();
      qg.device = dev;
      qg.gpus = 4096;
      testing::internal::CaptureStdout();
      const std::string more = quantize_failure(qg, std::string("--device ") + dev + " --gpus 4096");
      testing::internal::GetCapturedStdout();
      EXPECT_NE(more.find("--gpus 4096: "), std::string::npos) << more;
      EXPECT_NE(more.find(" visible (CUDA_VISIBLE_DEVICES chooses which)"), std::string::npos) << more;
      EXPECT_FALSE(fs::exists(root / "out")) << "a failed conversion left its output";
    }
    fs::remove_all(root);
  }
  if (!mxq::cuda_available()) {  // GPUs asked for by number with none usable: refused for auto too
    const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_nogpus_" + std::to_string(::getpid()));
    fs::remove_all(root);
    make_checkpoint(root / "in");
    mxq::cli::QuantizeArgs qg = qa;
    qg.in = (root / "in").string();
    qg.out = (root / "out").string();
    qg.device = "auto";
    qg.gpus = 2;
    testing::internal::CaptureStdout();
    const std::string none = quantize_failure(qg, "--device auto --gpus 2 without a GPU");
    testing::internal::GetCapturedStdout();
    EXPECT_NE(none.find("--gpus 2: "), std::string::npos) << none;
    EXPECT_FALSE(fs::exists(root / "out")) << "a failed conversion left its output";
    fs::remove_all(root);
  }
  if (!mxq::cuda_available()) {  // found once the GPU's set-up (on a thread of its own) is settled
    const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_nodev_" + std::to_string(::getpid()));
    fs::remove_all(root);
    make_checkpoint(root / "in");
    qa.in = (root / "in").string();
    qa.out = (root / "out").string();
    qa.device = "cuda";
    for (const bool early : {true, false}) {
      qa.cpu_while_gpu_sets_up = early;
      testing::internal::CaptureStdout();
      const std::string unusable = quantize_failure(qa, "--device cuda without a GPU");
      testing::internal::GetCapturedStdout();
      EXPECT_NE(unusable.find("--device cuda: no usable GPU"), std::string::npos) << unusable;
      EXPECT_FALSE(fs::exists(root / "out")) << "a failed conversion left its output";
    }
    fs::remove_all(root);
  }
}

// The same conversions on the GPU and on the CPU write the same files, byte for byte: quantize to
// each vLLM layout, dequantize each back, and a fake-quantized copy.
TEST(CheckpointDevice, GpuWritesTheSameBytesAsCpu) {
  std::string why;
  if (!mxq::cuda_available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_dev_" + std::to_string(::getpid()));
  fs::remove_all(root);
  make_checkpoint(root / "in");
  struct Case {
    std::string format, rotate;
    bool fake;
  };
  // the vLLM layouts, a fake-quantized copy, and rotated ones (quantize --rotate, its dequantize
  // rotating back; qdq --rotate with random signs)
  const Case cases[] = {{"mxfp4", "", false}, {"mxfp8", "", false},      {"nvfp4", "", false},
                        {"mxfp6_e3m2", "", true}, {"mxfp4", "had32", false}, {"nvfp4", "had64", false},
                        {"mxfp4", "rhad32", true}};
  for (const Case& cs : cases) {
    const std::string format = cs.format + (cs.rotate.empty() ? "" : " --rotate " + cs.rotate) + (cs.fake ? " (qdq)" : "");
    // the CPU; the GPU for every tensor; the GPU with the first tensors on the CPU while it is set up
    std::map<std::string, std::string> tree[3];
    std::vector<std::string> lines[3];  // the per-tensor lines: the error figures (GPU: summed on the device)
    for (int d = 0; d < 3; ++d) {
      const std::string dev = d ? "cuda" : "cpu",
                        tag = cs.format + cs.rotate + (cs.fake ? "_qdq_" : "_") + dev + std::to_string(d);
      mxq::cli::QuantizeArgs qa;
      qa.in = (root / "in").string();
      qa.out = (root / ("q_" + tag)).string();
      qa.format = cs.format;
      qa.rotate = cs.rotate;
      qa.device = dev;
      qa.cpu_while_gpu_sets_up = d == 2;
      qa.gpus = d == 2 ? 1 : 0;  // one GPU named; every visible one (one or several: the same bytes)
      qa.fake = cs.fake;
      testing::internal::CaptureStdout();
      const int rc = mxq::cli::run_quantize(qa);
      std::istringstream log(testing::internal::GetCapturedStdout());
      ASSERT_EQ(rc, 0) << tag << "\n" << log.str();
      if (d == 1) {  // every conversion on the GPU
        EXPECT_NE(log.str().find("device: cuda"), std::string::npos) << log.str();
        EXPECT_EQ(log.str().find("while the GPU was being set up"), std::string::npos) << log.str();
      }
      for (std::string l; std::getline(log, l);)
        if (l.starts_with("[")) lines[d].push_back(l);
      tree[d] = read_tree(qa.out);
      if (!qa.fake) {
        mxq::cli::DequantizeArgs da;
        da.in = qa.out;
        da.out = (root / ("dq_" + tag)).string();
        da.device = dev;
        testing::internal::CaptureStdout();
        const int drc = mxq::cli::run_dequantize(da);
        const std::string dlog = testing::internal::GetCapturedStdout();
        ASSERT_EQ(drc, 0) << tag << "\n" << dlog;
        for (auto& [n, b] : read_tree(da.out)) tree[d]["dq/" + n] = b;
        // inspect --against on this engine: every module dequantized (rotated back) and compared
        mxq::cli::InspectArgs ia;
        ia.file = qa.out;
        ia.against = qa.in;
        ia.device = dev;
        testing::internal::CaptureStdout();
        const int irc = mxq::cli::run_inspect(ia);
        std::istringstream ilog(testing::internal::GetCapturedStdout());
        ASSERT_EQ(irc, 0) << tag << "\n" << ilog.str();
        for (std::string l; std::getline(ilog, l);)
          if (l.find("(dequantized)") != std::string::npos) lines[d].push_back("inspect: " + l);
      }
    }
    EXPECT_FALSE(lines[0].empty()) << format;
    EXPECT_GT(tree[0].size(), 3u) << format;
    for (int d = 1; d < 3; ++d) {
      EXPECT_EQ(lines[0], lines[d]) << format << " " << d << ": the error lines differ between the GPU and the CPU";
      ASSERT_EQ(tree[0].size(), tree[d].size()) << format << " " << d;
      for (const auto& [n, b] : tree[0]) {
        ASSERT_TRUE(tree[d].count(n)) << format << " " << d << ": " << n << " missing from the GPU's output";
        EXPECT_TRUE(tree[d][n] == b) << format << " " << d << ": " << n << " differs between the GPU and the CPU";
      }
    }
  }
  fs::remove_all(root);
}

// The engine's overlapped conversions (the checkpoint conversion's path) give the one-shot
// conversion's bytes, finish in the order started, carry their error statistics (equal to a host
// double sum in element order up to the summation order; on the CPU computed band by band with the
// conversion); starting beyond depth() and the one-shot API with conversions in flight are refused.
TEST(Engine, OverlappedConversionsMatchOneShot) {
  std::vector<std::string> devs{"cpu"};
  std::string why;
  if (mxq::cuda_available(&why)) devs.push_back("cuda");
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::int64_t shapes[3][2] = {{64, 256}, {33, 96}, {128, 512}};
  std::vector<std::uint16_t> x[3];
  for (int i = 0; i < 3; ++i) {
    x[i].resize(shapes[i][0] * shapes[i][1]);
    for (auto& v : x[i]) v = to_bf16(nd(rng) * (rng() % 41 == 0 ? 30.0f : 1.0f));
  }
  for (const std::string& dev : devs) {
    mxq::cli::Engine eng(dev);
    ASSERT_EQ(eng.depth(), dev == "cuda" ? 2 : 1);
    for (const bool fake : {false, true}) {
      const mxq::QuantOptions o = mxq::QuantOptions::nvfp4();
      mxq::QuantOptions os = o;
      os.tensor_scale = 0.75f;
      std::vector<std::uint8_t> codes[3], scales[3], y[3];
      auto start = [&](int i) {
        const std::int64_t N = shapes[i][0], K = shapes[i][1];
        const mxq::Tensor xt = mxq::Tensor::of(x[i].data(), mxq::DType::bf16, N, K);
        if (fake) {
          y[i].assign(N * K * 2, 0xAB);
          eng.start_qdq(xt, mxq::Tensor::of(y[i].data(), mxq::DType::bf16, N, K), os);
          return;
        }
        codes[i].assign(N * K / 2, 0xAB);
        scales[i].assign(N * K / 16, 0xAB);
        mxq::QuantizedOut q;
        q.codes = mxq::Tensor::of(codes[i].data(), mxq::DType::u8, N, K / 2);
        q.scales = mxq::Tensor::of(scales[i].data(), mxq::DType::u8, N, K / 16);
        eng.start_quantize(xt, q, os);
      };
      auto check = [&](int i, const std::optional<mxq::cli::ErrorTotals>& t) {
        const std::int64_t N = shapes[i][0], K = shapes[i][1];
        const mxq::Tensor xt = mxq::Tensor::of(x[i].data(), mxq::DType::bf16, N, K);
        mxq::QuantOptions oc = os;
        oc.backend = mxq::Backend::cpu;
        std::vector<std::uint8_t> rc(N * K / 2), rs(N * K / 16), ry(N * K * 2);
        std::vector<float> deq(N * K);
        if (fake) {
          mxq::qdq(xt, mxq::Tensor::of(ry.data(), mxq::DType::bf16, N, K), oc);
          EXPECT_TRUE(ry == y[i]) << dev << " qdq tensor " << i;
          for (std::int64_t k = 0; k < N * K; ++k) deq[k] = mxq::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(ry.data())[k]);
        } else {
          mxq::QuantizedOut q;
          q.codes = mxq::Tensor::of(rc.data(), mxq::DType::u8, N, K / 2);
          q.scales = mxq::Tensor::of(rs.data(), mxq::DType::u8, N, K / 16);
          mxq::quantize(xt, q, oc);
          EXPECT_TRUE(rc == codes[i] && rs == scales[i]) << dev << " quantize tensor " << i;
          mxq::dequantize(mxq::QuantizedIn{q.codes, q.scales}, mxq::Tensor::of(deq.data(), mxq::DType::f32, N, K), oc);
        }
        ASSERT_TRUE(t.has_value()) << dev;  // the GPU's on the device, the CPU's band by band
        double e = 0, r = 0;
        for (std::int64_t k = 0; k < N * K; ++k) {
          const double xv = mxq::bf16_to_f32(x[i][k]), d = double(deq[k]) - xv;
          e += d * d;
          r += xv * xv;
        }
        EXPECT_NEAR(t->e, e, 1e-9 * e) << dev << " tensor " << i;
        EXPECT_NEAR(t->r, r, 1e-9 * r) << dev << " tensor " << i;
        EXPECT_EQ(t->bad_in, 0);
        EXPECT_EQ(t->bad_out, 0);
      };
      int next = 0, finished = 0;
      while (next < eng.depth()) start(next++);
      EXPECT_THROW(start(next), std::logic_error) << dev;
      EXPECT_THROW(eng.qdq(mxq::Tensor::of(x[0].data(), mxq::DType::bf16, 64, 256),
                           mxq::Tensor::of(y[0].data(), mxq::DType::bf16, 64, 256), os),
                   std::logic_error)
          << dev;
      while (finished < 3) {
        check(finished, eng.finish());
        ++finished;
        if (next < 3) start(next++);
      }
      EXPECT_EQ(eng.in_flight(), 0);
      EXPECT_FALSE(eng.oldest_ready());
      EXPECT_THROW(eng.finish(), std::logic_error);
    }
  }
}

namespace {
// A lone-file checkpoint of the given BF16 tensors (random values), written under dir.
void write_lone_file(const fs::path& file, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& ts) {
  fs::create_directories(file.parent_path());
  st::Writer w(file.string());
  for (const auto& [n, sh] : ts) w.declare(n, "BF16", sh);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const auto& [n, sh] : ts) {
    std::int64_t k = 1;
    for (auto d : sh) k *= d;
    std::vector<std::uint16_t> v(k);
    for (auto& x : v) x = to_bf16(nd(rng));
    w.write(n, {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
  }
  w.commit();
}

fs::path scratch(const std::string& tag) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(root);
  return root;
}
}  // namespace

// A weight with zero columns or zero rows is copied as it is and left in the ignore list: no
// division by K, no empty quantized tensors, no staging directory left behind.
TEST(CheckpointQuantize, EmptyWeightsAreCopiedAndListed) {
  const fs::path root = scratch("empty");
  write_lone_file(root / "in" / "m.safetensors", {{"cols0.weight", {32, 0}}, {"rows0.weight", {0, 64}}, {"proj.weight", {32, 64}}});
  for (const std::string format : {"mxfp4", "mxfp8", "nvfp4", "mxfp6_e3m2"}) {
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in" / "m.safetensors").string();
    qa.out = (root / ("q_" + format)).string();
    qa.format = format;
    qa.fake = format == "mxfp6_e3m2";
    testing::internal::CaptureStdout();
    const int rc = mxq::cli::run_quantize(qa);
    const std::string log = testing::internal::GetCapturedStdout();
    ASSERT_EQ(rc, 0) << format;
    EXPECT_NE(log.find("cols0.weight"), std::string::npos) << log;
    const st::File f((fs::path(qa.out) / "m.safetensors").string());
    for (const auto& [n, sh] : std::vector<std::pair<std::string, std::vector<std::int64_t>>>{{"cols0.weight", {32, 0}}, {"rows0.weight", {0, 64}}}) {
      const st::TensorInfo* t = f.view().find(n);
      ASSERT_NE(t, nullptr) << format << " " << n;
      EXPECT_EQ(t->dtype, "BF16");
      EXPECT_EQ(t->shape, sh);
    }
    EXPECT_NE(f.view().find(qa.fake ? "proj.weight" : format == "mxfp8" ? "proj.weight" : "proj.weight_packed"), nullptr);
    if (!qa.fake) {
      const json qc = json::parse(std::ifstream(fs::path(qa.out) / "quantization_config.json"));
      const auto ign = qc["ignore"].get<std::vector<std::string>>();
      EXPECT_NE(std::find(ign.begin(), ign.end(), "cols0"), ign.end()) << format;
      EXPECT_NE(std::find(ign.begin(), ign.end(), "rows0"), ign.end()) << format;
      // and it dequantizes back
      mxq::cli::DequantizeArgs da;
      da.in = (fs::path(qa.out) / "m.safetensors").string();
      da.out = (root / ("dq_" + format)).string();
      EXPECT_EQ(mxq::cli::run_dequantize(da), 0) << format;
    }
    for (const auto& e : fs::directory_iterator(qa.out))
      EXPECT_EQ(e.path().filename().string().find(".mxq-staging"), std::string::npos) << e.path();
  }
  fs::remove_all(root);
}

// Tensor names are data from the file: a 30000-byte name is refused with one line naming the limit
// (std::regex used to overflow the stack on it), and a name at the limit is matched against a
// backtracking --exclude pattern in bounded time and stack.
TEST(CheckpointErrors, OverlongTensorNamesAreRefused) {
  const fs::path root = scratch("longname");
  const std::string long_name = std::string(30000, 'a') + ".weight";
  write_lone_file(root / "long.safetensors", {{long_name, {32, 64}}});
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "long.safetensors").string();
  qa.out = (root / "q").string();
  const std::string m = quantize_failure(qa, "a 30000-byte tensor name");
  EXPECT_NE(m.find("long.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("exceeds the limit of 1024"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(root / "q"));

  const std::string at_limit = std::string(st::kMaxNameBytes - 20, 'a') + ".weight";  // + "_global_scale" fits
  write_lone_file(root / "ok.safetensors", {{at_limit, {32, 64}}, {"embed.weight", {32, 64}}});
  qa.in = (root / "ok.safetensors").string();
  qa.exclude = {"(a|aa)*c"};  // exponential for a backtracking matcher
  testing::internal::CaptureStdout();
  const int rc = mxq::cli::run_quantize(qa);
  testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0);
  const st::File f((root / "q" / "ok.safetensors").string());
  EXPECT_NE(f.view().find(at_limit.substr(0, at_limit.size() - 7) + ".weight_packed"), nullptr);
  EXPECT_NE(f.view().find("embed.weight"), nullptr);  // the default ignore list, without std::regex
  // a module whose quantized names would pass the limit is left unquantized
  const std::string too_long = std::string(st::kMaxNameBytes - 7, 'b') + ".weight";
  write_lone_file(root / "ok2.safetensors", {{too_long, {32, 64}}});
  qa.in = (root / "ok2.safetensors").string();
  qa.out = (root / "q3").string();
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  EXPECT_NE(st::File((root / "q3" / "ok2.safetensors").string()).view().find(too_long), nullptr);
  qa.in = (root / "ok.safetensors").string();
  qa.exclude = {"(a)\\1"};
  qa.out = (root / "q2").string();
  const std::string br = quantize_failure(qa, "a back-reference");
  EXPECT_NE(br.find("--exclude '(a)\\1'"), std::string::npos) << br;
  fs::remove_all(root);
}

namespace {
// Runs the mxq tool in a child process whose files may not grow past fsize bytes (RLIMIT_FSIZE, as a
// full disk: writes fail with EFBIG, SIGXFSZ ignored). Returns its exit status (-1: killed), and
// its stderr in *err.
int run_tool_with_fsize(const std::vector<std::string>& args, rlim_t fsize, std::string* err) {
  const fs::path log = fs::path(testing::TempDir()) / ("mxq_fsize_" + std::to_string(::getpid()) + ".log");
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::FILE* l = std::fopen(log.c_str(), "w");
    std::FILE* null = std::fopen("/dev/null", "w");
    if (l) ::dup2(::fileno(l), 2);
    if (null) ::dup2(::fileno(null), 1);
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit r{fsize, fsize};
    ::setrlimit(RLIMIT_FSIZE, &r);
    std::vector<char*> argv{const_cast<char*>(MXQ_TOOL_PATH)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(MXQ_TOOL_PATH, argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream f(log);
  *err = std::string(std::istreambuf_iterator<char>(f), {});
  fs::remove(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
}  // namespace

// A full disk: every write is checked after flush, fsync and close; quantize and dequantize exit 2
// naming the file and leave no output (the config.json used to be written empty, exit status 0).
TEST(CheckpointErrors, FullDiskFailsAndLeavesNothing) {
  const fs::path root = scratch("fsize");
  write_lone_file(root / "in" / "model.safetensors", {{"norm.weight", {4}}});  // a ~100-byte output shard
  std::ofstream(root / "in" / "config.json") << json{{"pad", std::string(600, 'x')}}.dump();
  write_lone_file(root / "big" / "model.safetensors", {{"proj.weight", {32, 64}}});  // a 1.2 kB output shard
  for (const std::string cmd : {"quantize", "dequantize"})
    for (const char* in : {"in", "big"}) {
      std::string err;
      const fs::path out = root / (cmd + "_" + in);
      EXPECT_EQ(run_tool_with_fsize({cmd, (root / in).string(), "-o", out.string()}, 400, &err), 2) << cmd << " " << in << ": " << err;
      EXPECT_NE(err.find("write failed"), std::string::npos) << err;
      EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
      EXPECT_FALSE(fs::exists(out)) << cmd << " " << in << ": a failed conversion left output behind";
    }
  std::string err;  // and with room enough, the same command succeeds
  EXPECT_EQ(run_tool_with_fsize({"quantize", (root / "in").string(), "-o", (root / "ok").string()}, 1 << 20, &err), 0) << err;
  EXPECT_TRUE(fs::exists(root / "ok" / "config.json"));
  fs::remove_all(root);
}

// An index naming a PyTorch .bin shard is refused (it used to exit 0, its output shard the original
// .bin copied over the converted one), by name; a zip or pickle named .safetensors, by content.
TEST(CheckpointErrors, RefusesWhatIsNotSafetensors) {
  const fs::path root = scratch("bin");
  write_lone_file(root / "in" / "pytorch_model.bin", {{"proj.weight", {32, 64}}});  // safetensors bytes, .bin name
  std::ofstream(root / "in" / "model.safetensors.index.json")
      << json{{"weight_map", {{"proj.weight", "pytorch_model.bin"}}}}.dump();
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  std::string m = quantize_failure(qa, "an index naming a .bin shard");
  EXPECT_NE(m.find("pytorch_model.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("proj.weight"), std::string::npos) << m;
  EXPECT_NE(m.find("not a .safetensors file"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(root / "q"));
  qa.in = (root / "in" / "pytorch_model.bin").string();
  m = quantize_failure(qa, "a lone .bin file");
  EXPECT_NE(m.find("not a .safetensors file"), std::string::npos) << m;
  // content: a zip archive and a pickle under a .safetensors name
  fs::create_directories(root / "z");
  std::ofstream(root / "z" / "zip.safetensors", std::ios::binary) << std::string("PK\x03\x04", 4) << std::string(200, '\0');
  std::ofstream(root / "z" / "pickle.safetensors", std::ios::binary) << std::string("\x80\x02}q\x00(X", 7) << std::string(200, 'a');
  for (const char* f : {"zip.safetensors", "pickle.safetensors"}) {
    qa.in = (root / "z" / f).string();
    m = quantize_failure(qa, f);
    EXPECT_NE(m.find(f), std::string::npos) << m;
    EXPECT_NE(m.find("PyTorch"), std::string::npos) << m;
  }
  fs::remove_all(root);
}

// The index and the shards disagree: each is an error naming the tensor and the files (they used to
// be dropped, written twice, or an empty weight_map converted nothing and succeeded).
TEST(CheckpointErrors, IndexAndShardsMustAgree) {
  const fs::path root = scratch("index");
  write_lone_file(root / "in" / "a.safetensors", {{"x.weight", {32, 64}}});
  write_lone_file(root / "in" / "b.safetensors", {{"x.weight", {32, 64}}, {"y.weight", {32, 64}}});
  const auto with_index = [&](const json& wm, const std::string& what, const std::vector<std::string>& needles) {
    std::ofstream(root / "in" / "model.safetensors.index.json") << json{{"weight_map", wm}}.dump();
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / "q").string();
    const std::string m = quantize_failure(qa, what);
    for (const std::string& n : needles) EXPECT_NE(m.find(n), std::string::npos) << what << ": " << m;
    EXPECT_FALSE(fs::exists(root / "q")) << what;
  };
  with_index(json::object(), "an empty weight_map", {"weight_map is empty"});
  with_index({{"x.weight", "a.safetensors"}, {"y.weight", "b.safetensors"}}, "x.weight in two shards",
             {"x.weight", "a.safetensors", "b.safetensors", "defined in both"});
  write_lone_file(root / "in" / "b.safetensors", {{"y.weight", {32, 64}}});
  with_index({{"x.weight", "a.safetensors"}, {"y.weight", "b.safetensors"}, {"z.weight", "b.safetensors"}},
             "z.weight absent from its shard", {"z.weight", "b.safetensors", "absent"});
  with_index({{"x.weight", "a.safetensors"}, {"y.weight", "a.safetensors"}}, "y.weight in another shard",
             {"y.weight", "absent from a.safetensors"});
  // a file name with a NUL byte would open another file (the name up to the NUL)
  with_index({{"x.weight", std::string("a.safetensors\0.safetensors", 26)}, {"y.weight", "b.safetensors"}},
             "a NUL in a shard name", {"x.weight", "NUL byte"});
  fs::remove_all(root);
}

// config.json is read and checked before any shard is converted; JSON that is not an object is an
// error naming the file (it was a bare json type_error, found after every shard was converted).
TEST(CheckpointErrors, ConfigIsCheckedFirst) {
  const fs::path root = scratch("config");
  write_lone_file(root / "in" / "model.safetensors", {{"proj.weight", {32, 64}}});
  for (const char* bad : {"[1, 2]", "{\"a\": "}) {
    std::ofstream(root / "in" / "config.json") << bad;
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / "q").string();
    testing::internal::CaptureStdout();
    std::string m;
    try {
      mxq::cli::run_quantize(qa);
    } catch (const std::exception& e) {
      m = e.what();
    }
    const std::string log = testing::internal::GetCapturedStdout();
    EXPECT_NE(m.find("config.json"), std::string::npos) << bad << ": " << m;
    EXPECT_EQ(log.find("proj.weight"), std::string::npos) << "converted before the config was read: " << log;
    mxq::cli::DequantizeArgs da;
    da.in = qa.in;
    da.out = (root / "dq").string();
    try {
      mxq::cli::run_dequantize(da);
      ADD_FAILURE() << "dequantize accepted config " << bad;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(root / "q"));
    EXPECT_FALSE(fs::exists(root / "dq"));
  }
  fs::remove_all(root);
}

// OUT may not be the input (by path, through a symlink, or the directory of a lone input file), may
// not hold the input, and a non-empty OUT is replaced only with --overwrite (then whole: no stale
// shard survives). Every refusal leaves the input byte for byte as it was.
TEST(CheckpointErrors, OutputNeverOverwritesTheInputOrMixesWithStaleFiles) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_out_" + std::to_string(::getpid()));
  fs::remove_all(root);
  make_checkpoint(root / "in");
  const auto before = read_tree(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  auto refused = [&](const fs::path& out, const std::string& what, const std::string& expect) {
    qa.out = out.string();
    const std::string m = quantize_failure(qa, what);
    EXPECT_NE(m.find(expect), std::string::npos) << what << ": " << m;
    EXPECT_EQ(read_tree(root / "in"), before) << what << " changed the input";
  };
  refused(root / "in", "-o equal to the input", "is the input's directory");
  fs::create_directory_symlink(root / "in", root / "link");
  refused(root / "link", "-o a symlink to the input", "is the input's directory");
  qa.overwrite = true;
  refused(root, "-o a directory holding the input, with --overwrite", "holds the input");
  qa.overwrite = false;
  // a lone file: its own directory is the input's directory
  qa.in = (root / "in" / "model-00001-of-00002.safetensors").string();
  refused(root / "in", "-o the directory of a lone input file", "is the input's directory");
  qa.in = (root / "in").string();

  // a non-empty OUT: refused, then replaced whole with --overwrite
  fs::create_directories(root / "out");
  { std::ofstream(root / "out" / "model-00009-of-00009.safetensors") << "stale"; }
  refused(root / "out", "a non-empty OUT without --overwrite", "pass --overwrite");
  EXPECT_TRUE(fs::exists(root / "out" / "model-00009-of-00009.safetensors")) << "a refusal touched OUT";
  qa.overwrite = true;
  qa.out = (root / "out").string();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_FALSE(fs::exists(root / "out" / "model-00009-of-00009.safetensors")) << "a stale shard survived --overwrite";
  EXPECT_TRUE(fs::exists(root / "out" / "model.safetensors.index.json"));
  EXPECT_EQ(read_tree(root / "in"), before);
  // an empty existing OUT needs no flag
  fs::create_directories(root / "empty");
  qa.overwrite = false;
  qa.out = (root / "empty").string();
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  fs::remove_all(root);
}

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
}  // namespace

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

// A FIFO or a device given as IN is named as what it is (it used to say "no such file").
TEST(CheckpointErrors, RefusesAFifoOrDeviceAsInput) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_fifo_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  ASSERT_EQ(::mkfifo((root / "pipe.safetensors").c_str(), 0600), 0);
  mxq::cli::QuantizeArgs qa;
  qa.out = (root / "q").string();
  for (const std::string in : {(root / "pipe.safetensors").string(), std::string("/dev/zero")}) {
    qa.in = in;
    const std::string m = quantize_failure(qa, in);
    EXPECT_NE(m.find("not a regular file"), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(root / "q"));
  fs::remove_all(root);
}

namespace {
// A child process running the mxq tool: stdout and stderr to files, SIGINT/SIGTERM at their default
// (a test runner may have them ignored), killed by SIGALRM after 120 s should it hang.
struct ToolRun {
  pid_t pid = -1;
  fs::path out_log, err_log;
  int status = 0;
  ToolRun(const std::vector<std::string>& args, const std::string& tag) {
    out_log = fs::path(testing::TempDir()) / ("mxq_run_" + tag + "_" + std::to_string(::getpid()) + ".out");
    err_log = fs::path(out_log).replace_extension(".err");
    std::fflush(stdout);
    std::fflush(stderr);
    pid = ::fork();
    if (pid == 0) {
      std::FILE* o = std::fopen(out_log.c_str(), "w");
      std::FILE* e = std::fopen(err_log.c_str(), "w");
      if (o) ::dup2(::fileno(o), 1);
      if (e) ::dup2(::fileno(e), 2);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::alarm(120);
      std::vector<char*> argv{const_cast<char*>(MXQ_TOOL_PATH)};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(MXQ_TOOL_PATH, argv.data());
      ::_exit(127);
    }
  }
  // Waits until `p` exists (the run reached that point) and stops the child there: true, or false
  // when the child ended first.
  bool stop_when_exists(const fs::path& p) {
    for (;;) {
      std::error_code ec;
      if (fs::exists(p, ec)) return ::kill(pid, SIGSTOP) == 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return false;
      }
      ::usleep(200);
    }
  }
  void wait() {
    if (pid > 0) ::waitpid(pid, &status, 0);
    pid = -1;
  }
  std::string err() const {
    std::ifstream f(err_log);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  std::string out() const {
    std::ifstream f(out_log);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  ~ToolRun() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    std::error_code ec;
    fs::remove(out_log, ec);
    fs::remove(err_log, ec);
  }
};

// A checkpoint directory big enough that converting it takes a while (n weights [rows, 4096] BF16,
// cheap pseudo-random values), with a config.json and a tokenizer.json.
void write_big_checkpoint(const fs::path& dir, int n, std::int64_t rows) {
  fs::create_directories(dir);
  st::Writer w((dir / "model.safetensors").string());
  for (int i = 0; i < n; ++i) w.declare("model.layers." + std::to_string(i) + ".mlp.down_proj.weight", "BF16", {rows, 4096});
  std::vector<std::uint16_t> v(rows * 4096);
  std::uint32_t s = 12345;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = std::uint16_t(0x3C00 + ((s >> 16) & 0x07FF)) | std::uint16_t((s >> 15) & 0x8000);  // |x| in [2^-7, 2^-6)
  }
  for (int i = 0; i < n; ++i)
    w.write("model.layers." + std::to_string(i) + ".mlp.down_proj.weight", {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
  w.commit();
  std::ofstream(dir / "config.json") << R"({"architectures": ["LlamaForCausalLM"]})";
  std::ofstream(dir / "tokenizer.json") << "{}";
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> r;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) r.push_back(e.path().filename().string());
  std::sort(r.begin(), r.end());
  return r;
}
}  // namespace

// Publishing is all or nothing: when a final rename fails (here config.json appears in OUT as a
// directory while the conversion runs), the command exits 2 naming it and leaves OUT as it was: no
// shard, no index, no staging directory (the shards and index used to stay in OUT).
TEST(CheckpointErrors, PublishingIsAllOrNothing) {
  const fs::path root = scratch("publish");
  write_big_checkpoint(root / "in", 8, 512);
  const fs::path out = root / "out";
  ToolRun run({"quantize", (root / "in").string(), "-o", out.string(), "--device", "cpu"}, "publish");
  ASSERT_TRUE(run.stop_when_exists(out / (".mxq-staging-" + std::to_string(run.pid))))
      << "the conversion ended before the test could stop it: " << run.err();
  fs::create_directories(out / "config.json" / "x");  // another process writing into OUT meanwhile
  ::kill(run.pid, SIGCONT);
  run.wait();
  ASSERT_TRUE(WIFEXITED(run.status)) << run.status;
  EXPECT_EQ(WEXITSTATUS(run.status), 2) << run.err();
  EXPECT_NE(run.err().find("config.json"), std::string::npos) << run.err();
  EXPECT_EQ(entries(out), std::vector<std::string>{"config.json"}) << "a failed publish left part of the conversion in OUT";
  EXPECT_EQ(entries(out / "config.json"), std::vector<std::string>{"x"});
  fs::remove_all(root);
}

// SIGTERM and SIGINT mid-conversion: the run stops, removes its staging directory (and the OUT it
// created), and ends by the same signal. A SIGKILLed run cannot clean up: the next run into the same
// OUT removes its staging directory (its process is gone) and says so, without needing --overwrite.
TEST(CheckpointInterrupt, SignalsLeaveNothingAndStaleStagingIsRemoved) {
  const fs::path root = scratch("signal");
  write_big_checkpoint(root / "in", 8, 512);
  for (const int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(strsignal(sig));
    const fs::path out = root / ("out_" + std::to_string(sig));
    ToolRun run({"qdq", (root / "in").string(), "-o", out.string(), "--device", "cpu"}, "signal");
    ASSERT_TRUE(run.stop_when_exists(out / (".mxq-staging-" + std::to_string(run.pid))))
        << "the conversion ended before the test could stop it: " << run.err();
    ::kill(run.pid, sig);  // pending while stopped: delivered mid-conversion
    ::kill(run.pid, SIGCONT);
    run.wait();
    EXPECT_TRUE(WIFSIGNALED(run.status) && WTERMSIG(run.status) == sig) << run.status << ": " << run.err();
    EXPECT_NE(run.err().find("interrupted"), std::string::npos) << run.err();
    EXPECT_FALSE(fs::exists(out)) << "an interrupted run left " << testing::PrintToString(entries(out));
  }
  // SIGKILL: the staging directory stays, then the next run removes it
  const fs::path out = root / "out_kill";
  std::string stale;
  {
    ToolRun run({"qdq", (root / "in").string(), "-o", out.string(), "--device", "cpu"}, "kill");
    stale = ".mxq-staging-" + std::to_string(run.pid);
    ASSERT_TRUE(run.stop_when_exists(out / stale)) << run.err();
    ::kill(run.pid, SIGKILL);
    run.wait();
  }
  ASSERT_TRUE(fs::exists(out / stale));
  // beside it: a live process's staging directory (this test's parent) and names of another pattern
  const std::string live = ".mxq-staging-" + std::to_string(::getppid());
  for (const std::string& d : {live, std::string(".mxq-staging-12x"), std::string(".mxq-staging-007")})
    fs::create_directories(out / d);
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = out.string();
  qa.fake = true;
  testing::internal::CaptureStderr();
  const std::string m = quantize_failure(qa, "OUT holding a live run's staging directory");
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(m.find("not empty"), std::string::npos) << m;
  EXPECT_NE(said.find("removed " + (out / stale).string()), std::string::npos) << said;
  std::vector<std::string> kept{live, ".mxq-staging-007", ".mxq-staging-12x"};
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(entries(out), kept);
  for (const std::string& d : {live, std::string(".mxq-staging-12x"), std::string(".mxq-staging-007")}) fs::remove(out / d);
  // a dead pid's directory whose lock another process holds (a run in another PID namespace) is kept
  fs::create_directories(out / stale);
  const int fd = ::open((out / stale).c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  EXPECT_EQ(mxq::cli::remove_stale_staging(out), 0);
  EXPECT_TRUE(fs::exists(out / stale));
  ::close(fd);
  // and with nothing else in OUT, the run proceeds without --overwrite
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  EXPECT_NE(testing::internal::GetCapturedStderr().find("removed"), std::string::npos);
  EXPECT_FALSE(fs::exists(out / stale));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  fs::remove_all(root);
}

// The index and config.json are read only as regular files of bounded size: a FIFO is refused at
// once (reading it used to block forever), a 101 MB config.json before it is read.
TEST(CheckpointErrors, IndexAndConfigMustBeRegularFilesOfBoundedSize) {
  const fs::path root = scratch("jsonfifo");
  write_lone_file(root / "a" / "model.safetensors", {{"proj.weight", {32, 64}}});
  ASSERT_EQ(::mkfifo((root / "a" / "config.json").c_str(), 0600), 0);
  write_lone_file(root / "b" / "x.safetensors", {{"proj.weight", {32, 64}}});
  ASSERT_EQ(::mkfifo((root / "b" / "model.safetensors.index.json").c_str(), 0600), 0);
  write_lone_file(root / "c" / "model.safetensors", {{"proj.weight", {32, 64}}});
  { std::ofstream(root / "c" / "config.json") << "{}"; }
  fs::resize_file(root / "c" / "config.json", (101u << 20));
  for (const auto& [dir, needle] : {std::pair<std::string, std::string>{"a", "config.json: not a regular file"},
                                    {"b", "model.safetensors.index.json: not a regular file"},
                                    {"c", "config.json: 105906176 bytes, more than the limit"}}) {
    // in a child process: a blocking read must fail the test, not hang it
    ToolRun run({"quantize", (root / dir).string(), "-o", (root / ("q_" + dir)).string()}, "json");
    run.wait();
    EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 2) << dir << ": status " << run.status;
    EXPECT_NE(run.err().find(needle), std::string::npos) << run.err();
    EXPECT_FALSE(fs::exists(root / ("q_" + dir)));
  }
  fs::remove_all(root);
}

// PyTorch pickles and other frameworks' weight files beside the safetensors shards are not copied
// into OUT (they used to be: the original weights, loadable instead of the converted ones), each
// named in a warning.
TEST(CheckpointQuantize, WeightsOfOtherFormatsAreNotCopied) {
  const fs::path root = scratch("sidebin");
  write_lone_file(root / "in" / "model.safetensors", {{"proj.weight", {32, 64}}});
  for (const char* n : {"pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pth", "training_args.pt"})
    std::ofstream(root / "in" / n) << "\x80\x02pickle";
  std::ofstream(root / "in" / "tokenizer.json") << "{}";
  std::ofstream(root / "in" / "config.json") << "{}";
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(entries(root / "q"), (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  for (const char* n : {"pytorch_model.bin", "consolidated.pth", "training_args.pt"})
    EXPECT_NE(said.find(std::string(n) + " not copied"), std::string::npos) << said;
  fs::remove_all(root);
}

namespace {
float bf16_value(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float global_scale_of(const fs::path& file, const std::string& module) {
  const st::File f(file.string());
  const st::TensorInfo* t = f.view().find(module + ".weight_global_scale");
  if (!t) return NAN;
  float S;
  std::memcpy(&S, f.view().data(*t).data(), 4);
  return S;
}
}  // namespace

// The error line of a weight large enough for several bands of the parallel error pass (bands of
// 2^18 elements: 2048 rows of 128 here, so 4100 rows make three, the last partial): the figure equals
// the plain serial sum's to the two decimals printed, and the non-finite counts add up across bands.
TEST(CheckpointQuantize, ErrorLinesOfWeightsSpanningSeveralBands) {
  const fs::path root = scratch("bands");
  const std::int64_t N = 4100, K = 128;
  std::vector<std::uint16_t> w(N * K), nan_w;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  // the bands differ (outliers in the second, tiny values in the third), so that a band lost or
  // counted twice moves the figure
  for (std::int64_t i = 0; i < N * K; ++i) {
    const std::int64_t row = i / K;
    const float v = nd(rng);
    w[i] = to_bf16(row < 2048 ? v : row < 4096 ? (i % 7 == 0 ? 30 * v : v) : v * 1e-3f);
  }
  nan_w = w;
  nan_w[2500 * K + 40] = 0x7FC0;  // one NaN in the second band: its MXFP4 block of 32 decodes to NaN
  fs::create_directories(root / "in");
  {
    st::Writer wr((root / "in" / "model.safetensors").string());
    wr.declare("l.mlp.up_proj.weight", "BF16", {N, K});
    wr.declare("l.mlp.nan_proj.weight", "BF16", {N, K});
    wr.write("l.mlp.up_proj.weight", {reinterpret_cast<const std::uint8_t*>(w.data()), w.size() * 2});
    wr.write("l.mlp.nan_proj.weight", {reinterpret_cast<const std::uint8_t*>(nan_w.data()), nan_w.size() * 2});
    wr.commit();
  }
  for (const std::string format : {"mxfp4", "nvfp4"}) {
    for (const bool fake : {false, true}) {
      mxq::cli::QuantizeArgs qa;
      qa.in = (root / "in").string();
      qa.out = (root / (format + (fake ? "-fq" : "-q"))).string();
      qa.format = format;
      qa.fake = fake;
      testing::internal::CaptureStdout();
      testing::internal::CaptureStderr();
      const int rc = mxq::cli::run_quantize(qa);
      const std::string log = testing::internal::GetCapturedStdout();
      const std::string said = testing::internal::GetCapturedStderr();
      ASSERT_EQ(rc, 0) << log << said;
      // the expected figure, from the library's own QDQ in fp32 (= dequantize of the codes)
      mxq::QuantOptions o = format == "nvfp4" ? mxq::QuantOptions::nvfp4() : mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
      if (format == "nvfp4")
        o.tensor_scale = mxq::nvfp4_tensor_scale_from_amax(mxq::tensor_amax(mxq::Tensor::of(w.data(), mxq::DType::bf16, N, K)));
      std::vector<float> xf(w.size()), yf(w.size());
      for (std::size_t i = 0; i < w.size(); ++i) xf[i] = mxq::bf16_to_f32(w[i]);
      if (fake) {  // the QDQ'd weights are stored in bf16: the figure is of those
        std::vector<std::uint16_t> yb(w.size());
        mxq::qdq(mxq::Tensor::of(w.data(), mxq::DType::bf16, N, K), mxq::Tensor::of(yb.data(), mxq::DType::bf16, N, K), o);
        for (std::size_t i = 0; i < w.size(); ++i) yf[i] = mxq::bf16_to_f32(yb[i]);
      } else {
        mxq::qdq(mxq::Tensor::of(xf.data(), mxq::DType::f32, N, K), mxq::Tensor::of(yf.data(), mxq::DType::f32, N, K), o);
      }
      const std::string to = std::string(fake ? "qdq " : "") + format;
      EXPECT_NE(log.find("l.mlp.up_proj.weight [4100, 128] BF16 -> " + to + ": " + sqnr_text(w, yf)), std::string::npos)
          << format << (fake ? " qdq" : "") << "\n" << log;
      const std::string more = format == "nvfp4" ? "15" : "31";  // the rest of the NaN's block
      EXPECT_NE(log.find("l.mlp.nan_proj.weight [4100, 128] BF16 -> " + to + ": SQNR not finite (1 non-finite inputs, " + more +
                         " more non-finite outputs)"),
                std::string::npos)
          << log;
    }
  }
  fs::remove_all(root);
}

// NaN and Inf weights follow the numerics contract and are reported, never scored as perfect: the
// NVFP4 global scale is the library's (tensor_amax -> nvfp4_tensor_scale_from_amax: 1 for a NaN amax
// wherever the NaN sits; it used to depend on the position), an Inf in v_proj gives the fused q/k/v
// scale 1 and the summary says so for all three, and an all-NaN tensor's error is "not finite"
// (it was "inf dB"), in quantize's lines and in inspect --against.
TEST(CheckpointQuantize, NonFiniteWeightsAreReportedNotScored) {
  const fs::path root = scratch("nan");
  const std::int64_t N = 16, K = 64;
  std::map<std::string, std::vector<std::uint16_t>> ws;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (const char* m : {"l.self_attn.q_proj", "l.self_attn.k_proj", "l.self_attn.v_proj", "l.mlp.nan_first", "l.mlp.nan_last",
                        "l.mlp.all_nan"}) {
    auto& v = ws[std::string(m) + ".weight"];
    v.resize(N * K);
    for (auto& x : v) x = to_bf16(nd(rng));
  }
  ws["l.self_attn.v_proj.weight"][5 * K + 3] = 0x7F80;  // +Inf
  ws["l.mlp.nan_first.weight"][0] = 0x7FC0;
  ws["l.mlp.nan_last.weight"][N * K - 1] = 0x7FC0;
  for (auto& x : ws["l.mlp.all_nan.weight"]) x = 0x7FC0;
  fs::create_directories(root / "in");
  {
    st::Writer w((root / "in" / "model.safetensors").string());
    for (const auto& [n, v] : ws) w.declare(n, "BF16", {N, K});
    for (const auto& [n, v] : ws) w.write(n, {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 2});
    w.commit();
  }
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "nvfp4";
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string log = testing::internal::GetCapturedStdout();
  const std::string said = testing::internal::GetCapturedStderr();
  const fs::path qf = root / "q" / "model.safetensors";
  for (const char* m : {"l.mlp.nan_first", "l.mlp.nan_last", "l.mlp.all_nan"}) {
    const auto& v = ws[std::string(m) + ".weight"];
    const float amax = mxq::tensor_amax(mxq::Tensor::of(v.data(), mxq::DType::bf16, N, K));
    EXPECT_EQ(global_scale_of(qf, m), mxq::nvfp4_tensor_scale_from_amax(amax)) << m;
    EXPECT_EQ(global_scale_of(qf, m), 1.0f) << m;
  }
  for (const char* m : {"q_proj", "k_proj", "v_proj"}) {
    EXPECT_EQ(global_scale_of(qf, std::string("l.self_attn.") + m), 1.0f) << m;
    EXPECT_NE(log.find(std::string("NOT FINITE: l.self_attn.") + m + ".weight: NVFP4 global scale 1"), std::string::npos) << log;
  }
  EXPECT_NE(log.find("NOT FINITE: l.self_attn.v_proj.weight: 1 NaN/Inf values in 1 of 64 blocks"), std::string::npos) << log;
  EXPECT_NE(log.find("NOT FINITE: l.mlp.all_nan.weight: 1024 NaN/Inf values in 64 of 64 blocks"), std::string::npos) << log;
  std::string line = log.substr(log.find("l.mlp.all_nan.weight ["));
  line = line.substr(0, line.find('\n'));
  EXPECT_NE(line.find("not finite"), std::string::npos) << line;
  EXPECT_EQ(line.find("inf dB"), std::string::npos) << line;
  EXPECT_NE(said.find("NaN or Inf"), std::string::npos) << said;
  // a finite tensor still gets its number
  line = log.substr(log.find("l.self_attn.q_proj.weight ["));
  EXPECT_NE(line.substr(0, line.find('\n')).find(" dB"), std::string::npos) << line;

  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_inspect_against(qf.string(), (root / "in").string()), 0);
  const std::string report = testing::internal::GetCapturedStdout();
  line = report.substr(report.find("l.mlp.all_nan.weight"));
  line = line.substr(0, line.find('\n'));
  EXPECT_NE(line.find("not finite"), std::string::npos) << report;
  EXPECT_EQ(line.find("inf"), std::string::npos) << line;
  EXPECT_NE(report.find("NOT FINITE:"), std::string::npos) << report;
  fs::remove_all(root);
}

// inspect caps the name column: one 1000-byte name among many short ones no longer pads every row to
// 1000 bytes (a 1.6 MB file printed 20 GB); the long name is printed whole on a line of its own.
TEST(CheckpointInspect, OneLongNameDoesNotWidenEveryRow) {
  const fs::path root = scratch("inspectwide");
  const std::string long_name = std::string(1000, 'n') + ".weight";
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> ts{{long_name, {1}}};
  for (int i = 0; i < 2000; ++i) ts.push_back({"t" + std::to_string(i), {1}});
  write_lone_file(root / "wide.safetensors", ts);
  mxq::cli::InspectArgs ia;
  ia.file = (root / "wide.safetensors").string();
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_inspect(ia), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_LT(out.size(), 2001u * 200) << "rows padded to the longest name";
  EXPECT_NE(out.find(long_name + "\n"), std::string::npos);
  EXPECT_NE(out.find("t1999 "), std::string::npos);
  fs::remove_all(root);
}

// inspect takes a checkpoint directory as quantize does: every shard's table (it refused a
// directory), and with --against every shard's errors.
TEST(CheckpointInspect, AcceptsACheckpointDirectory) {
  const fs::path root = scratch("inspectdir");
  make_checkpoint(root / "in");
  mxq::cli::InspectArgs ia;
  ia.file = (root / "in").string();
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_inspect(ia), 0);
  std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("checkpoint of 2 shard(s)"), std::string::npos) << out;
  EXPECT_NE(out.find("model-00001-of-00002.safetensors: "), std::string::npos) << out;
  EXPECT_NE(out.find("model-00002-of-00002.safetensors: "), std::string::npos) << out;
  EXPECT_NE(out.find("model.layers.0.self_attn.v_proj.weight"), std::string::npos) << out;
  EXPECT_NE(out.find("checkpoint total"), std::string::npos) << out;

  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "mxfp4";
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  ia.file = (root / "q").string();
  ia.against = (root / "in").string();
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_inspect(ia), 0);
  out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << out;  // shard 1
  EXPECT_NE(out.find("model.layers.0.self_attn.v_proj.weight"), std::string::npos) << out;  // shard 2
  EXPECT_NE(out.find("mxfp4 (dequantized)"), std::string::npos) << out;
  // an empty directory is refused, naming it
  fs::create_directories(root / "empty");
  ia.file = (root / "empty").string();
  ia.against.clear();
  EXPECT_THROW(mxq::cli::run_inspect(ia), std::runtime_error);
  fs::remove_all(root);
}

// --part I/N and mxq merge: the merged output is byte-identical to a single run, for every N (also
// more parts than shards), for quantize (MXFP4, NVFP4 with a fused scale across shards) and qdq.
TEST(CheckpointParts, SplitAndMergeIsByteIdenticalToOneRun) {
  const fs::path root = scratch("parts");
  make_checkpoint(root / "in");
  for (const std::string cmd : {"quantize", "qdq"})
    for (const std::string format : {"mxfp4", "nvfp4"}) {
      const std::string tag = cmd + "_" + format;
      mxq::cli::QuantizeArgs qa;
      qa.in = (root / "in").string();
      qa.format = format;
      qa.fake = cmd == "qdq";
      qa.out = (root / ("one_" + tag)).string();
      ASSERT_EQ(mxq::cli::run_quantize(qa), 0) << tag;
      const auto one = read_tree(qa.out);
      for (int n : {1, 2, 3}) {
        qa.out = (root / (tag + "_n" + std::to_string(n))).string();
        for (int i = n; i >= 1; --i) {  // any order
          qa.part = std::to_string(i) + "/" + std::to_string(n);
          ASSERT_EQ(mxq::cli::run_quantize(qa), 0) << tag << " part " << *qa.part;
          EXPECT_TRUE(fs::exists(qa.out + ".part-" + std::to_string(i) + "-of-" + std::to_string(n) + "/mxq-part.json"));
        }
        EXPECT_FALSE(fs::exists(qa.out)) << "a part writes only its own directory";
        mxq::cli::MergeArgs ma;
        ma.out = qa.out;
        ASSERT_EQ(mxq::cli::run_merge(ma), 0) << tag << " n=" << n;
        const auto merged = read_tree(qa.out);
        EXPECT_EQ(merged.size(), one.size()) << tag << " n=" << n;
        for (const auto& [name, bytes] : one) {
          ASSERT_TRUE(merged.count(name)) << tag << " n=" << n << ": " << name << " missing";
          EXPECT_TRUE(merged.at(name) == bytes) << tag << " n=" << n << ": " << name << " differs";
        }
        for (int i = 1; i <= n; ++i)
          EXPECT_FALSE(fs::exists(qa.out + ".part-" + std::to_string(i) + "-of-" + std::to_string(n))) << "parts removed";
      }
    }
}

TEST(CheckpointParts, RefusesMissingOrMismatchedParts) {
  const fs::path root = scratch("parts_err");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  for (const std::string bad : {"0/2", "3/2", "2", "1/0", "a/b", "1/2x"}) {
    qa.part = bad;
    EXPECT_NE(quantize_failure(qa, "--part " + bad).find("--part"), std::string::npos) << bad;
  }
  mxq::cli::MergeArgs ma;
  ma.out = qa.out;
  auto merge_failure = [&]() -> std::string {
    try {
      mxq::cli::run_merge(ma);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(merge_failure().find("no parts"), std::string::npos);
  qa.part = "1/2";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_NE(merge_failure().find("part 2 of 2 is missing"), std::string::npos);
  qa.part = "2/2";
  qa.format = "nvfp4";  // other options than part 1's
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_NE(merge_failure().find("differs from part 1"), std::string::npos);
  EXPECT_FALSE(fs::exists(qa.out)) << "a refused merge writes nothing";
  EXPECT_TRUE(fs::exists(qa.out + ".part-1-of-2")) << "and keeps the parts";
  // both parts alike again, then an input shard touched after the parts were written
  qa.format = "mxfp4";
  qa.overwrite = true;
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const fs::path shard = root / "in" / "model-00001-of-00002.safetensors";
  fs::last_write_time(shard, fs::last_write_time(shard) + std::chrono::seconds(5));
  EXPECT_NE(merge_failure().find("changed"), std::string::npos);
  // OUT is normalised first: "q2/." is q2, whose parts are its siblings (not inside it)
  qa.out = (root / "q2" / ".").string();
  qa.part = "1/2";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_TRUE(fs::exists(root / "q2.part-1-of-2" / "mxq-part.json"));
  qa.out = "/";
  EXPECT_NE(quantize_failure(qa, "--part with OUT = /").find("of its own"), std::string::npos);
}

// quantize --rotate in parts: the merge is the single run's bytes, the transform's matrix written by
// exactly one part.
TEST(CheckpointQuantize, RotateInPartsMergesToTheSingleRun) {
  const fs::path root = scratch("quantize_rotate_parts");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.format = "mxfp4";
  qa.rotate = "had32";
  qa.out = (root / "one").string();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  qa.out = (root / "split").string();
  for (int i = 1; i <= 2; ++i) {
    qa.part = std::to_string(i) + "/2";
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  }
  mxq::cli::MergeArgs ma;
  ma.out = qa.out;
  ASSERT_EQ(mxq::cli::run_merge(ma), 0);
  for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json",
                        "model.safetensors.index.json"}) {
    std::ifstream a(root / "one" / f, std::ios::binary), b(root / "split" / f, std::ios::binary);
    const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
    EXPECT_TRUE(!sa.empty() && sa == sb) << f;
  }
  int mats = 0;
  const json swm = json::parse(std::ifstream(root / "split" / "model.safetensors.index.json"))["weight_map"];
  for (const auto& [k, v] : swm.items()) mats += k.ends_with(".mxq_input.weight");
  EXPECT_EQ(mats, 1);
  qa.part.reset();
  qa.rotate = "none";
  qa.out = (root / "none").string();
  EXPECT_NE(quantize_failure(qa, "--rotate none").find("leave --rotate out"), std::string::npos);
}

// NVFP4 with --rotate: the global scale of q/k/v (one fused parameter) from the largest amax of the
// members' ROTATED weights, the codes those of the library's rotated quantize under that scale.
TEST(CheckpointQuantize, RotateNvfp4TakesTheRotatedAmaxForTheFusedGlobalScale) {
  const fs::path root = scratch("quantize_rotate_nv");
  const auto data = make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.format = "nvfp4";
  qa.rotate = "had64";
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  mxq::QuantOptions o = mxq::QuantOptions::nvfp4();
  o.rotation = mxq::Rotation::hadamard;
  o.rotation_size = 64;
  float amax = 0, plain = 0;
  const std::map<std::string, std::int64_t> rows = {{"q_proj", 64}, {"k_proj", 32}, {"v_proj", 32}};
  for (const auto& [m, n] : rows) {
    const mxq::Tensor x = mxq::Tensor::of(const_cast<std::uint16_t*>(data.at("model.layers.0.self_attn." + m + ".weight").data()),
                                          mxq::DType::bf16, n, 128);
    amax = std::max(amax, mxq::tensor_amax(x, o));
    plain = std::max(plain, mxq::tensor_amax(x));
  }
  EXPECT_NE(amax, plain) << "the test needs the rotation to change the amax";
  o.tensor_scale = mxq::nvfp4_tensor_scale_from_amax(amax);
  std::vector<std::uint8_t> codes(32 * 64), scales(32 * 8);
  mxq::QuantizedOut q;
  q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, 32, 64);
  q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, 32, 8);
  mxq::quantize(mxq::Tensor::of(const_cast<std::uint16_t*>(data.at("model.layers.0.self_attn.v_proj.weight").data()),
                                mxq::DType::bf16, 32, 128), q, o);
  const std::string v = "model.layers.0.self_attn.v_proj";
  EXPECT_EQ(load(qa.out, v + ".weight_packed", "U8", {32, 64}), codes);
  EXPECT_EQ(load(qa.out, v + ".weight_scale", "F8_E4M3", {32, 8}), scales);
  const std::vector<std::uint8_t> gs = load(qa.out, v + ".weight_global_scale", "F32", {1});
  float S = 0;
  std::memcpy(&S, gs.data(), 4);
  EXPECT_EQ(S, *o.tensor_scale);
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

// mxq qdq --rotate: each weight rotated, quantized, dequantized and rotated back, as the library's
// quantize + dequantize with the rotation compute it; weights whose K the size does not divide unchanged.
TEST(CheckpointQdq, RotateIsQuantizeDequantizeWithTheRotation) {
  const fs::path root = scratch("qdq_rotate");
  const auto data = make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.fake = true;
  qa.format = "mxfp4";
  qa.rotate = "rhad64";
  qa.rotate_seed = 9;
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const std::vector<std::uint8_t> got = load(qa.out, name, "BF16", {64, 128});
  mxq::QuantOptions o = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
  o.rotation = mxq::Rotation::random_hadamard;
  o.rotation_size = 64;
  o.rotation_seed = 9;
  const auto& x = data.at(name);
  std::vector<std::uint8_t> codes(64 * 64), scales(64 * 4);
  mxq::QuantizedOut q;
  q.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, 64, 64);
  q.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, 64, 4);
  mxq::quantize(mxq::Tensor::of(x.data(), mxq::DType::bf16, 64, 128), q, o);
  std::vector<std::uint16_t> y(64 * 128);
  mxq::dequantize(mxq::QuantizedIn{q.codes, q.scales}, mxq::Tensor::of(y.data(), mxq::DType::bf16, 64, 128), o);
  ASSERT_EQ(got.size(), y.size() * 2);
  EXPECT_EQ(std::memcmp(got.data(), y.data(), got.size()), 0) << "rotated qdq of " << name;
  // K = 40 (odd_proj) is not a multiple of 64: copied unchanged
  const std::vector<std::uint8_t> odd = load(qa.out, "model.layers.0.mlp.odd_proj.weight", "BF16", {8, 40});
  EXPECT_EQ(std::memcmp(odd.data(), data.at("model.layers.0.mlp.odd_proj.weight").data(), odd.size()), 0);
  qa.out = (root / "q2").string();
  qa.rotate = "had100";
  EXPECT_NE(quantize_failure(qa, "--rotate had100").find("--rotate"), std::string::npos);
}

// ---- hostile part directories and JSON (a part directory sits on shared storage; a checkpoint is
// downloaded): each refused with one line naming the file and key, nothing written outside OUT ----
namespace {

constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
constexpr const char* kShard2 = "model-00002-of-00002.safetensors";

// root/in (make_checkpoint) converted by `quantize --part I/2` (format mxfp4 unless given) into the
// parts of root/pristine, and the single run root/one.
void make_parts(const fs::path& root, const std::string& format = "mxfp4", bool fake = false) {
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.format = format;
  qa.fake = fake;
  qa.out = (root / "one").string();
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  qa.out = (root / "pristine").string();
  for (const char* p : {"1/2", "2/2"}) {
    qa.part = p;
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  }
  testing::internal::GetCapturedStdout();
}

// A fresh copy of the pristine parts as the parts of root/<tag>; returns root/<tag> (OUT).
fs::path copy_parts(const fs::path& root, const std::string& tag) {
  for (const char* p : {".part-1-of-2", ".part-2-of-2"}) {
    fs::remove_all(root / (tag + p));
    fs::copy(root / (std::string("pristine") + p), root / (tag + p), fs::copy_options::recursive);
  }
  return root / tag;
}

fs::path manifest(const fs::path& out, int i) { return out.string() + ".part-" + std::to_string(i) + "-of-2/mxq-part.json"; }

// Applies edit to every part's manifest (the parts must agree with each other to reach most checks).
template <class F>
void edit_manifests(const fs::path& out, F edit) {
  for (int i : {1, 2}) {
    json m = json::parse(std::ifstream(manifest(out, i)));
    edit(m, i);
    std::ofstream(manifest(out, i), std::ios::trunc) << m.dump();
  }
}

// The message merge fails with (and a test failure when it does not fail).
std::string merge_failure(const fs::path& out, const std::string& what) {
  mxq::cli::MergeArgs ma;
  ma.out = out.string();
  try {
    testing::internal::CaptureStdout();
    mxq::cli::run_merge(ma);
    testing::internal::GetCapturedStdout();
  } catch (const std::exception& e) {
    testing::internal::GetCapturedStdout();
    EXPECT_FALSE(fs::exists(out)) << what << ": a refused merge left " << out;
    EXPECT_TRUE(fs::exists(manifest(out, 1))) << what << ": a refused merge removed the parts";
    return e.what();
  }
  ADD_FAILURE() << "merge accepted " << what;
  return "";
}

std::string nested(std::size_t depth, char open = '[', char close = ']') {
  return std::string(depth, open) + std::string(depth, close);
}

}  // namespace

// Issue 35, 1: the config's name comes from the input, not from a manifest: an absolute name, "../",
// or a shard's name is refused naming the key; nothing is written anywhere.
TEST(CheckpointMergeHostile, ConfigNameIsTheOneTheInputImplies) {
  const fs::path root = scratch("merge_cfgname");
  make_parts(root);
  const fs::path victim = root / "victim.txt";
  for (const std::string& name : {victim.string(), std::string("../victim.txt"), std::string(kShard1),
                                  std::string("quantization_config.json")}) {
    SCOPED_TRACE(name);
    const fs::path out = copy_parts(root, "q");
    edit_manifests(out, [&](json& m, int) { m["config_name"] = name; });
    const std::string e = merge_failure(out, "config_name " + name);
    EXPECT_NE(e.find("mxq-part.json: key 'config_name'"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(victim));
  }
  // the text must be the input's config.json with a quantization_config: a manifest cannot drop it
  const fs::path out = copy_parts(root, "q");
  edit_manifests(out, [&](json& m, int) { m["config_text"] = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 128})"; });
  EXPECT_NE(merge_failure(out, "config without quantization_config").find("key 'config_text'"), std::string::npos);
  copy_parts(root, "q");
  edit_manifests(out, [&](json& m, int) {
    json c = json::parse(m["config_text"].get<std::string>());
    c["hidden_size"] = 4096;
    m["config_text"] = c.dump();
  });
  EXPECT_NE(merge_failure(out, "config of another model").find("other keys differ"), std::string::npos);
  fs::remove_all(root);
}

// Issue 35, 2: every shard is a regular file whose header matches the manifest and the input before
// anything is published; the index is rebuilt from the headers (a manifest's weight map or byte count
// is never copied).
TEST(CheckpointMergeHostile, ShardsAreCheckedBeforePublishing) {
  const fs::path root = scratch("merge_shards");
  make_parts(root);
  const auto part_shard = [&](const fs::path& out, int i, const char* shard) {
    return fs::path(out.string() + ".part-" + std::to_string(i) + "-of-2") / shard;
  };
  struct Case {
    std::string what, needle;
    std::function<void(const fs::path&)> spoil;
  };
  const std::vector<Case> cases = {
      {"truncated by 100 bytes", "is past the end of the data",
       [&](const fs::path& o) { fs::resize_file(part_shard(o, 1, kShard1), fs::file_size(part_shard(o, 1, kShard1)) - 100); }},
      {"a symlink to /etc/passwd", "symbolic link",
       [&](const fs::path& o) {
         fs::remove(part_shard(o, 2, kShard2));
         fs::create_symlink("/etc/passwd", part_shard(o, 2, kShard2));
       }},
      {"another shard's bytes", "weight map",
       [&](const fs::path& o) {
         fs::remove(part_shard(o, 1, kShard1));
         fs::copy_file(part_shard(o, 2, kShard2), part_shard(o, 1, kShard1));
       }},
      {"a symlink to the unquantized input", "symbolic link",
       [&](const fs::path& o) {
         fs::remove(part_shard(o, 1, kShard1));
         fs::create_symlink(root / "in" / kShard1, part_shard(o, 1, kShard1));
       }},
      {"a copy of the unquantized input", "weight map",
       [&](const fs::path& o) {
         fs::remove(part_shard(o, 1, kShard1));
         fs::copy_file(root / "in" / kShard1, part_shard(o, 1, kShard1));
       }},
      {"an unquantized shard with a manifest to match", "neither",
       [&](const fs::path& o) {  // the manifest agrees with the shard, the input does not
         fs::remove(part_shard(o, 1, kShard1));
         st::Writer w(part_shard(o, 1, kShard1).string());
         w.declare("model.layers.0.self_attn.q_proj.weight_packed", "BF16", {64, 64});
         w.write("model.layers.0.self_attn.q_proj.weight_packed", std::vector<std::uint8_t>(64 * 64 * 2));
         w.commit();
         edit_manifests(o, [](json& m, int i) {
           if (i != 1) return;
           json wm = json::object();
           wm["model.layers.0.self_attn.q_proj.weight_packed"] = kShard1;
           m["weight_map"] = wm;
         });
       }},
      {"a weight map naming /etc/passwd", "weight_map",
       [&](const fs::path& o) { edit_manifests(o, [](json& m, int) { m["weight_map"]["x.weight"] = "../../../etc/passwd"; }); }},
      {"a weight map of invented tensors", "weight_map",
       [&](const fs::path& o) {
         edit_manifests(o, [](json& m, int) {
           for (int t = 0; t < 5000; ++t) m["weight_map"]["invented." + std::to_string(t)] = kShard1;
         });
       }},
      {"bytes_out of -1", "key 'bytes_out'", [&](const fs::path& o) { edit_manifests(o, [](json& m, int) { m["bytes_out"] = -1; }); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path out = copy_parts(root, "q");
    c.spoil(out);
    const std::string e = merge_failure(out, c.what);
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  }
  // a byte count of 2^64 - 1 in every manifest: ignored, the index's total_size is the shards' own
  const fs::path out = copy_parts(root, "q");
  edit_manifests(out, [](json& m, int) { m["bytes_out"] = std::numeric_limits<std::uint64_t>::max(); });
  mxq::cli::MergeArgs ma;
  ma.out = out.string();
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_merge(ma), 0);
  testing::internal::GetCapturedStdout();
  const auto one = read_tree(root / "one"), merged = read_tree(out);
  EXPECT_EQ(merged, one) << "the merged checkpoint differs from the single run's";
  fs::remove_all(root);
}

// Issue 35, 3: a manifest missing any key merge reads (or holding it with the wrong type) is refused
// naming the manifest and the key (it used to read past a heap block).
TEST(CheckpointMergeHostile, EveryManifestKeyIsChecked) {
  const fs::path root = scratch("merge_keys");
  make_parts(root);
  for (const std::string key : {"mxq_part", "of", "mxq_version", "input", "input_dir", "input_shards", "command", "format",
                                "rule", "include", "exclude", "rotate", "rotate_seed", "weight_map", "bytes_out", "index",
                                "config_name", "config_text", "side_files"}) {
    SCOPED_TRACE(key);
    const fs::path out = copy_parts(root, "q");
    edit_manifests(out, [&](json& m, int) { m.erase(key); });
    std::string e = merge_failure(out, "no " + key);
    EXPECT_NE(e.find("mxq-part.json: key '" + key + "' missing"), std::string::npos) << e;
    copy_parts(root, "q");
    edit_manifests(out, [&](json& m, int) { m[key] = m[key].is_array() ? json(true) : json::array({1.5}); });  // present, of another type
    e = merge_failure(out, "wrong type of " + key);
    EXPECT_NE(e.find("mxq-part.json: key '" + key + "' is not"), std::string::npos) << e;
  }
  fs::remove_all(root);
}

// Issue 35, 4: a FIFO in place of a manifest is refused at once (merge used to wait on it forever,
// and a SIGTERM did not end it); a manifest that is a symbolic link or too deep is refused too.
TEST(CheckpointMergeHostile, ManifestIsReadNonBlockingAndBounded) {
  const fs::path root = scratch("merge_fifo");
  make_parts(root);
  fs::path out = copy_parts(root, "q");
  fs::remove(manifest(out, 2));
  ASSERT_EQ(::mkfifo(manifest(out, 2).c_str(), 0600), 0);
  {
    ToolRun run({"merge", out.string()}, "merge_fifo");  // in a child: a blocking open must fail the test, not hang it
    run.wait();
    EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 2) << "status " << run.status << ": " << run.err();
    EXPECT_NE(run.err().find("mxq-part.json: not a regular file"), std::string::npos) << run.err();
    EXPECT_FALSE(fs::exists(out));
  }
  out = copy_parts(root, "q");
  fs::remove(manifest(out, 2));
  fs::create_symlink(manifest(root / "pristine", 2), manifest(out, 2));
  EXPECT_NE(merge_failure(out, "a symlinked manifest").find("symbolic link"), std::string::npos);
  out = copy_parts(root, "q");
  std::ofstream(manifest(out, 2), std::ios::trunc) << nested(100000);
  EXPECT_NE(merge_failure(out, "a deep manifest").find("nested more than"), std::string::npos);
  fs::remove_all(root);
}

// Issue 35, 4: SIGTERM during a merge ends it promptly by that signal, leaving nothing published and
// the parts in place. NOTE: what this covers is a signal at an arbitrary point of the shard checks
// (the child is stopped there, signalled, continued): no blocking call is involved, so it passed
// with SA_RESTART too. SignalEndsMergeBlockedInAWrite below covers a blocked system call.
TEST(CheckpointMergeHostile, SignalEndsMergeLeavingNothing) {
  const fs::path root = scratch("merge_signal");
  // many small shards: merge checks each one, which gives the test time to stop it mid-way
  fs::create_directories(root / "in");
  json wm = json::object();
  constexpr int kShards = 200;
  for (int s = 0; s < kShards; ++s) {
    const std::string file = "model-" + std::to_string(1000 + s) + ".safetensors", name = "w" + std::to_string(s) + ".weight";
    write_lone_file(root / "in" / file, {{name, {32, 64}}});
    wm[name] = file;
  }
  std::ofstream(root / "in" / "model.safetensors.index.json") << json{{"metadata", json::object()}, {"weight_map", wm}}.dump();
  std::ofstream(root / "in" / "config.json") << R"({"architectures": ["LlamaForCausalLM"]})";
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.fake = true;
  qa.format = "mxfp4";
  testing::internal::CaptureStdout();
  for (const char* p : {"1/2", "2/2"}) {
    qa.part = p;
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  }
  testing::internal::GetCapturedStdout();
  ToolRun run({"merge", qa.out}, "merge_signal");
  const fs::path staging = fs::path(qa.out) / (".mxq-staging-" + std::to_string(run.pid));
  if (!run.stop_when_exists(staging)) GTEST_SKIP() << "the merge ended before the test could stop it";
  if (!fs::exists(staging)) {  // published between the test's look and SIGSTOP: nothing left to interrupt
    ::kill(run.pid, SIGCONT);
    run.wait();
    fs::remove_all(root);
    GTEST_SKIP() << "the merge published its output before the test could stop it";
  }
  ::kill(run.pid, SIGTERM);
  ::kill(run.pid, SIGCONT);
  run.wait();
  EXPECT_TRUE(WIFSIGNALED(run.status) && WTERMSIG(run.status) == SIGTERM) << run.status << ": " << run.err();
  EXPECT_FALSE(fs::exists(qa.out)) << "an interrupted merge published " << qa.out;
  EXPECT_TRUE(fs::exists(qa.out + ".part-1-of-2/mxq-part.json"));
  EXPECT_TRUE(fs::exists(qa.out + ".part-2-of-2/mxq-part.json"));
  fs::remove_all(root);
}

// Review of issue 35, 10: SIGTERM while merge is blocked in a system call ends it. The call: a write
// to stderr, a pipe this test fills and does not read, with the warnings about the input's side files
// that are FIFOs (added after the parts were converted; merge never opens them). The signal is sent
// once merge has staged the shards and has been asleep with the pipe full and unchanged for a while;
// the test then waits (without reading) for the staging directory to go: with SA_RESTART the write
// was restarted and merge stayed blocked until the test gave up. Timeouts are generous (a loaded
// machine only makes it slower); the rare case where the signal lands between two warnings instead of
// inside a write ends the same way, through check_interrupted().
TEST(CheckpointMergeHostile, SignalEndsMergeBlockedInAWrite) {
  const fs::path root = scratch("merge_blocked");
  make_parts(root);
  const fs::path out = copy_parts(root, "q");
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  const int pipe_size = ::fcntl(fds[0], F_GETPIPE_SZ);
  ASSERT_GT(pipe_size, 0);
  // each warning is more than 200 bytes: twice the pipe's size in warnings
  const std::string pad(100, 'f');
  for (int f = 0; f < pipe_size / 100 + 64; ++f)
    ASSERT_EQ(::mkfifo((root / "in" / (pad + std::to_string(f))).c_str(), 0600), 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(fds[1], 2);
    ::signal(SIGTERM, SIG_DFL);
    ::alarm(300);  // never outlives the test
    std::vector<char*> argv{const_cast<char*>(MXQ_TOOL_PATH), const_cast<char*>("merge"), const_cast<char*>(out.c_str()), nullptr};
    ::execv(MXQ_TOOL_PATH, argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  const fs::path staging = out / (".mxq-staging-" + std::to_string(pid));
  const auto queued = [&] {
    int n = 0;
    return ::ioctl(fds[0], FIONREAD, &n) == 0 ? n : -1;
  };
  const auto sleeping = [&] {  // /proc/PID/stat's state; true where /proc cannot tell
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string st((std::istreambuf_iterator<char>(f)), {});
    const std::size_t r = st.rfind(')');
    return r == std::string::npos || r + 2 >= st.size() || st[r + 2] == 'S';
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0, stable = 0, last = -1;
  bool ended = false;
  while (stable < 10 && std::chrono::steady_clock::now() < deadline) {  // 10 looks 100 ms apart
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      ended = true;
      break;
    }
    const int q = queued();
    stable = fs::exists(staging) && q > pipe_size - 4096 && q == last && sleeping() ? stable + 1 : 0;
    last = q;
    ::usleep(100000);
  }
  if (ended || stable < 10) {
    if (!ended) ::kill(pid, SIGKILL), ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    FAIL() << "merge did not block writing its warnings into a full pipe (status " << status << ")";
  }
  ::kill(pid, SIGTERM);
  bool gone = false;  // the stack unwound: the staging directory removed, while stderr is still full
  for (int t = 0; t < 600 && !gone; ++t) {
    gone = !fs::exists(staging);
    if (!gone) ::usleep(100000);
  }
  EXPECT_TRUE(gone) << "SIGTERM did not end a merge blocked in write(2) within 60 s (SA_RESTART?)";
  std::string err;  // drained now: main's last line may be waiting for room
  char buf[65536];
  for (ssize_t r; (r = ::read(fds[0], buf, sizeof buf)) != 0;)
    if (r > 0) err.append(buf, std::size_t(r));
    else if (errno != EINTR) break;
  ::close(fds[0]);
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status << ": " << err.substr(err.size() > 500 ? err.size() - 500 : 0);
  EXPECT_FALSE(fs::exists(out)) << "an interrupted merge published " << out;
  EXPECT_TRUE(fs::exists(manifest(out, 1)));
  EXPECT_TRUE(fs::exists(manifest(out, 2)));
  fs::remove_all(root);
}

// Issue 35, 5: JSON nested deeper than the limit (64) is refused before it is parsed into a tree
// (60,000 levels used to overflow the stack in every converter, leaving a staging directory).
TEST(CheckpointJsonLimits, DeeplyNestedJsonIsRefusedByEveryConverter) {
  const fs::path root = scratch("json_deep");
  make_checkpoint(root / "in");
  const std::string index = json::parse(std::ifstream(root / "in" / "model.safetensors.index.json")).dump();
  // {"metadata": {"a": {"a": ... }}, "weight_map": ...}
  std::string obj;
  for (int d = 0; d < 60000; ++d) obj += R"({"a": )";
  obj += "1" + std::string(60000, '}');
  const std::string wm = json::parse(index)["weight_map"].dump();
  struct Case {
    std::string file, text;
  };
  const std::vector<Case> cases = {{"model.safetensors.index.json", R"({"metadata": )" + obj + R"(, "weight_map": )" + wm + "}"},
                                   {"model.safetensors.index.json", R"({"metadata": )" + nested(1000000) + R"(, "weight_map": )" + wm + "}"},
                                   {"config.json", R"({"architectures": ["LlamaForCausalLM"], "x": )" + nested(100000) + "}"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file + " of " + std::to_string(c.text.size()) + " bytes");
    fs::remove_all(root / "bad");
    fs::copy(root / "in", root / "bad", fs::copy_options::recursive);
    std::ofstream(root / "bad" / c.file, std::ios::trunc) << c.text;
    for (const std::vector<std::string> args :
         {std::vector<std::string>{"quantize", "--format", "nvfp4"}, {"qdq", "--format", "mxfp4"},
          {"quantize", "--format", "mxfp4", "--part", "1/2"}, {"dequantize"}}) {
      SCOPED_TRACE(args[0] + (args.size() > 3 ? " --part" : ""));
      const fs::path out = root / "out";
      std::vector<std::string> argv = args;
      argv.insert(argv.begin() + 1, {(root / "bad").string(), "-o", out.string()});
      ToolRun run(argv, "json_deep");
      run.wait();
      EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 2) << "status " << run.status << ": " << run.err();
      EXPECT_NE(run.err().find(c.file + ": JSON nested more than 64 levels"), std::string::npos) << run.err();
      EXPECT_FALSE(fs::exists(out)) << "left " << out;
      EXPECT_FALSE(fs::exists(out.string() + ".part-1-of-2"));
    }
  }
  // a safetensors header nested deeper than a header can be
  const std::string h = R"({"x": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "y": )" + nested(100000) + "}}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char((h.size() >> (8 * i)) & 0xff);
  bytes += h;
  try {
    st::View v({reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, "deep.safetensors");
    ADD_FAILURE() << "a deep header was accepted";
  } catch (const st::Error& e) {
    EXPECT_NE(std::string(e.what()).find("levels deep"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

// Issue 35, 6: nested JSON is written back indented to 10 levels and compact below, so its size stays
// linear in the input's (indenting every level made 2 * depth^2 bytes); a real config keeps
// nlohmann's dump(2) form byte for byte.
TEST(CheckpointJsonLimits, NestedJsonIsNotReserialisedQuadratically) {
  const fs::path root = scratch("json_quadratic");
  make_checkpoint(root / "in");
  json cfg = json::parse(std::ifstream(root / "in" / "config.json"));
  std::string extra;
  for (int k = 0; k < 200; ++k) extra += (k ? "," : "") + std::string("\"k") + std::to_string(k) + "\": " + nested(60);
  std::string text = cfg.dump();
  text.insert(text.size() - 1, ", " + extra);
  std::ofstream(root / "in" / "config.json", std::ios::trunc) << text;
  std::string index = json::parse(std::ifstream(root / "in" / "model.safetensors.index.json")).dump();
  index.insert(index.find(R"("metadata":{)") + 12, extra + ",");
  std::ofstream(root / "in" / "model.safetensors.index.json", std::ios::trunc) << index;
  for (const bool fake : {false, true}) {
    mxq::cli::QuantizeArgs qa;
    qa.in = (root / "in").string();
    qa.out = (root / (fake ? "qdq" : "q")).string();
    qa.format = "mxfp4";
    qa.fake = fake;
    testing::internal::CaptureStdout();
    ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
    testing::internal::GetCapturedStdout();
    const auto size = fs::file_size(fs::path(qa.out) / "config.json");
    EXPECT_LT(size, 10 * text.size()) << "config.json of " << text.size() << " bytes written as " << size;
    const auto isize = fs::file_size(fs::path(qa.out) / "model.safetensors.index.json");
    EXPECT_LT(isize, 10 * index.size()) << "the index of " << index.size() << " bytes written as " << isize;
    EXPECT_EQ(json::parse(std::ifstream(fs::path(qa.out) / "config.json"))["k7"], json::parse(nested(60)));
  }
  // a config and an index of ordinary depth: the same bytes as nlohmann's dump(2)
  make_checkpoint(root / "plain");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "plain").string();
  qa.out = (root / "plain_q").string();
  qa.format = "nvfp4";
  qa.rotate = "had32";
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  for (const char* f : {"config.json", "model.safetensors.index.json"}) {
    std::ifstream in(fs::path(qa.out) / f);
    const std::string t(std::istreambuf_iterator<char>(in), {});
    EXPECT_EQ(t, json::parse(t).dump(2) + "\n") << f;
  }
  fs::remove_all(root);
}

// ---- issue 35, 7: the smaller items ----------------------------------------------------------------

// `--part ""` (an unset variable in a launcher) is refused instead of converting the whole checkpoint.
TEST(CheckpointPartsOptions, EmptyPartIsRefused) {
  const fs::path root = scratch("part_empty");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.part = "";
  EXPECT_NE(quantize_failure(qa, "--part ''").find("--part ''"), std::string::npos);
  ToolRun run({"quantize", qa.in, "-o", qa.out, "--part", ""}, "part_empty");
  run.wait();
  EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 2) << run.status << ": " << run.err();
  EXPECT_NE(run.err().find("--part ''"), std::string::npos) << run.err();
  EXPECT_FALSE(fs::exists(qa.out));
  fs::remove_all(root);
}

// Review of issue 35, 3: --part is parsed whole with std::from_chars: no leading space or sign, no
// wrap-around (sscanf("%d") made 4294967297/4294967298 part 1 of 2), N at most 100000.
TEST(CheckpointPartsOptions, PartIsParsedWhole) {
  const fs::path root = scratch("part_parse");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  for (const std::string bad : {"4294967297/4294967298", "2147483648/2147483649", " 1/2", "1/ 2", "1 /2", "+1/2", "-1/2",
                                "1/2 ", "1/2x", "1//2", "1/", "/2", "0/2", "3/2", "1/100001", "1/2/3", "0x1/2"}) {
    SCOPED_TRACE(bad);
    qa.part = bad;
    EXPECT_NE(quantize_failure(qa, "--part '" + bad + "'").find("--part '" + bad + "': expected I/N"), std::string::npos);
    EXPECT_FALSE(fs::exists(root / "q.part-1-of-2"));
  }
  qa.part = "1/100000";  // the largest N: part 1 holds the first shard
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  EXPECT_TRUE(fs::exists(root / "q.part-1-of-100000" / "mxq-part.json"));
  fs::remove_all(root);
}

// Review of issue 35, 6: a lone file named without a directory (`mxq quantize m.safetensors -o q
// --part 1/1` in its directory) has the input_dir "." made absolute, /cwd/ with a separator; merge
// reads the manifest's absolute input, whose directory is /cwd: the two are one directory.
TEST(CheckpointParts, LoneFileNamedRelativeToTheWorkingDirectoryMerges) {
  const fs::path root = scratch("part_cwd");
  write_lone_file(root / "m.safetensors", {{"a.weight", {32, 64}}, {"b.weight", {64, 32}}});
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  mxq::cli::QuantizeArgs qa;
  qa.in = "m.safetensors";
  qa.format = "mxfp4";
  qa.out = "one";
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  qa.out = "q";
  qa.part = "1/1";
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  mxq::cli::MergeArgs ma;
  ma.out = "q";
  int rc = -1;
  std::string error;
  try {
    rc = mxq::cli::run_merge(ma);
  } catch (const std::exception& e) {
    error = e.what();
  }
  testing::internal::GetCapturedStdout();
  fs::current_path(cwd);
  EXPECT_EQ(rc, 0) << error;
  if (rc == 0) EXPECT_EQ(read_tree(root / "q"), read_tree(root / "one"));
  fs::remove_all(root);
}

// Review of issue 35, 1: a part's shard is hard-linked into the output only where no one else can
// write it (owned by this user, no group or other write bit): a link would let whoever can write the
// part rewrite the published shard after merge checked it. Otherwise it is copied, bytes unchanged.
TEST(CheckpointMergeHostile, PartsOthersCanWriteAreCopiedNotLinked) {
  const fs::path root = scratch("merge_linkrule");
  make_parts(root);
  for (const mode_t mode : {mode_t(0644), mode_t(0664), mode_t(0646)}) {
    SCOPED_TRACE(mode);
    const fs::path out = copy_parts(root, "q");
    const fs::path part = fs::path(out.string() + ".part-1-of-2") / kShard1;
    ASSERT_EQ(::chmod(part.c_str(), mode), 0);
    mxq::cli::MergeArgs ma;
    ma.out = out.string();
    ma.keep_parts = true;
    testing::internal::CaptureStdout();
    ASSERT_EQ(mxq::cli::run_merge(ma), 0);
    testing::internal::GetCapturedStdout();
    struct stat a {}, b {};
    ASSERT_EQ(::stat(part.c_str(), &a), 0);
    ASSERT_EQ(::stat((out / kShard1).c_str(), &b), 0);
    const bool linked = a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    EXPECT_EQ(linked, mode == 0644) << "mode " << std::oct << mode;
    EXPECT_EQ(read_tree(out), read_tree(root / "one"));
    fs::remove_all(out);
  }
  fs::remove_all(root);
}

// --rotate-seed: a decimal from 0 to 2^64 - 1 (-1 and 2^64 used to clamp silently), and only with
// --rotate rhad<RS> (a seed without it used to be ignored without a word).
TEST(CheckpointPartsOptions, RotateSeedIsCheckedAndNeedsRhad) {
  const fs::path root = scratch("rotate_seed");
  make_checkpoint(root / "in");
  for (const std::string seed : {"-1", "18446744073709551616", "99999999999999999999999", "1e3", "", "0x10"}) {
    ToolRun run({"qdq", (root / "in").string(), "-o", (root / "q").string(), "--rotate", "rhad32", "--rotate-seed", seed,
                 "--device", "cpu"},
                "rotate_seed");
    run.wait();
    EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) != 0) << seed << ": accepted";
    EXPECT_NE(run.err().find("--rotate-seed"), std::string::npos) << seed << ": " << run.err();
    EXPECT_FALSE(fs::exists(root / "q")) << seed;
  }
  {
    ToolRun run({"qdq", (root / "in").string(), "-o", (root / "q").string(), "--rotate", "rhad32", "--rotate-seed",
                 "18446744073709551615", "--device", "cpu"},
                "rotate_seed");
    run.wait();
    EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 0) << run.err();
  }
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q2").string();
  qa.fake = true;
  qa.rotate_seed = 5;
  EXPECT_NE(quantize_failure(qa, "a seed without --rotate").find("--rotate-seed 5: without --rotate"), std::string::npos);
  qa.rotate = "had32";
  EXPECT_NE(quantize_failure(qa, "a seed with had32").find("no random signs"), std::string::npos);
  fs::remove_all(root);
}

// Part directories are named exactly OUT.part-I-of-N: a duplicate spelling or a count past the limit
// is refused naming it (they were read ambiguously, or overflowed to "part 2 of 1215752191").
TEST(CheckpointMergeHostile, PartDirectoryNamesAreExact) {
  const fs::path root = scratch("merge_names");
  make_parts(root);
  for (const std::string extra : {".part-01-of-2", ".part-1-of-02", ".part-1-of-99999999999", ".part-2-of-1", ".part-x"}) {
    SCOPED_TRACE(extra);
    const fs::path out = copy_parts(root, "q");
    fs::create_directories(root / ("q" + extra));
    EXPECT_NE(merge_failure(out, extra).find("q" + extra + ": not a part's name"), std::string::npos);
    fs::remove_all(root / ("q" + extra));
  }
  // a symbolic link with a part-like name that is not one: refused as a directory would be
  {
    const fs::path out = copy_parts(root, "q");
    fs::create_directory_symlink(root / "pristine.part-1-of-2", root / "q.part-1-of-2.old");
    EXPECT_NE(merge_failure(out, "a symlink q.part-1-of-2.old").find("q.part-1-of-2.old: not a part's name"), std::string::npos);
    fs::remove(root / "q.part-1-of-2.old");
  }
  // review of issue 35, 7: regular files so named (a job's logs beside its parts) are not merge's business
  {
    const fs::path out = copy_parts(root, "q");
    for (const char* log : {"q.part-1-of-2.log", "q.part-2-of-2.err", "q.part-x"}) std::ofstream(root / log) << "a log\n";
    mxq::cli::MergeArgs ma;
    ma.out = out.string();
    testing::internal::CaptureStdout();
    EXPECT_EQ(mxq::cli::run_merge(ma), 0);
    testing::internal::GetCapturedStdout();
    EXPECT_EQ(read_tree(out), read_tree(root / "one"));
    EXPECT_TRUE(fs::exists(root / "q.part-1-of-2.log")) << "merge removed a file that is not a part";
    for (const char* log : {"q.part-1-of-2.log", "q.part-2-of-2.err", "q.part-x"}) fs::remove(root / log);
    fs::remove_all(out);
  }
  // a symbolic link as a part directory
  const fs::path out = copy_parts(root, "q");
  fs::rename(root / "q.part-2-of-2", root / "elsewhere");
  fs::create_directory_symlink(root / "elsewhere", root / "q.part-2-of-2");
  EXPECT_NE(merge_failure(out, "a symlinked part").find("not a directory of its own"), std::string::npos);
  fs::remove_all(root);
}

// OUT with a trailing separator is OUT: `-o DIR/ --part 1/2` writes DIR.part-1-of-2 beside DIR (as
// documented: the parts are OUT's siblings); `-o .` without --part is the current directory, taken
// when it is empty and not the input's.
TEST(CheckpointPartsOptions, OutputSpellings) {
  const fs::path root = scratch("out_spellings");
  make_checkpoint(root / "in");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string() + "/";
  qa.part = "1/2";
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_quantize(qa), 0);
  EXPECT_TRUE(fs::exists(root / "q.part-1-of-2" / "mxq-part.json"));
  EXPECT_FALSE(fs::exists(root / "q"));
  const fs::path cwd = fs::current_path();
  fs::create_directories(root / "empty");
  fs::current_path(root / "empty");
  qa.part.reset();
  qa.in = (root / "in").string();
  qa.out = ".";
  const int rc = mxq::cli::run_quantize(qa);
  fs::current_path(root / "in");
  std::string refused;
  try {
    mxq::cli::run_quantize(qa);
  } catch (const std::exception& e) {
    refused = e.what();
  }
  fs::current_path(cwd);
  testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(fs::exists(root / "empty" / "config.json"));
  EXPECT_NE(refused.find("is the input's directory"), std::string::npos) << refused;
  fs::remove_all(root);
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

// inspect escapes control and direction characters of names and metadata (a tensor name could
// clear the screen, move the cursor or reverse the text of the lines after it); errors too.
TEST(CheckpointInspect, NamesAreEscapedForTheTerminal) {
  const fs::path root = scratch("inspect_escape");
  const std::string evil = std::string("a\x1b[2J\rb\xE2\x80\xAE") + "txt.weight\x07\xC2\x9B";
  write_lone_file(root / "model.safetensors", {{evil, {2, 32}}, {"plain.weight", {2, 32}}});
  mxq::cli::InspectArgs ia;
  ia.file = (root / "model.safetensors").string();
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_inspect(ia), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  for (const std::string bad : {"\x1b", "\r", "\x07", "\xE2\x80\xAE", "\xC2\x9B"})
    EXPECT_EQ(out.find(bad), std::string::npos) << "printed raw: " << testing::PrintToString(bad);
  EXPECT_NE(out.find("a\\x1b[2J\\x0db\\u202etxt.weight\\x07\\u009b"), std::string::npos) << out;
  EXPECT_EQ(mxq::cli::printable("model.layers.0.q_proj.weight \xC3\xA9\xE2\x80\x8B"),
            "model.layers.0.q_proj.weight \xC3\xA9\xE2\x80\x8B");  // other UTF-8 as it is
  fs::remove_all(root);
}

// A symbolic link to itself anywhere in the input directory no longer fails the conversion, and a side
// file that is not a regular file (a FIFO, a dangling link) is named in a warning, not dropped silently.
TEST(CheckpointQuantize, SideFilesThatAreNotRegularAreNamed) {
  const fs::path root = scratch("side_special");
  make_checkpoint(root / "in");
  fs::create_symlink("loop", root / "in" / "loop");
  ASSERT_EQ(::mkfifo((root / "in" / "fifo").c_str(), 0600), 0);
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  int rc = -1;
  std::string e;
  try {
    rc = mxq::cli::run_quantize(qa);
  } catch (const std::exception& x) {
    e = x.what();
  }
  testing::internal::GetCapturedStdout();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 0) << e;
  EXPECT_NE(err.find((root / "in" / "loop").string() + " not copied"), std::string::npos) << err;
  EXPECT_NE(err.find((root / "in" / "fifo").string() + " not copied"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(root / "q" / "tokenizer.json"));
  fs::remove_all(root);
}

// A shard named model..safetensors is a plain file name inside the checkpoint (it was refused as
// "outside the checkpoint"); a name with a separator or ".." alone still is refused.
TEST(CheckpointErrors, DoubleDotInsideAShardNameIsLegal) {
  const fs::path root = scratch("dotdot");
  write_lone_file(root / "in" / "model..safetensors", {{"proj.weight", {32, 64}}});
  std::ofstream(root / "in" / "model.safetensors.index.json")
      << json{{"metadata", json::object()}, {"weight_map", {{"proj.weight", "model..safetensors"}}}}.dump();
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  testing::internal::CaptureStdout();
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
  testing::internal::GetCapturedStdout();
  EXPECT_TRUE(fs::exists(root / "q" / "model..safetensors"));
  std::ofstream(root / "in" / "model.safetensors.index.json", std::ios::trunc)
      << json{{"metadata", json::object()}, {"weight_map", {{"proj.weight", "../in/model..safetensors"}}}}.dump();
  qa.out = (root / "q2").string();
  EXPECT_NE(quantize_failure(qa, "../").find("outside the checkpoint"), std::string::npos);
  fs::remove_all(root);
}

// Where the parts and OUT are on different file systems merge copies each shard (from the descriptor
// it checked) instead of linking it: the same bytes as the single run.
TEST(CheckpointMergeHostile, CopiesAcrossFileSystems) {
  const fs::path root = scratch("merge_copy");
  make_parts(root);
  struct stat a {}, b {};
  const fs::path other = fs::path("/dev/shm") / ("mxq_merge_copy_" + std::to_string(::getpid()));
  if (::stat(root.c_str(), &a) != 0 || ::stat("/dev/shm", &b) != 0 || a.st_dev == b.st_dev)
    GTEST_SKIP() << "no second file system (/dev/shm) to merge into";
  fs::create_directories(other);
  const fs::path out = copy_parts(root, "q");
  fs::create_directory_symlink(other, out);  // OUT on the other file system
  mxq::cli::MergeArgs ma;
  ma.out = out.string();
  testing::internal::CaptureStdout();
  ASSERT_EQ(mxq::cli::run_merge(ma), 0);
  testing::internal::GetCapturedStdout();
  EXPECT_EQ(read_tree(other), read_tree(root / "one"));
  fs::remove_all(other);
  fs::remove_all(root);
}
