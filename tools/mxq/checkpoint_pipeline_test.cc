// The conversion pipeline of `mxq quantize` and `mxq qdq`: every weight's bytes equal to the
// library's quantize or qdq (misaligned in its file, empty, rotated), the NVFP4 global scales from the
// (rotated) amax of each fused group, and the error lines: the figure the library's values give,
// across the parallel error pass's bands, NaN and Inf counted and never scored.
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
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "safetensors.hpp"

using namespace checkpoint_test;

namespace {

float global_scale_of(const fs::path& file, const std::string& module) {
  const st::File f(file.string());
  const st::TensorInfo* t = f.view().find(module + ".weight_global_scale");
  if (!t) return NAN;
  float S;
  std::memcpy(&S, f.view().data(*t).data(), 4);
  return S;
}

}  // namespace

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

// A rule the format does not define is refused before anything is read or written, with the library's
// sentence (docs/api.md, "Formats x scale rules"); one it defines runs.
TEST(CheckpointQdq, RulesTheFormatDoesNotDefineAreRefused) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_qdq_rules_" + std::to_string(::getpid()));
  fs::remove_all(root);
  make_checkpoint(root / "in");
  for (const auto& [format, rule] : {std::pair{"mxint8", "quest"}, {"mxfp8_e5m2", "even_fp4"}, {"mxfp8", "quest"}}) {
    ToolRun run({"qdq", (root / "in").string(), "-o", (root / "q").string(), "--format", format, "--rule", rule,
                 "--device", "cpu"},
                "qdq_rules");
    run.wait();
    EXPECT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 2) << format << " " << rule << ": " << run.err();
    const mxq::Format f = mxq::parse_format(std::string(format) == "mxfp8" ? "mxfp8_e4m3" : format);
    EXPECT_EQ(run.err(), "mxq: --rule '" + std::string(rule) + "': " + mxq::rule_refusal(f, mxq::parse_rule(rule)) + "\n");
    EXPECT_FALSE(fs::exists(root / "q")) << format << " " << rule;
  }
  EXPECT_EQ(mxq::rule_refusal(mxq::Format::mxint8, mxq::ScaleRule::quest),
            "rule 'quest' is not defined for format 'mxint8' (its constant 2.92247856 / 6 fits the E2M1 grid; defined for "
            "mxfp4, nvfp4); mxint8 accepts floor, ceil, even, rceil");
  mxq::cli::QuantizeArgs qa;
  qa.in = (root / "in").string();
  qa.out = (root / "q").string();
  qa.fake = true;
  qa.format = "mxfp4";
  qa.rule = "quest";
  EXPECT_EQ(mxq::cli::run_quantize(qa), 0);
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
