// `mxq inspect`: a file's or a checkpoint directory's tables, --against's errors, long names and
// names that would drive a terminal.
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

#include "checkpoint_read.hpp"
#include "checkpoint_test_util.hpp"
#include "commands.hpp"
#include "safetensors.hpp"

using namespace checkpoint_test;

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
