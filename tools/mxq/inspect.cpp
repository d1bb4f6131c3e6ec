// `mxq inspect FILE|DIR`: the tensors of a safetensors file (or of every shard of a checkpoint
// directory), their dtypes, shapes and sizes.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "safetensors.hpp"

namespace mxq::cli {

namespace {
std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
std::string human(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (b >= 1024 && i < 4) b /= 1024, ++i;
  return fmt::format("{:.1f} {}", b, u[i]);
}
}  // namespace

namespace {
// One file's table; returns its tensor bytes.
std::uint64_t inspect_file(const std::string& file) {
  const st::File f(file);
  const st::View& v = f.view();
  std::uint64_t total = 0;
  // The name column fits the longest name up to kMaxNameColumn; a longer name gets a line of its own
  // above its row (padding every row to one 1000-byte name printed 20 GB for a 1.6 MB file).
  constexpr std::size_t kMaxNameColumn = 80;
  std::size_t wname = 6;
  // Names and metadata are the file's bytes: printed with control and direction characters escaped.
  for (const st::TensorInfo& t : v.tensors()) wname = std::max(wname, std::min(printable(t.name).size(), kMaxNameColumn));
  fmt::print("{}: {} tensors, header {} bytes\n", printable(file), v.tensors().size(), v.header_bytes());
  for (const auto& [k, val] : v.metadata()) fmt::print("  metadata {} = {}\n", printable(k), printable(val));
  fmt::print("{:<{}}  {:<8} {:<22} {:>12}\n", "tensor", wname, "dtype", "shape", "bytes");
  for (const st::TensorInfo& t : v.tensors()) {
    const std::string name = printable(t.name);
    const bool long_name = name.size() > wname;
    if (long_name) fmt::print("{}\n", name);
    fmt::print("{:<{}}  {:<8} {:<22} {:>12}\n", long_name ? "" : name, wname, t.dtype, shape_str(t.shape), t.bytes());
    total += t.bytes();
  }
  fmt::print("total {} ({} bytes)\n", human(double(total)), total);
  return total;
}
}  // namespace

int run_inspect(const InspectArgs& args) {
  // A directory is read as quantize reads it (its index, or model.safetensors), every shard in turn.
  if (std::filesystem::is_directory(args.file)) {
    const Checkpoint c = open_checkpoint(args.file);
    fmt::print("{}: checkpoint of {} shard(s){}\n", args.file, c.shards.size(),
               c.index ? " (model.safetensors.index.json)" : "");
    std::uint64_t total = 0;
    for (const std::string& shard : c.shards) {
      const std::string path = (c.dir / shard).string();
      if (!args.against.empty()) {
        const int rc = run_inspect_against(path, args.against, args.device);
        if (rc) return rc;
      } else {
        total += inspect_file(path);
      }
    }
    if (args.against.empty() && c.shards.size() > 1)
      fmt::print("checkpoint total {} ({} bytes) in {} shards\n", human(double(total)), total, c.shards.size());
    return 0;
  }
  if (!args.against.empty()) return run_inspect_against(args.file, args.against, args.device);
  inspect_file(args.file);
  return 0;
}

}  // namespace mxq::cli
