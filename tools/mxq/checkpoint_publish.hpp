#pragma once
// What a conversion writes besides its converted shards, and how its output is published: text files
// written through a temporary name, the input's side files, the index and config; the parts of
// `--part I/N` (their directory, their manifest) and `mxq merge`'s checked staging of each part's
// shard. The staging directory itself and check_output are staging.hpp's.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "staging.hpp"

namespace mxq::cli {

// Writes text to path through a temporary name: every write checked after it reached the disk
// (fflush, fsync, fclose), the temporary removed on failure, so a full disk never leaves an empty
// or partial file under the final name.
void write_text(const std::filesystem::path& path, const std::string& text);

// Weights in another format (PyTorch pickles, TensorFlow, Flax, GGUF) are not the converted model:
// copied beside its shards they would be loaded instead of them, or unpickled (running code).
bool other_weight_format(const std::string& n);

// The other regular files of IN's directory (tokenizer, generation config...), copied into OUT;
// weights in other formats are skipped, each named on stderr.
void copy_side_files(const Checkpoint& c, const std::filesystem::path& out, const std::set<std::string>& skip);

// What a conversion writes besides its shards: the index (sharded inputs), the config (or the lone
// file's quantization_config.json), and the input's side files (tokenizer, ...).
struct Finish {
  std::optional<nlohmann::json> index;
  std::optional<std::string> config_name, config_text;
  bool side_files = false;
};
void write_finish(const Checkpoint& c, const std::filesystem::path& out, const Finish& fin, const nlohmann::json& weight_map,
                  std::uint64_t total_size);

// ---- parts: --part I/N and mxq merge ---------------------------------------------------------------
struct Part {
  int i = 0, n = 0;  // 1 <= i <= n; n == 0: the whole checkpoint
};

// --part's value (absent: the whole checkpoint), or an error naming it and what is expected.
Part parse_part(const std::optional<std::string>& given);

// A directory as an absolute, normal path without a trailing separator: "." relative to /cwd and
// /cwd itself give the same string (a lone file named without a directory has the directory ".").
std::string normal_dir(const std::filesystem::path& d);

// OUT as an absolute, normal path without a trailing separator; "." or ".." as its last component is
// refused (the parts are OUT's siblings: OUT must name a directory of its own).
std::filesystem::path normal_out(const std::filesystem::path& out);

// OUT.part-I-of-N, beside OUT.
std::filesystem::path part_dir(const std::filesystem::path& out, const Part& p);

// What identifies an input shard for merge: its size and modification time.
nlohmann::json shard_fingerprints(const Checkpoint& c);

constexpr const char* kManifest = "mxq-part.json";

// A part's end: its shards and a manifest (what merge needs to write the rest, and to check that
// every part came from the same input and options), published as OUT.part-I-of-N.
int finish_part(const QuantizeArgs& a, const Part& part, const Checkpoint& c, Staging& stage, const Finish& fin,
                const nlohmann::json& weight_map, double bytes_out, std::int64_t n_quant, std::int64_t n_copy);

// A part's shard, hard-linked or copied into the staging directory and checked there against the
// input shard it was converted from and the part's manifest: the staged file is a regular file of its
// own whose safetensors header is valid and declares exactly the tensors the manifest's weight map
// gives this shard, each either the input's tensor (same dtype and shape) or a quantized module of
// the input's weight (its shape, the manifest's format), or the transform's matrix (counted in
// rotation_matrices). gpt_oss: the conversion is gpt-oss's MXFP4 layout (quantize's choice for that family
// and format): the quantized tensors are then the experts' `_blocks` / `_scales` of the input's 3-D experts
// tensors (gpt_oss_experts_tensors), and no compressed-tensors module. Returns the staged file's tensors
// (name -> data bytes).
std::map<std::string, std::uint64_t> stage_part_shard(const std::filesystem::path& from, const std::filesystem::path& to,
                                                      const std::filesystem::path& input_shard,
                                                      const std::filesystem::path& manifest, const nlohmann::json& part_map,
                                                      const std::string& shard, const nlohmann::json& m0, bool gpt_oss,
                                                      int& rotation_matrices);

}  // namespace mxq::cli
