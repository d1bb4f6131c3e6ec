#pragma once
// The conversion of `mxq quantize` and `mxq qdq`, shard by shard as the plan says: every tensor read
// from its memory-mapped shard, converted on the engine (the next one staged while the previous one
// converts), its error statistics taken, and its outputs written behind the conversion, in the order
// declared, by one writer thread (write_behind.hpp). Inputs are memory-mapped and processed tensor by
// tensor; at most a few writes wait behind the conversion, so memory stays bounded by the outputs of
// a few tensors.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_plan.hpp"
#include "checkpoint_publish.hpp"
#include "checkpoint_read.hpp"
#include "engine.hpp"

namespace mxq::cli {

// Wall seconds of a conversion's phases, for its last line (where the time goes, e.g. when the
// disk or the page cache decides it rather than the conversion).
struct Phases {
  using clock = std::chrono::steady_clock;
  double setup = 0, plan = 0, convert = 0, error = 0, write = 0;
  clock::time_point start = clock::now();
  void mark_setup() { setup = std::chrono::duration<double>(clock::now() - start).count(); }
  template <class F>
  void time(double& acc, F&& f) {
    const clock::time_point t0 = clock::now();
    f();
    acc += std::chrono::duration<double>(clock::now() - t0).count();
  }
  std::optional<Engine::Breakdown> gpu;  // the GPU engine's account of its conversion time
  std::string str() const;
};

// A progress bar on stderr when it is a terminal (tensors done, bytes read); nothing otherwise, where
// the per-tensor lines on stdout are the record.
class Progress {
 public:
  explicit Progress(std::size_t total);
  ~Progress();
  void step(const std::string& name, double bytes);
  void clear_line();

 private:
  std::size_t total_, done_ = 0;
  double bytes_ = 0;
  bool tty_, shown_ = false;
};

// The "device:" line, said once the engine's choice is settled.
class DeviceLine {
 public:
  explicit DeviceLine(Engine& eng) : eng_(eng) {}
  // wait: 0 not, 1 for the GPU's probe (a refused --device cuda fails there), 2 for the choice
  void say(int wait);
  bool said() const { return said_; }

 private:
  Engine& eng_;
  bool said_ = false;
};

long peak_rss_mib();

// The summary's warnings about NaN/Inf weights: on stdout after the summary, and one line on stderr.
void report_not_finite(const std::vector<std::string>& lines);

// NVFP4: the tensor amax of every weight the plan quantizes, by module, as the library defines it
// (NaN if any element is NaN, +Inf if any is infinite), on the CPU from the mapped shards; with a
// rotation, the amax of the rotated weight (the values quantized).
std::map<std::string, float> weight_amaxes(const Checkpoint& c, const QuantizePlan& plan, std::pair<Rotation, int> rotation,
                                           std::uint64_t rotation_seed);

// How every quantized tensor is converted.
struct ConvertSpec {
  Format format = Format::mxfp4;
  ScaleRule rule = ScaleRule::even;
  bool fake = false;  // qdq: the weights replaced by their fake-quantized values, same name, dtype and shape
  std::pair<Rotation, int> rotation{Rotation::none, 0};
  std::uint64_t rotation_seed = 0;
  std::string label;  // what the tensor lines say it became: "nvfp4", "mxfp4 had32", "qdq mxfp4"
  Part part;          // only the shards of this part (n == 0: every shard)
};

struct Converted {
  nlohmann::json weight_map = nlohmann::json::object();  // output tensor -> shard
  std::int64_t n_quant = 0, n_copy = 0;
  double bytes_in = 0, bytes_out = 0;
  std::vector<std::string> not_finite;  // the summary's warnings: tensors with NaN/Inf, global scales they forced
};

// Converts the checkpoint's shards (the part's) into out as the plan says: every tensor's line on
// stdout, every shard written and synced when it returns. NVFP4 takes each module's global scale from
// scales (global_scale_amax). The GPU's account of the time goes into ph.gpu, and the device line
// is said by the end.
Converted convert_checkpoint(Engine& eng, const Checkpoint& c, const std::filesystem::path& out, const QuantizePlan& plan,
                             const std::map<std::string, ScaleAmax>& scales, const ConvertSpec& spec, Phases& ph,
                             Progress& progress, DeviceLine& device);

}  // namespace mxq::cli
