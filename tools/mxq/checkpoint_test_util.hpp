#pragma once
// What the checkpoint tests share (one executable, checkpoint_test, of one file per role): the
// two-shard checkpoint they convert, lone files of random weights, the tool run in a child process,
// and reading outputs back.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/convert.hpp>
#include <mxq/mxq.hpp>

#include "commands.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;
namespace st = mxq::st;
using json = nlohmann::json;

namespace checkpoint_test {

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
  int shard;
};

inline const std::vector<Spec> kSpecs = {
    {"model.embed_tokens.weight", {100, 128}, 0},
    {"model.layers.0.input_layernorm.weight", {128}, 0},
    {"model.layers.0.self_attn.q_proj.weight", {64, 128}, 0},
    {"model.layers.0.self_attn.k_proj.weight", {32, 128}, 0},
    {"model.layers.0.self_attn.v_proj.weight", {32, 128}, 1},  // shares q/k's NVFP4 scale across shards
    {"model.layers.0.self_attn.o_proj.weight", {128, 64}, 1},
    {"model.layers.0.mlp.odd_proj.weight", {8, 40}, 1},  // K = 40: vLLM could not load it quantized
    {"lm_head.weight", {100, 128}, 1},
};

inline constexpr auto to_bf16 = mxq::f32_to_bf16;  // mxq/convert.hpp

// "SQNR 12.34 dB" of bf16 weights x against y, the tool's figure, summed in element order (the tool
// sums bands in parallel and lanes interleaved: the same figure to its two decimals).
inline std::string sqnr_text(const std::vector<std::uint16_t>& x, const std::vector<float>& y) {
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

inline std::map<std::string, std::vector<std::uint16_t>> make_checkpoint(const fs::path& dir) {
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

// One tensor of a safetensors file, its dtype and shape checked.
inline std::vector<std::uint8_t> load_from(const fs::path& file, const std::string& name, const std::string& dtype,
                                           const std::vector<std::int64_t>& shape) {
  const st::File f(file.string());
  const st::TensorInfo* t = f.view().find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
  return {f.view().data(*t).begin(), f.view().data(*t).end()};
}

// Loads one tensor of an output checkpoint through its index.
inline std::vector<std::uint8_t> load(const fs::path& dir, const std::string& name, const std::string& dtype,
                               std::vector<std::int64_t> shape) {
  json idx = json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(idx["weight_map"].contains(name)) << name;
  if (!idx["weight_map"].contains(name)) return {};
  return load_from(dir / idx["weight_map"][name].get<std::string>(), name, dtype, shape);
}

// The message run_quantize fails with; a test failure (and "") when it does not fail.
inline std::string quantize_failure(const mxq::cli::QuantizeArgs& qa, const std::string& what) {
  try {
    mxq::cli::run_quantize(qa);
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted " << what;
  return "";
}

// Every regular file under dir (relative name -> bytes).
inline std::map<std::string, std::string> read_tree(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) {
      std::ifstream f(e.path(), std::ios::binary);
      files[fs::relative(e.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(f), {});
    }
  return files;
}

// A lone-file checkpoint of the given BF16 tensors (random values), written under dir.
inline void write_lone_file(const fs::path& file, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& ts) {
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

inline fs::path scratch(const std::string& tag) {
  const fs::path root = fs::path(testing::TempDir()) / ("mxq_ckpt_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(root);
  return root;
}

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

// The manifest of part i of OUT's two parts.
inline fs::path manifest(const fs::path& out, int i) { return out.string() + ".part-" + std::to_string(i) + "-of-2/mxq-part.json"; }

// The message `mxq merge OUT` (two parts) fails with, having written nothing and kept the parts (and a
// test failure when it does not fail).
inline std::string merge_failure(const fs::path& out, const std::string& what) {
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

// A JSON array nested depth levels deep.
inline std::string nested(std::size_t depth, char open = '[', char close = ']') {
  return std::string(depth, open) + std::string(depth, close);
}

}  // namespace checkpoint_test
