#include "checkpoint_publish.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include <mxq/version.hpp>

#include "checkpoint_plan.hpp"
#include "compressed_tensors.hpp"
#include "fail.hpp"
#include "json_limits.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail(tmp.string() + ": cannot create: " + std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int e = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) {
    std::error_code ec;
    fs::remove(tmp, ec);
    fail(tmp.string() + ": write failed: " + std::strerror(e ? e : errno));
  }
  fs::rename(tmp, path);
}

bool other_weight_format(const std::string& n) {
  for (const char* ext : {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".gguf", ".bin.index.json"})
    if (n.ends_with(ext)) return true;
  return false;
}

void copy_side_files(const Checkpoint& c, const fs::path& out, const std::set<std::string>& skip) {
  for (const auto& e : fs::directory_iterator(c.dir)) {
    check_interrupted();
    const std::string n = e.path().filename().string();
    // NOTE: with an error_code: a symbolic link to itself (ELOOP) or a dangling one is not a reason
    // to fail the conversion, nor to drop the file without a word.
    std::error_code ec;
    const bool regular = e.is_regular_file(ec);
    if (!regular) {
      std::error_code e2;
      if (!e.is_directory(e2) && n != "model.safetensors.index.json" && n != "config.json")
        fmt::print(stderr, "mxq: warning: {} not copied to the output: not a regular file (a FIFO, socket, device, or a "
                   "symbolic link that leads to none{})\n", e.path().string(), ec ? ": " + ec.message() : "");
      continue;
    }
    if (skip.count(n) || n.ends_with(".safetensors") || n == "model.safetensors.index.json" ||
        std::find(c.shards.begin(), c.shards.end(), n) != c.shards.end())
      continue;  // never a converted shard overwritten by its original
    if (other_weight_format(n)) {
      fmt::print(stderr, "mxq: warning: {} not copied to the output: weights in another format than safetensors "
                 "(a PyTorch pickle, TensorFlow, Flax or GGUF file) are not part of the converted checkpoint\n",
                 e.path().string());
      continue;
    }
    fs::copy_file(e.path(), out / n, fs::copy_options::overwrite_existing, ec);
    if (ec) fail(e.path().string() + ": cannot copy to the output: " + ec.message());
  }
}

void write_finish(const Checkpoint& c, const fs::path& out, const Finish& fin, const json& weight_map,
                  std::uint64_t total_size) {
  if (fin.index) {
    json idx = *fin.index;
    idx["weight_map"] = weight_map;
    if (idx.contains("metadata") && idx["metadata"].is_object()) idx["metadata"]["total_size"] = total_size;
    write_text(out / "model.safetensors.index.json", dump_json(idx) + "\n");
  }
  if (fin.side_files) {
    std::set<std::string> skip;
    if (fin.config_name) skip.insert(*fin.config_name);
    copy_side_files(c, out, skip);
  }
  if (fin.config_name) write_text(out / *fin.config_name, *fin.config_text);
}

Part parse_part(const std::optional<std::string>& given) {
  if (!given) return {};
  const std::string& s = *given;
  if (s.empty())
    fail("--part '': expected I/N with 1 <= I <= N (an empty value, as an unset variable gives: leave --part out to "
         "convert the whole checkpoint)");
  // NOTE: std::from_chars over the whole string, not sscanf("%d"): that skipped leading spaces and
  // wrapped out-of-range numbers (4294967297/4294967298 became 1/2).
  Part p;
  const char* const end = s.data() + s.size();
  const auto num = [&](const char* from, int& v) -> const char* {
    if (from == end || *from < '0' || *from > '9') return nullptr;  // no sign, no space
    const auto [ptr, ec] = std::from_chars(from, end, v);
    return ec == std::errc() ? ptr : nullptr;
  };
  const char* q = num(s.data(), p.i);
  if (q && q != end && *q == '/') q = num(q + 1, p.n);
  else q = nullptr;
  if (!q || q != end || p.n < 1 || p.i < 1 || p.i > p.n || p.n > kMaxParts)
    fail("--part '" + s + "': expected I/N with 1 <= I <= N <= " + std::to_string(kMaxParts) +
         " (e.g. --part 2/8: the second of eight parts)");
  return p;
}

std::string normal_dir(const fs::path& d) {
  fs::path p = fs::absolute(d).lexically_normal();
  if (!p.has_filename() && p != p.root_path()) p = p.parent_path();
  return p.string();
}

fs::path normal_out(const fs::path& out) {
  fs::path o = fs::absolute(out).lexically_normal();
  if (!o.has_filename()) o = o.parent_path();  // OUT/ -> OUT
  const std::string last = o.filename().string();
  if (last.empty() || last == "." || last == ".." || o == o.root_path())
    fail("output '" + out.string() + "': with --part and merge it must name a directory of its own (not ., .. or /)");
  return o;
}

fs::path part_dir(const fs::path& out, const Part& p) {
  const fs::path o = normal_out(out);
  return o.parent_path() / (o.filename().string() + ".part-" + std::to_string(p.i) + "-of-" + std::to_string(p.n));
}

