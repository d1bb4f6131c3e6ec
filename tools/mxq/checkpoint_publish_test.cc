// How a conversion's output is written and published: never over the input, all or nothing (a full
// disk, a failed rename, a signal), stale staging directories of dead runs removed, side files copied
// (not weights of other formats, not FIFOs), JSON written back in linear size.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
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
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "safetensors.hpp"
#include "staging.hpp"

using namespace checkpoint_test;

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
