// `mxq inspect FILE|DIR`: the tensors of a safetensors file (or of every shard of a checkpoint
// directory), their dtypes, shapes and sizes; with --against, the error of each tensor against the
// original checkpoint.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "compressed_tensors.hpp"
#include "convert.hpp"
#include "engine.hpp"
#include "error_sum.hpp"
#include "safetensors.hpp"

namespace fs = std::filesystem;

namespace mxq::cli {

namespace {
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
    fmt::print("{:<{}}  {:<8} {:<22} {:>12}\n", long_name ? "" : name, wname, t.dtype, st::shape_text(t.shape), t.bytes());
    total += t.bytes();
  }
  fmt::print("total {} ({} bytes)\n", human(double(total)), total);
  return total;
}
}  // namespace

// `mxq inspect FILE --against ORIGINAL`: the error of every tensor of FILE against ORIGINAL (a file or
// a checkpoint directory): quantized modules are dequantized first, plain floating tensors compared
// as they are (a fake-quantized copy).
int run_inspect_against(const std::string& file, const std::string& original, const std::string& device) {
  Engine eng(device);
  const st::File f(file);
  const st::View& v = f.view();
  const Checkpoint oc = open_checkpoint(original);
  std::map<std::string, std::string> where;  // tensor -> shard of the original
  std::map<std::string, std::unique_ptr<st::File>> open;
  for (const std::string& shard : oc.shards) {
    auto of = std::make_unique<st::File>((oc.dir / shard).string());
    for (const st::TensorInfo& t : of->view().tensors()) where[t.name] = shard;
    open[shard] = std::move(of);
  }
  auto original_f32 = [&](const std::string& name, std::int64_t numel) -> std::optional<std::vector<float>> {
    const auto it = where.find(name);
    if (it == where.end()) return std::nullopt;
    const st::View& ov = open[it->second]->view();
    const st::TensorInfo* t = ov.find(name);
    if (t->numel() != numel || (t->dtype != "BF16" && t->dtype != "F16" && t->dtype != "F32")) return std::nullopt;
    std::vector<float> x(numel);
    load_f32s(ov.data(*t).data(), src_type(t->dtype), numel, x.data());
    return x;
  };
  int not_finite = 0;
  auto report = [&](const std::string& name, const std::string& what, const std::vector<float>& x, const std::vector<float>& y) {
    ErrorSum err;
    double mx = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      err.add(x[i], y[i]);
      if (std::isfinite(x[i]) && std::isfinite(y[i])) mx = std::max(mx, std::fabs(double(y[i]) - x[i]));
    }
    if (!err.finite()) {  // never a perfect score from what is left after skipping NaN/Inf
      fmt::print("{:<60} {:<22} {:>9} {:>10} {:>12}  ({} non-finite in the original, {} more in this file)\n", printable(name), what,
                 "not finite", "not finite", "not finite", err.bad_in, err.bad_out);
      ++not_finite;
      return;
    }
    fmt::print("{:<60} {:<22} {:>9.2f} {:>10.5f} {:>12.4g}\n", printable(name), what, err.sqnr_db(), err.r == 0 ? 0.0 : std::sqrt(err.e / err.r), mx);
  };
  fmt::print("{:<60} {:<22} {:>9} {:>10} {:>12}\n", "tensor", "kind", "SQNR dB", "rel RMS", "max |err|");
  std::set<std::string> consumed;
  int compared = 0;
  // A rotated checkpoint's weights are compared after rotating them back.
  const Checkpoint fc = open_checkpoint(file);
  const CheckpointRotation rot = checkpoint_rotation(fc, read_config(fc, fs::path(file).parent_path().string()), file);
  for (const auto& [m, md] : quantized_modules(v, file)) {
    const std::int64_t N = md.N, K = md.K;
    std::vector<float> y(N * K);
    dequantize_module(eng, v, file, m, rot.rotates(m) && K % rot.size == 0 ? rot.undone(md) : md, DType::f32, y.data());
    consumed.insert(md.codes->name), consumed.insert(md.scale->name);
    if (md.global) consumed.insert(md.global->name);
    const auto x = original_f32(m + ".weight", N * K);
    if (!x) {
      fmt::print("{:<60} no matching {}.weight in {}\n", printable(m), printable(m), printable(original));
      continue;
    }
    report(m + ".weight", std::string(to_string(md.format)) + " (dequantized)", *x, y);
    ++compared;
  }
  for (const st::TensorInfo& t : v.tensors()) {
    if (consumed.count(t.name) || (t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F32")) continue;
    const auto x = original_f32(t.name, t.numel());
    if (!x) continue;
    std::vector<float> y(t.numel());
    load_f32s(v.data(t).data(), src_type(t.dtype), t.numel(), y.data());
    report(t.name, t.dtype, *x, y);
    ++compared;
  }
  fmt::print("{} tensors compared against {}\n", compared, original);
  if (not_finite) fmt::print("NOT FINITE: {} of them hold NaN or Inf values (their error statistics are not finite)\n", not_finite);
  return 0;
}

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
