#include "checkpoint_read.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

#include "safetensors.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

namespace {
[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }
}  // namespace

json parse_json(const std::string& text, const std::string& where, std::size_t max_depth) {
  if (json_depth(text.begin(), text.end(), max_depth) > max_depth)
    fail(where + ": JSON nested more than " + std::to_string(max_depth) + " levels deep (the limit; real files nest fewer than 10)");
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) fail(where + ": not valid JSON");
  return j;
}

json read_json_file(const fs::path& p, std::size_t max_depth) {
  // NOTE: O_NONBLOCK so that a FIFO without a writer is refused below instead of blocking in open.
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(p.string() + ": cannot open: " + std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    fail(p.string() + ": not a regular file (a FIFO, socket or device is not read)");
  }
  if (std::uint64_t(sb.st_size) > kMaxJsonFileBytes) {
    ::close(fd);
    fail(p.string() + ": " + std::to_string(sb.st_size) + " bytes, more than the limit of " +
         std::to_string(kMaxJsonFileBytes) + " for a JSON file of a checkpoint");
  }
  std::string text(std::size_t(sb.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // shrunk while read: parsed as it is
    got += std::size_t(r);
  }
  ::close(fd);
  text.resize(got);
  return parse_json(text, p.string(), max_depth);
}

Checkpoint open_checkpoint(const std::string& in) {
  Checkpoint c;
  const fs::path p(in);
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    c.dir = p;
    const fs::path idx = p / "model.safetensors.index.json";
    if (fs::exists(fs::symlink_status(idx, ec))) {
      c.index = read_json_file(idx);
      if (!c.index->is_object() || !c.index->contains("weight_map") || !(*c.index)["weight_map"].is_object())
        fail(idx.string() + ": no 'weight_map' object");
      std::set<std::string> files;
      for (auto& [name, file] : (*c.index)["weight_map"].items()) {
        if (!file.is_string()) fail(idx.string() + ": weight_map entry '" + name + "' is not a file name");
        const std::string fn = file.get<std::string>();
        if (fn.find('\0') != std::string::npos)  // the OS would read the name only up to it: another file
          fail(idx.string() + ": weight_map entry '" + name + "' names a file with a NUL byte in its name");
        if (fn.find('/') != std::string::npos || fn.find("..") != std::string::npos)
          fail(idx.string() + ": weight_map entry '" + name + "' names a file outside the checkpoint: " + fn);
        if (!fn.ends_with(".safetensors"))
          fail(idx.string() + ": weight_map entry '" + name + "' names '" + fn +
               "', not a .safetensors file (PyTorch .bin/.pt checkpoints are not read; convert them to safetensors first)");
        files.insert(fn);
      }
      if (files.empty()) fail(idx.string() + ": the weight_map is empty: no tensor to convert");
      c.shards.assign(files.begin(), files.end());
      // The index and the shards must agree: every listed tensor in the shard the index names, no
      // tensor in two shards, none unlisted (it would be converted but unreachable, or dropped).
      const json& wm = (*c.index)["weight_map"];
      std::map<std::string, std::string> found;  // tensor -> shard that defines it
      for (const std::string& shard : c.shards) {
        const st::File f((c.dir / shard).string());
        for (const st::TensorInfo& t : f.view().tensors()) {
          const auto [it, fresh] = found.emplace(t.name, shard);
          if (!fresh)
            fail(idx.string() + ": tensor '" + t.name + "' is defined in both " + it->second + " and " + shard);
          const auto listed = wm.find(t.name);
          if (listed == wm.end())
            fail(idx.string() + ": tensor '" + t.name + "' of " + shard + " is not listed in the weight_map");
          if (listed->get<std::string>() != shard)
            fail(idx.string() + ": tensor '" + t.name + "' is in " + shard + " but the weight_map names " +
                 listed->get<std::string>());
        }
      }
      for (auto& [name, file] : wm.items())
        if (!found.count(name))
          fail(idx.string() + ": tensor '" + name + "' is listed in the weight_map but absent from " + file.get<std::string>());
    } else if (fs::exists(fs::symlink_status(p / "model.safetensors", ec))) {
      c.shards = {"model.safetensors"};
    } else {
      fail(in + ": neither model.safetensors.index.json nor model.safetensors in this directory");
    }
  } else if (fs::is_regular_file(p, ec)) {
    if (!p.filename().string().ends_with(".safetensors"))
      fail(in + ": not a .safetensors file (PyTorch .bin/.pt checkpoints are not read; convert them to safetensors first)");
    c.dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    c.shards = {p.filename().string()};
  } else {
    fail(in + (fs::exists(p, ec) ? ": not a regular file or directory (a FIFO, socket or device is not read)"
                                 : ": no such file or directory"));
  }
  return c;
}

std::optional<json> read_config(const Checkpoint& c, const std::string& in) {
  const fs::path p = c.dir / "config.json";
  std::error_code ec;
  if (!fs::is_directory(in, ec) || !fs::exists(fs::symlink_status(p, ec))) return std::nullopt;
  json cfg = read_json_file(p);
  if (!cfg.is_object()) fail(p.string() + ": not a JSON object (a model config is {...})");
  return cfg;
}

}  // namespace mxq::cli
