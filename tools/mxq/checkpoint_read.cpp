#include "checkpoint_read.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <map>
#include <set>
#include <stdexcept>

#include "fail.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

namespace {

// A manifest's key of the expected JSON type, or an error naming the manifest and the key.
enum class Want { string, unsigned_int, boolean, object, array, object_or_null, string_or_null };
const json& need(const json& m, const fs::path& where, const char* key, Want w) {
  const auto it = m.find(key);
  static const char* const what[] = {"a string", "a non-negative integer", "true or false", "an object", "an array",
                                     "an object or null", "a string or null"};
  bool ok = it != m.end();
  if (ok) switch (w) {
      case Want::string: ok = it->is_string(); break;
      case Want::unsigned_int: ok = it->is_number_unsigned(); break;
      case Want::boolean: ok = it->is_boolean(); break;
      case Want::object: ok = it->is_object(); break;
      case Want::array: ok = it->is_array(); break;
      case Want::object_or_null: ok = it->is_object() || it->is_null(); break;
      case Want::string_or_null: ok = it->is_string() || it->is_null(); break;
    }
  if (!ok)
    fail(where.string() + ": key '" + key + "' " + (it == m.end() ? "missing" : "is not " + std::string(what[int(w)])) +
         ": expected " + what[int(w)] + " (not the manifest of a finished part of `mxq quantize|qdq --part`)");
  return *it;
}
}  // namespace

json parse_json(const std::string& text, const std::string& where, std::size_t max_depth) {
  if (json_depth(text.begin(), text.end(), max_depth) > max_depth)
    fail(where + ": JSON nested more than " + std::to_string(max_depth) + " levels deep (the limit; real files nest fewer than 10)");
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) fail(where + ": not valid JSON");
  return j;
}

json read_json_file(const fs::path& p, std::size_t max_depth, bool no_follow) {
  // NOTE: O_NONBLOCK so that a FIFO without a writer is refused below instead of blocking in open.
  // O_NOFOLLOW where a link is refused (a part's manifest): a link swapped in after the caller's
  // check is refused by open itself.
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (no_follow ? O_NOFOLLOW : 0));
  if (fd < 0 && no_follow && errno == ELOOP) fail(p.string() + ": is a symbolic link; expected a regular file of its own");
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
        // NOTE: a plain file name only ("model..safetensors" is one; "../x" and "a/b" are not)
        if (fn.find('/') != std::string::npos || fn == "." || fn == "..")
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

std::string printable(const std::string& s) {
  std::string r;
  r.reserve(s.size());
  char buf[16];
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    const auto at = [&](std::size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
    unsigned cp = 0;
    std::size_t len = 0;  // a UTF-8 sequence to escape, as code point cp
    if (c == 0xC2 && at(1) >= 0x80 && at(1) <= 0x9F) cp = at(1), len = 2;                     // C1 controls
    else if (c == 0xD8 && at(1) == 0x9C) cp = 0x061C, len = 2;                                // Arabic letter mark
    else if (c == 0xE2 && at(1) == 0x80 && (at(2) == 0x8E || at(2) == 0x8F || (at(2) >= 0xAA && at(2) <= 0xAE)))
      cp = 0x2000 + (at(2) - 0x80), len = 3;                                                 // LRM, RLM, embeddings, overrides
    else if (c == 0xE2 && at(1) == 0x81 && at(2) >= 0xA6 && at(2) <= 0xA9) cp = 0x2040 + (at(2) - 0x80), len = 3;  // isolates
    if (len) {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      r += buf;
      i += len - 1;
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      r += buf;
    } else if (c == '\\') {
      r += "\\\\";
    } else {
      r += char(c);
    }
  }
  return r;
}

std::optional<std::pair<int, int>> part_of_name(const std::string& s) {
  const auto number = [](const std::string& d) -> int {
    if (d.empty() || d.size() > 6 || d[0] == '0' || !std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return 0;
    const int v = std::stoi(d);
    return v <= kMaxParts ? v : 0;
  };
  const std::size_t of = s.find("-of-");
  if (of == std::string::npos) return std::nullopt;
  const int i = number(s.substr(0, of)), n = number(s.substr(of + 4));
  if (i < 1 || n < 1 || i > n) return std::nullopt;
  return std::pair{i, n};
}


// A part's manifest: a regular file (not a symbolic link, FIFO or device; opened non-blocking) of
// bounded size and depth, with every key merge reads, of its type.
json read_part_manifest(const fs::path& mp, int i, int n) {
  std::error_code ec;
  const fs::file_status s = fs::symlink_status(mp, ec);
  if (!fs::exists(s)) fail(mp.string() + ": missing (not a finished part of `mxq quantize --part`)");
  if (fs::is_symlink(s)) fail(mp.string() + ": is a symbolic link; a part's manifest is a regular file of its own");
  json m = read_json_file(mp, kMaxJsonDepth + 1, /*no_follow=*/true);  // the input's index sits one level down
  if (!m.is_object()) fail(mp.string() + ": not a JSON object (not the manifest of a part)");
  for (const auto& [k, w] : std::initializer_list<std::pair<const char*, Want>>{
           {"mxq_part", Want::unsigned_int}, {"of", Want::unsigned_int}, {"mxq_version", Want::string},
           {"input", Want::string}, {"input_dir", Want::string}, {"input_shards", Want::object},
           {"command", Want::string}, {"format", Want::string}, {"rule", Want::string}, {"include", Want::array},
           {"exclude", Want::array}, {"rotate", Want::string}, {"rotate_seed", Want::unsigned_int},
           {"weight_map", Want::object}, {"bytes_out", Want::unsigned_int}, {"index", Want::object_or_null},
           {"config_name", Want::string_or_null}, {"config_text", Want::string_or_null}, {"side_files", Want::boolean}})
    need(m, mp, k, w);
  if (m["mxq_part"].get<std::uint64_t>() != std::uint64_t(i) || m["of"].get<std::uint64_t>() != std::uint64_t(n))
    fail(mp.string() + ": not the manifest of part " + std::to_string(i) + " of " + std::to_string(n) + " (it says part " +
         m["mxq_part"].dump() + " of " + m["of"].dump() + ")");
  const std::string cmd = m["command"].get<std::string>();
  if (cmd != "quantize" && cmd != "qdq") fail(mp.string() + ": key 'command' is '" + cmd + "': expected quantize or qdq");
  for (const auto& [t, sh] : m["weight_map"].items())
    if (!sh.is_string()) fail(mp.string() + ": weight_map entry '" + t + "' is not a file name");
  return m;
}

}  // namespace mxq::cli
