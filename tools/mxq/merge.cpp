// `mxq merge OUT`: the parts OUT.part-I-of-N of `mxq quantize|qdq --part I/N` assembled into OUT, each
// part's shards checked against the input and its manifest before anything is published
// (checkpoint_publish's stage_part_shard), the index rebuilt from the shards' own headers.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>
#include <mxq/version.hpp>

#include "checkpoint_plan.hpp"
#include "checkpoint_publish.hpp"
#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "fail.hpp"
#include "fusion.hpp"
#include "json_limits.hpp"
#include "staging.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

int run_merge(const MergeArgs& a) {
  const fs::path out = normal_out(a.out);
  const fs::path parent = out.parent_path();
  const std::string stem = out.filename().string() + ".part-";
  // OUT.part-I-of-N directories, named exactly so. A directory or symbolic link whose name starts so
  // but is not exactly a part's is refused, not skipped (a part misnamed would be left out); any
  // other entry so named (a log file, q.part-1-of-8.log) is none of merge's business and skipped.
  std::map<int, fs::path> parts;
  int n = 0;
  std::error_code ec;
  if (fs::is_directory(parent, ec))
    for (const auto& e : fs::directory_iterator(parent)) {
      check_interrupted();
      const std::string name = e.path().filename().string();
      if (!name.starts_with(stem)) continue;
      const std::optional<std::pair<int, int>> in = part_of_name(name.substr(stem.size()));
      const std::optional<Part> p = in ? std::optional<Part>(Part{in->first, in->second}) : std::nullopt;
      std::error_code e2;
      if (!p && !e.is_symlink(e2) && !e.is_directory(e2)) continue;  // a file: skipped
      if (!p)
        fail(e.path().string() + ": not a part's name (expected " + stem + "I-of-N, I and N without leading zeros, 1 <= I <= N <= " +
             std::to_string(kMaxParts) + "); move it away to merge");
      if (e.is_symlink(e2) || !e.is_directory(e2))
        fail(e.path().string() + ": not a directory of its own (a symbolic link or a file); a part is a directory");
      if (n && p->n != n)
        fail(e.path().string() + ": a part of " + std::to_string(p->n) + " beside parts of " + std::to_string(n));
      n = p->n;
      parts[p->i] = e.path();
    }
  if (!n) fail(out.string() + ": no parts to merge (expected directories " + out.string() + ".part-I-of-N from `--part I/N`)");
  for (int i = 1; i <= n; ++i)
    if (!parts.count(i))
      fail(out.string() + ": part " + std::to_string(i) + " of " + std::to_string(n) + " is missing (" +
           part_dir(out, Part{i, n}).string() + "); run it with --part " + std::to_string(i) + "/" + std::to_string(n));
  // The manifests: one input, one set of options, one finish; every shard converted by exactly one part.
  std::vector<json> man;
  for (const auto& [i, dir] : parts) {
    check_interrupted();
    man.push_back(read_part_manifest(dir / kManifest, i, n));
  }
  for (const char* k : {"mxq_version", "input", "input_dir", "input_shards", "command", "format", "rule", "include", "exclude",
                        "rotate", "rotate_seed", "index",
                        "config_name", "config_text", "side_files"})
    for (std::size_t j = 1; j < man.size(); ++j)
      if (man[j][k] != man[0][k])
        fail(parts[int(j) + 1].string() + ": '" + k + "' differs from part 1's: the parts come from different inputs or "
             "options");
  const json& m0 = man[0];
  const fs::path m0_path = parts[1] / kManifest;
  if (m0.at("mxq_version") != MXQ_VERSION_STRING)
    fail(parts[1].string() + ": written by mxq " + m0.at("mxq_version").get<std::string>() + ", this is mxq " +
         MXQ_VERSION_STRING + ": convert the parts and merge them with one version");
  // The input is read again: it must be the one the parts read, shard for shard, and what merge
  // writes besides the shards is what that input implies.
  const std::string input = m0.at("input").get<std::string>();
  const Checkpoint c = open_checkpoint(input);
  if (normal_dir(m0.at("input_dir").get<std::string>()) != normal_dir(c.dir))
    fail(m0_path.string() + ": key 'input_dir' is not the directory of its 'input' " + input);
  if (shard_fingerprints(c) != m0.at("input_shards"))
    fail(input + ": its shards changed (size or modification time) since the parts were converted");
  if (m0.at("index") != (c.index ? *c.index : json(nullptr)))
    fail(m0_path.string() + ": key 'index' is not " + input + "'s model.safetensors.index.json");
  const bool fake = m0.at("command") == "qdq";
  const std::optional<json> in_cfg = read_config(c, input);
  const bool in_dir = fs::is_directory(input, ec);
  Finish fin;
  fin.index = c.index;
  fin.side_files = in_dir && (fake || in_cfg);
  if (m0.at("side_files") != fin.side_files)
    fail(m0_path.string() + ": key 'side_files' is " + m0.at("side_files").dump() + ", " + input + " implies " +
         json(fin.side_files).dump());
  const json expect_name = fake ? json(nullptr) : json(in_cfg ? "config.json" : "quantization_config.json");
  if (m0.at("config_name") != expect_name)
    fail(m0_path.string() + ": key 'config_name' is " + m0.at("config_name").dump() + ", expected " + expect_name.dump() +
         " (what " + input + " implies; nothing else is written)");
  // quantize's choice: an MXFP4 gpt-oss model gets gpt-oss's own layout and quantization_config (quant_method
  // mxfp4), every other conversion the compressed-tensors ones. (The manifest holds --format as typed:
  // quantize takes exactly "mxfp4" for MXFP4.)
  const bool gpt_oss = gpt_oss_layout(fake, m0.at("format") == "mxfp4", loader_fusion(in_cfg));
  if (fake != m0.at("config_text").is_null())
    fail(m0_path.string() + ": key 'config_text' is " + std::string(fake ? "not null" : "null") + " for " +
         m0.at("command").get<std::string>());
  if (!fake) {
    json cfg = parse_json(m0.at("config_text").get<std::string>(), m0_path.string() + ": key 'config_text'");
    const json* qc = in_cfg ? (cfg.is_object() && cfg.contains("quantization_config") ? &cfg["quantization_config"] : nullptr)
                            : &cfg;
    const char* method = gpt_oss ? "mxfp4" : "compressed-tensors";
    if (!cfg.is_object() || !qc || !qc->is_object() || qc->value("quant_method", json()) != method)
      fail(m0_path.string() + ": key 'config_text' is not a JSON object with a" + (gpt_oss ? "n mxfp4 (gpt-oss)" : " compressed-tensors") +
           " quantization_config");
    if (in_cfg) {  // the input's config.json, with its quantization_config and dtype set as quantize sets them
      json x = *in_cfg, y = cfg;
      for (const char* k : {"quantization_config", "torch_dtype"}) x.erase(k), y.erase(k);
      if (x != y)
        fail(m0_path.string() + ": key 'config_text' is not " + (c.dir / "config.json").string() +
             " with a quantization_config: its other keys differ");
    }
    fin.config_name = expect_name.get<std::string>();
    fin.config_text = dump_json(cfg) + "\n";
  }
  check_output(fs::path(input), out, a.overwrite);
  Staging stage{out, a.overwrite};
  // Shard i was converted by part i % N + 1 (run_quantize's assignment). Hard links where only this user
  // can write the part's file (no copy of the data), else a copy (stage_part_shard); the parts stay
  // intact until OUT is published. Every shard is checked before anything is published, and the index is rebuilt from
  // the shards' own headers.
  json weight_map = json::object();
  std::uint64_t total = 0;
  int rotation_matrices = 0;
  std::vector<std::size_t> listed(man.size(), 0);
  for (std::size_t si = 0; si < c.shards.size(); ++si) {
    check_interrupted();
    const int i = int(si % std::size_t(n)) + 1;
    const std::string& shard = c.shards[si];
    const auto tensors = stage_part_shard(parts[i] / shard, stage.dir() / shard, c.dir / shard, parts[i] / kManifest,
                                          man[std::size_t(i) - 1]["weight_map"], shard, m0, gpt_oss, rotation_matrices);
    for (const auto& [t, bytes] : tensors) {
      if (weight_map.contains(t)) fail(parts[i].string() + ": tensor '" + t + "' is in two shards");
      weight_map[t] = shard;
      total += bytes;
    }
    listed[std::size_t(i) - 1] += tensors.size();
  }
  for (std::size_t j = 0; j < man.size(); ++j)
    if (man[j]["weight_map"].size() != listed[j])
      fail((parts[int(j) + 1] / kManifest).string() + ": weight_map lists tensors of shards this part did not convert");
  if (rotation_matrices > (m0.at("rotate") == "" ? 0 : 1))
    fail(out.string() + ": the parts hold " + std::to_string(rotation_matrices) + " transform matrices; a rotated checkpoint has one");
  check_interrupted();
  write_finish(c, stage.dir(), fin, weight_map, total);
  check_interrupted();
  stage.publish();
  if (!a.keep_parts)
    for (const auto& [i, dir] : parts) {
      fs::remove_all(dir, ec);
      if (ec)  // merged and published: a part left behind is worth a word, not a failure
        fmt::print(stderr, "mxq: warning: the part directory {} could not be removed after the merge ({}); remove it "
                   "by hand\n", dir.string(), ec.message());
    }
  fmt::print("merged {} parts into {}: {} shards, {} tensors{}\n", n, out.string(), c.shards.size(), weight_map.size(),
             a.keep_parts ? " (parts kept)" : "");
  return 0;
}

}  // namespace mxq::cli
