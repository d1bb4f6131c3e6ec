// Where the conversions run: --device and --gpus refused when unknown or unusable, the GPU writing
// the CPU's files byte for byte (skipped without a usable GPU), and the engine's overlapped
// conversions equal to its one-shot ones.
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
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "engine.hpp"
#include "safetensors.hpp"

using namespace checkpoint_test;

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