json shard_fingerprints(const Checkpoint& c) {
  json f = json::object();
  for (const std::string& sh : c.shards)
    f[sh] = {{"bytes", std::uint64_t(fs::file_size(c.dir / sh))},
             {"mtime", std::int64_t(fs::last_write_time(c.dir / sh).time_since_epoch().count())}};
  return f;
}

int finish_part(const QuantizeArgs& a, const Part& part, const Checkpoint& c, Staging& stage, const Finish& fin,
                const json& weight_map, double bytes_out, std::int64_t n_quant, std::int64_t n_copy) {
  json m = {{"mxq_part", part.i},
            {"mxq_version", MXQ_VERSION_STRING},
            {"of", part.n},
            {"input", fs::absolute(fs::path(a.in)).lexically_normal().string()},
            {"input_dir", normal_dir(c.dir)},
            {"input_shards", shard_fingerprints(c)},
            {"command", a.fake ? "qdq" : "quantize"},
            {"format", a.format},
            {"rule", a.rule},
            {"include", a.include},
            {"exclude", a.exclude},
            {"rotate", a.rotate},
            {"rotate_seed", a.rotate_seed.value_or(0)},
            {"weight_map", weight_map},
            {"bytes_out", std::uint64_t(bytes_out)},
            {"index", fin.index ? *fin.index : json(nullptr)},
            {"config_name", fin.config_name ? json(*fin.config_name) : json(nullptr)},
            {"config_text", fin.config_text ? json(*fin.config_text) : json(nullptr)},
            {"side_files", fin.side_files}};
  write_text(stage.dir() / kManifest, dump_json(m) + "\n");
  stage.publish();
  fmt::print("part {}/{}: converted {} tensors, copied {} unchanged, into {}; `mxq merge {}` once every part is done\n",
             part.i, part.n, n_quant, n_copy, part_dir(fs::path(a.out), part).string(), a.out);
  return 0;
}

