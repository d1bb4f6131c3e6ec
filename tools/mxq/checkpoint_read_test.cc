// The input as the converters read it before converting anything: what is not safetensors, a
// truncated shard, an index that disagrees with its shards, a config that is not a JSON object, FIFOs,
// devices and oversized or deeply nested JSON, overlong tensor names: each refused with one line
// naming the file, nothing written.
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
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "safetensors.hpp"

using namespace checkpoint_test;

TEST(CheckpointErrors, OneLineNamingTheProblem) {
  mxq::cli::QuantizeArgs qa;
  qa.in = "/nonexistent/dir";
  qa.out = testing::TempDir() + "/never";
  const std::string missing = quantize_failure(qa, "a missing input");
  EXPECT_NE(missing.find("/nonexistent/dir"), std::string::npos) << missing;
  qa.format = "int3";
  EXPECT_THROW(mxq::cli::run_quantize(qa), std::exception);
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
