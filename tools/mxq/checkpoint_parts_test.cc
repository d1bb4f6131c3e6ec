// --part I/N and `mxq merge`: the merged output byte-identical to a single run (quantize, qdq,
// --rotate), --part and --rotate-seed parsed whole, OUT's spellings, missing or mismatched parts refused.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
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

// --part I/N and mxq merge: the merged output is byte-identical to a single run, for every N (also
// more parts than shards), for quantize (MXFP4, NVFP4 with a fused scale across shards, MXFP8 spelled as
// the tool takes it) and qdq.
TEST(CheckpointParts, SplitAndMergeIsByteIdenticalToOneRun) {
  const fs::path root = scratch("parts");
  make_checkpoint(root / "in");
  for (const std::string cmd : {"quantize", "qdq"})
    for (const std::string format : {"mxfp4", "nvfp4", "mxfp8"}) {
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
