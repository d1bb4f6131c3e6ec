// libFuzzer target for the checkpoint layer (checkpoint_read.cpp): an index, a config.json and two
// shards, written to a scratch directory and read the way the converters read them before converting
// anything (open_checkpoint: the index, every shard's header and their agreement; read_config).
// Any input either reads into a checkpoint whose shards all open, or fails with a std::runtime_error
// (what every error of this layer is); anything else (a crash, a json::exception, a hang on a file)
// is a finding.
//
// The JSON of a part directory is read too: mxq-part.json, as `mxq merge` reads it
// (read_part_manifest: every key and its type), its config text parsed as merge parses it. Every
// JSON value read is written back by dump_json and must read back equal.
//
// Input: up to five parts separated by "\n#%#\n": the index JSON, config.json, a.safetensors,
// mxq-part.json and b.safetensors (last: it takes the rest). An empty first part means no index
// (then the first shard is model.safetensors); an empty second part, no config.json; an empty
// fourth, no manifest.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint_read.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path& scratch() {
  static const fs::path dir = [] {
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path d = base / ("mxq_checkpoint_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(d);
    std::atexit([] { std::error_code ec; fs::remove_all(scratch(), ec); });
    return d;
  }();
  return dir;
}

void put(const fs::path& p, std::string_view bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSep = "\n#%#\n";
  std::vector<std::string_view> parts;
  for (std::size_t pos = 0; parts.size() < 5;) {
    const std::size_t next = parts.size() == 4 ? std::string_view::npos : in.find(kSep, pos);
    parts.push_back(in.substr(pos, next == std::string_view::npos ? std::string_view::npos : next - pos));
    if (next == std::string_view::npos) break;
    pos = next + kSep.size();
  }
  parts.resize(5);

  const fs::path& dir = scratch();
  std::error_code ec;
  for (const char* n : {"model.safetensors.index.json", "config.json", "model.safetensors", "a.safetensors", "b.safetensors", "mxq-part.json"})
    fs::remove(dir / n, ec);
  if (!parts[0].empty()) put(dir / "model.safetensors.index.json", parts[0]);
  if (!parts[1].empty()) put(dir / "config.json", parts[1]);
  put(dir / (parts[0].empty() ? "model.safetensors" : "a.safetensors"), parts[2]);
  put(dir / "b.safetensors", parts[4]);
  if (!parts[3].empty()) put(dir / "mxq-part.json", parts[3]);

  // dump_json writes what was read so that it reads back equal, at any depth the reader accepts
  const auto round_trip = [](const nlohmann::json& j) {
    if (nlohmann::json::parse(mxq::cli::dump_json(j)) != j) std::abort();
  };
  if (!parts[3].empty()) try {
      const nlohmann::json m = mxq::cli::read_part_manifest(dir / "mxq-part.json", 1, 1);
      for (const char* k : {"input", "weight_map", "bytes_out", "config_name", "config_text", "index", "side_files"})
        if (!m.contains(k)) std::abort();  // every key merge reads was checked
      for (const auto& [t, f] : m["weight_map"].items())
        if (!f.is_string()) std::abort();
      round_trip(m);
      if (m["config_text"].is_string()) round_trip(mxq::cli::parse_json(m["config_text"].get<std::string>(), "config_text"));
    } catch (const std::runtime_error&) {
    }

  try {
    const mxq::cli::Checkpoint c = mxq::cli::open_checkpoint(dir.string());
    const auto config = mxq::cli::read_config(c, dir.string());
    if (config && !config->is_object()) std::abort();
    if (config) round_trip(*config);
    if (c.index) round_trip(*c.index);
    if (c.shards.empty()) std::abort();
    std::uint64_t tensors = 0;
    for (const std::string& s : c.shards) {
      if (s.find('/') != std::string::npos) std::abort();  // never outside the checkpoint
      const mxq::st::File f((c.dir / s).string());
      for (const mxq::st::TensorInfo& t : f.view().tensors())
        if (f.view().find(t.name) != &t) std::abort();
      tensors += f.view().tensors().size();
    }
    if (c.index && tensors != (*c.index)["weight_map"].size()) std::abort();  // agreement was checked
  } catch (const std::runtime_error&) {
  }
  return 0;
}
