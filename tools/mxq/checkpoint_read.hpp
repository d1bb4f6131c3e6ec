#pragma once
// A checkpoint's structure, read and checked before anything is converted: its shards (the index's
// files, model.safetensors, or one file), the index and config.json. Every file is opened as a
// regular file of bounded size (a FIFO, device or 10 GB "config.json" is refused, never waited on
// or read whole). Shared by the commands that read checkpoints and the checkpoint fuzz target.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "json_limits.hpp"

namespace mxq::cli {

// Largest model.safetensors.index.json or config.json read (real ones are under 10 MB).
constexpr std::uint64_t kMaxJsonFileBytes = 100ull << 20;

struct Checkpoint {
  std::filesystem::path dir;             // where config.json and the shards live
  std::vector<std::string> shards;       // file names relative to dir
  std::optional<nlohmann::json> index;   // model.safetensors.index.json, when sharded
};

// IN: a .safetensors file or a directory. Refuses (std::runtime_error naming the file) what is not
// safetensors, an index whose weight_map is empty, names files outside the checkpoint, or disagrees
// with the shards (a listed tensor absent from its shard, a tensor in two shards, one not listed).
Checkpoint open_checkpoint(const std::string& in);

// IN's config.json (directories only): a JSON object, or an error naming the file.
std::optional<nlohmann::json> read_config(const Checkpoint& c, const std::string& in);

// A JSON file: a regular file of at most kMaxJsonFileBytes holding valid JSON nested at most
// max_depth levels, or an error naming it. The file is opened non-blocking (a FIFO is refused at once);
// with no_follow, a symbolic link is refused (O_NOFOLLOW).
nlohmann::json read_json_file(const std::filesystem::path& p, std::size_t max_depth = kMaxJsonDepth,
                              bool no_follow = false);

// text as JSON nested at most max_depth levels, or an error naming `where`.
nlohmann::json parse_json(const std::string& text, const std::string& where, std::size_t max_depth = kMaxJsonDepth);

// s for a terminal: control characters (C0, DEL, C1), the Unicode direction marks, embeddings,
// overrides and isolates (U+061C, U+200E/F, U+202A-U+202E, U+2066-U+2069) and backslashes escaped
// (\x1b, \u202e, \\); everything else as it is. Names and metadata from a file pass through it
// before they are printed (a tensor name could otherwise move the cursor, erase lines or reverse text).
std::string printable(const std::string& s);

// ---- the parts of `--part I/N`, read by `mxq merge` (a part directory is untrusted) ----------------
constexpr int kMaxParts = 100000;

// A part directory's name after "OUT.part-": exactly "I-of-N" (decimal, no leading zero,
// 1 <= I <= N <= kMaxParts) gives {I, N}; anything else nullopt.
std::optional<std::pair<int, int>> part_of_name(const std::string& s);

// Part i of n's manifest (mxq-part.json): a regular file of its own (not a symbolic link; read as
// read_json_file reads, the embedded index one level deeper) holding every key merge reads with its
// JSON type, for part i of n, its weight map of file names; or an error naming the file and the key.
nlohmann::json read_part_manifest(const std::filesystem::path& file, int i, int n);

}  // namespace mxq::cli