namespace {

// A part's file copied to `to` (a new name) from `in`, the descriptor that was checked (a regular
// file, opened without following a link and non-blocking); every write checked and synced;
// interruptible between chunks. `in` stays open (the caller's).
void copy_part_file(int in, const fs::path& from, const fs::path& to) {
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (out < 0) fail(to.string() + ": cannot create: " + std::strerror(errno));
  std::vector<char> buf(1 << 20);
  std::string error;
  for (;;) {
    if (interrupt_signal()) break;  // check_interrupted() below, once `out` is closed
    const ssize_t r = ::read(in, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      error = from.string() + ": cannot read: " + std::strerror(errno);
      break;
    }
    if (r == 0) break;
    for (ssize_t done = 0; done < r;) {
      const ssize_t w = ::write(out, buf.data() + done, std::size_t(r - done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        error = to.string() + ": cannot write: " + std::strerror(w < 0 ? errno : ENOSPC);
        break;
      }
      done += w;
    }
    if (!error.empty()) break;
  }
  if (error.empty() && ::fsync(out) != 0) error = to.string() + ": cannot write: " + std::strerror(errno);
  if (::close(out) != 0 && error.empty()) error = to.string() + ": cannot write: " + std::strerror(errno);
  check_interrupted();
  if (!error.empty()) fail(error);
}

}  // namespace

std::map<std::string, std::uint64_t> stage_part_shard(const fs::path& from, const fs::path& to, const fs::path& input_shard,
                                                      const fs::path& manifest, const json& part_map,
                                                      const std::string& shard, const json& m0, bool gpt_oss,
                                                      int& rotation_matrices) {
  // The part's file, opened once: not through a symbolic link, non-blocking (a FIFO swapped in is
  // refused, never waited on).
  const int fd = ::open(from.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) fail(from.string() + ": missing (the part is incomplete)");
    if (e == ELOOP) fail(from.string() + ": is a symbolic link; a part's shard must be a regular file of its own");
    fail(from.string() + ": cannot open: " + std::strerror(e));
  }
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) fail(from.string() + ": not a regular file");
  // NOTE: a hard link is the part's file itself (its inode), not a snapshot: whoever can write that
  // file can rewrite its header or data after the check below (or truncate it under the check's
  // mmap). So a link only for a file no one else can write: owned by this user, without group or
  // other write permission (with an ACL, the group bits are its mask); and only when the linked name
  // turns out to be the inode checked here. Anything else is copied from this descriptor into a file
  // of merge's own, which is what is checked and published.
  std::error_code ec;
  bool linked = false;
  if (sb.st_uid == ::geteuid() && !(sb.st_mode & (S_IWGRP | S_IWOTH)) && ::link(from.c_str(), to.c_str()) == 0) {
    struct stat ts {};
    if (::lstat(to.c_str(), &ts) != 0 || ts.st_dev != sb.st_dev || ts.st_ino != sb.st_ino) {
      ::unlink(to.c_str());
      fail(from.string() + ": replaced while it was merged");
    }
    linked = true;
  }
  if (!linked) copy_part_file(fd, from, to);  // another owner, writable by others, or another file system
  const fs::file_status ss = fs::symlink_status(to, ec);
  if (!fs::is_regular_file(ss) || fs::is_symlink(ss)) fail(from.string() + ": not a regular file");
  const st::File out(to.string());
  const st::View& v = out.view();
  const st::File in(input_shard.string());
  const st::View& iv = in.view();
  const std::string where = from.string();
  // the manifest's weight map for this shard, both ways
  std::set<std::string> listed;
  for (const auto& [t, sh] : part_map.items())
    if (sh.get<std::string>() == shard) listed.insert(t);
  std::map<std::string, std::uint64_t> found;
  for (const st::TensorInfo& t : v.tensors()) {
    if (!listed.count(t.name))
      fail(where + ": tensor '" + t.name + "' is not in the weight map of " + manifest.string() + " for " + shard);
    found[t.name] = t.bytes();
  }
  for (const std::string& t : listed)
    if (!found.count(t)) fail(manifest.string() + ": weight_map lists tensor '" + t + "' in " + shard + ", which " + where + " lacks");
  // every tensor against the input shard
  const bool fake = m0.at("command") == "qdq";
  std::set<std::string> consumed;  // output tensors accounted for
  std::set<std::string> replaced;  // input tensors quantized
  if (!fake) {
    const std::string fmt_name = m0.at("format").get<std::string>();
    for (const auto& [mod, md] : quantized_modules(v, where)) {
      if (gpt_oss)
        fail(where + ": module '" + mod + "' is in the compressed-tensors layout; gpt-oss's MXFP4 conversion quantizes "
             "only the experts");
      const st::TensorInfo* w = iv.find(mod + ".weight");
      if (!w || w->shape.size() != 2 || w->shape[0] != md.N || w->shape[1] != md.K)
        fail(where + ": module '" + mod + "' is quantized from a [" + std::to_string(md.N) + ", " + std::to_string(md.K) +
             "] weight, which " + input_shard.string() + " does not hold");
      const bool fmt_ok = md.format == Format::nvfp4        ? fmt_name == "nvfp4"
                          : md.format == Format::mxfp4      ? fmt_name == "mxfp4"
                                                            : fmt_name == "mxfp8" || fmt_name == "mxfp8_e4m3";
      if (!fmt_ok)
        fail(where + ": module '" + mod + "' is " + std::string(to_string(md.format)) + ", the manifest's format is " + fmt_name);
      consumed.insert(md.codes->name), consumed.insert(md.scale->name);
      if (md.global) consumed.insert(md.global->name);
      replaced.insert(mod + ".weight");
      const st::TensorInfo* r = v.find(mod + "." + kRotationScheme + "_input.weight");
      if (r) {
        if (r->dtype != "F32" || r->shape.size() != 2 || r->shape[0] != r->shape[1] || m0.at("rotate") == "")
          fail(where + ": tensor '" + r->name + "' is not the square F32 matrix of the manifest's rotation");
        consumed.insert(r->name);
        ++rotation_matrices;
      }
    }
    // gpt-oss's MXFP4 experts (quantize's layout for that model): X_blocks and X_scales for an input X.
    for (const st::TensorInfo& x : iv.tensors()) {
      if (!gpt_oss || !gpt_oss_experts_name(x.name) || (!v.find(x.name + "_blocks") && !v.find(x.name + "_scales"))) continue;
      if (x.shape.size() != 3)
        fail(where + ": tensor '" + x.name + "_blocks' or '_scales' (gpt-oss's MXFP4 experts) for a " +
             std::to_string(x.shape.size()) + "-D input tensor");
      for (const ExpertsDecl& d : gpt_oss_experts_tensors(x.name, x.shape)) {
        const st::TensorInfo* t = v.find(d.name);
        if (!t || t->dtype != d.dtype || t->shape != d.shape)
          fail(where + ": tensor '" + d.name + "' is missing or not gpt-oss's MXFP4 layout of " + input_shard.string() +
               "'s '" + x.name + "' (" + d.dtype + " " + st::shape_text(d.shape) + ")");
        consumed.insert(d.name);
      }
      replaced.insert(x.name);
    }
  }
  for (const st::TensorInfo& t : v.tensors()) {
    if (consumed.count(t.name)) continue;
    const st::TensorInfo* x = iv.find(t.name);
    if (!x) fail(where + ": tensor '" + t.name + "' is neither in " + input_shard.string() + " nor a quantized module of it");
    if (replaced.count(t.name))
      fail(where + ": tensor '" + t.name + "' is both copied and quantized (a conversion writes one or the other)");
    if (x->dtype != t.dtype || x->shape != t.shape)
      fail(where + ": tensor '" + t.name + "' has dtype " + t.dtype + " and another shape or dtype than in " +
           input_shard.string() + " (" + x->dtype + ")");
  }
  for (const st::TensorInfo& x : iv.tensors())
    if (!v.find(x.name) && !replaced.count(x.name))
      fail(where + ": tensor '" + x.name + "' of " + input_shard.string() + " is missing");
  return found;
}

}  // namespace mxq::cli
