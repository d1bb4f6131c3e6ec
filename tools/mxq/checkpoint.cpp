// `mxq quantize` and `mxq dequantize`: safetensors checkpoints (one file, or a Hugging Face directory
// with model.safetensors.index.json) to and from the compressed-tensors layout vLLM loads
// (docs/cli.md lists what is written). Inputs are memory-mapped and processed tensor by tensor:
// peak memory is about one tensor, its fp32 copy and its outputs. Every output file is written to a
// temporary name and renamed into place, so a failure leaves no partial checkpoint file.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <mxq/mxq.hpp>

#include <mxq/version.hpp>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "convert.hpp"
#include "engine.hpp"
#include "error_sum.hpp"
#include "fusion.hpp"
#include "safetensors.hpp"
#include "staging.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

DType mxq_dtype(const std::string& dt) { return dt == "F32" ? DType::f32 : dt == "F16" ? DType::f16 : DType::bf16; }

// A quantized module of a compressed-tensors file: X.weight_scale beside X.weight_packed (FP4; NVFP4
// when X.weight_global_scale is there too) or beside an F8_E4M3 X.weight (MXFP8).
struct QuantizedModule {
  Format format;
  const st::TensorInfo *codes, *scale, *global;  // global: NVFP4 only
  std::int64_t N, K;                             // the weight's shape
  QuantOptions options;                          // what dequantizes it (NVFP4: with its tensor scale)
};

// The quantized modules of one file, by name. A scale without its codes, a global scale that is not
// one F32, or shapes that do not fit together fail with one line naming the tensor.
std::map<std::string, QuantizedModule> quantized_modules(const st::View& v, const std::string& path) {
  std::map<std::string, QuantizedModule> mods;
  for (const st::TensorInfo& t : v.tensors()) {
    if (!t.name.ends_with(".weight_scale")) continue;
    const std::string m = t.name.substr(0, t.name.size() - 13);
    const st::TensorInfo* packed = v.find(m + ".weight_packed");
    const st::TensorInfo* w8 = v.find(m + ".weight");
    const st::TensorInfo* gs = v.find(m + ".weight_global_scale");
    QuantizedModule md{};
    if (packed) md = {gs ? Format::nvfp4 : Format::mxfp4, packed, &t, gs, 0, 0, {}};
    else if (w8 && w8->dtype == "F8_E4M3") md = {Format::mxfp8_e4m3, w8, &t, nullptr, 0, 0, {}};
    else fail(path + ": tensor '" + t.name + "' has no X.weight_packed or F8_E4M3 X.weight beside it in this file");
    if (md.codes->shape.size() != 2 || t.shape.size() != 2)
      fail(path + ": tensor '" + md.codes->name + "': expected 2-D codes and scales");
    // The dtypes compressed-tensors writes, so that no bytes are reinterpreted (an F32 "packed" tensor
    // is not codes): FP4 codes U8; scales U8 (E8M0) or F8_E4M3 (NVFP4); the global scale one F32.
    const auto expect_dtype = [&](const st::TensorInfo& x, const char* dt, const char* what) {
      if (x.dtype != dt)
        fail(path + ": tensor '" + x.name + "': dtype " + x.dtype + ", expected " + dt + " (" + what + " of " +
             std::string(to_string(md.format)) + ")");
    };
    if (md.format != Format::mxfp8_e4m3) expect_dtype(*md.codes, "U8", "packed E2M1 codes");
    expect_dtype(t, md.format == Format::nvfp4 ? "F8_E4M3" : "U8",
                 md.format == Format::nvfp4 ? "E4M3 block scales" : "E8M0 block scales");
    if (gs) expect_dtype(*gs, "F32", "the global encode scale");
    md.N = md.codes->shape[0];
    md.K = md.format == Format::mxfp8_e4m3 ? md.codes->shape[1] : 2 * md.codes->shape[1];
    md.options = md.format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(md.format, ScaleRule::even);
    if (gs) {
      if (gs->bytes() != 4) fail(path + ": tensor '" + gs->name + "': expected one F32");
      float S;
      std::memcpy(&S, v.data(*gs).data(), 4);
      md.options.tensor_scale = S;
    }
    const Shape2 ss = scale_shape(md.options, md.N, md.K);
    if (t.shape[0] != ss.rows || t.shape[1] != ss.cols)
      fail(path + ": tensor '" + t.name + "': shape does not match codes of [" + std::to_string(md.N) + ", " +
           std::to_string(md.K) + "]");
    mods[m] = md;
  }
  return mods;
}

// Dequantizes one module into y ([N, K] of dtype odt), reading codes and scales in place (bytes need
// no alignment).
void dequantize_module(Engine& eng, const st::View& v, const std::string& path, const std::string& name,
                       const QuantizedModule& m, DType odt, void* y) {
  const Shape2 ss = scale_shape(m.options, m.N, m.K);
  try {
    eng.dequantize(QuantizedIn{Tensor::of(const_cast<std::uint8_t*>(v.data(*m.codes).data()), DType::u8, m.N, code_cols(m.format, m.K)),
                           Tensor::of(const_cast<std::uint8_t*>(v.data(*m.scale).data()), DType::u8, ss.rows, ss.cols)},
               Tensor::of(y, odt, m.N, m.K), m.options);
  } catch (const std::exception& e) {
    fail(path + ": module '" + name + "': " + e.what());
  }
}

// o with rotation r of size n (seed: random_hadamard's signs).
QuantOptions with_rotation(QuantOptions o, Rotation r, int n, std::uint64_t seed = 0) {
  o.rotation = r;
  o.rotation_size = n;
  o.rotation_seed = seed;
  return o;
}

// The rotation a quantized checkpoint's weights carry: compressed-tensors' transform_config as `mxq
// quantize --rotate` writes it (one hadamard scheme, online input + weight_input, exact names in
// ignore), found in config.json or, beside a lone file, in quantization_config.json. size 0: none.
// Anything else that rotates weights is refused: mxq could not undo it.
struct CheckpointRotation {
  int size = 0;
  std::string scheme;
  std::set<std::string> ignore;  // modules whose weights are not rotated
  bool rotates(const std::string& module) const { return size && !ignore.count(module); }
  // A module's decoding options with the rotation undone by its dequantize.
  QuantizedModule undone(QuantizedModule md) const {
    md.options = with_rotation(md.options, Rotation::hadamard, size);
    return md;
  }
  // The matrix tensors of the scheme (not weights): <module>.<scheme>_input.weight and the like.
  bool is_matrix(const std::string& name) const {
    return size && (name.ends_with("." + scheme + "_input.weight") || name.ends_with("." + scheme + "_output.weight") ||
                    name.ends_with("." + scheme + "_input.perm"));
  }
};
CheckpointRotation checkpoint_rotation(const Checkpoint& c, const std::optional<json>& config, const std::string& in) {
  CheckpointRotation r;
  json qc;
  std::string where;
  if (config && config->contains("quantization_config")) {
    qc = (*config)["quantization_config"], where = (c.dir / "config.json").string();
  } else if (!fs::is_directory(in) && fs::exists(c.dir / "quantization_config.json")) {
    qc = read_json_file(c.dir / "quantization_config.json"), where = (c.dir / "quantization_config.json").string();
  }
  if (!qc.is_object() || !qc.contains("transform_config") || !qc["transform_config"].is_object()) return r;
  const json& tc = qc["transform_config"];
  if (!tc.contains("config_groups") || !tc["config_groups"].is_object() || tc["config_groups"].empty()) return r;
  auto refuse = [&](const std::string& why) {
    fail(where + ": transform_config: " + why + "; mxq undoes only the hadamard transform `mxq quantize --rotate` writes "
         "(docs/cli.md)");
  };
  if (tc["config_groups"].size() != 1) refuse("more than one transform scheme");
  const auto first = tc["config_groups"].begin();  // an iterator kept alive (items()' proxy was a temporary)
  const std::string scheme = first.key();
  const json& g = first.value();
  if (!g.is_object() || g.value("type", std::string()) != "hadamard") refuse("scheme '" + scheme + "' is not of type hadamard");
  if (g.value("randomize", false)) refuse("scheme '" + scheme + "' is randomized");
  const json hd = g.value("head_dim", json());
  const auto valid_size = [](int n) { return n >= 16 && n <= 256 && (n & (n - 1)) == 0; };
  if (!hd.is_number_integer() || !valid_size(hd.get<int>()))
    refuse("scheme '" + scheme + "': head_dim " + hd.dump() + " (mxq rotates blocks of 16, 32, 64, 128 or 256)");
  bool weight_input = false;
  for (const json& ap : g.value("apply", json::array())) {
    const std::string loc = ap.value("location", std::string());
    if (loc != "input" && loc != "weight_input") refuse("scheme '" + scheme + "' applies at '" + loc + "'");
    if (ap.value("targets", json()) != json::array({"Linear"})) refuse("scheme '" + scheme + "' targets other than [\"Linear\"]");
    for (const json& i : ap.value("ignore", json::array())) {
      if (!i.is_string() || i.get<std::string>().starts_with("re:")) refuse("an ignore entry that is not a module name");
      if (loc == "weight_input") r.ignore.insert(i.get<std::string>());
    }
    weight_input |= loc == "weight_input";
  }
  if (!weight_input) return r;  // nothing fused into the weights: they are the model's own
  r.size = hd.get<int>();
  r.scheme = scheme;
  return r;
}

// Modules vLLM expects unquantized (docs/cli.md): the LM head, embeddings, MoE routers,
// vision towers. Plain string comparisons, no std::regex: names come from the file.
bool default_ignored(const std::string& module) {
  const auto has = [&](const char* s) { return module.find(s) != std::string::npos; };
  return module == "lm_head" || module.ends_with(".lm_head") || has("embed") || module.ends_with(".mlp.gate") ||
         has("router") || module.ends_with("shared_expert_gate") || has("visual") || has("vision");
}

// A --include/--exclude pattern (ECMAScript). libstdc++ matches it with its polynomial executor:
// memory and stack bounded by the pattern, time by the pattern times the name, whatever the name
// (the default executor backtracks, recursing per character: a long name overflows the stack).
std::regex user_pattern(const std::string& flag, const std::string& s) {
  try {
#ifdef __GLIBCXX__
    return std::regex(s, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
    return std::regex(s, std::regex::ECMAScript);
#endif
  } catch (const std::regex_error& e) {
    fail(flag + " '" + s + "': not a usable regular expression (back-references are not supported): " + e.what());
  }
}

// The tensor amax of a 2-D floating weight as the library defines it (NaN if any element is NaN, +Inf
// if any is infinite, wherever it sits), on the CPU: the planning pass reads the mapped file.
// rot: the rotation quantize applies (none: the plain amax), so that NVFP4's global scale is that of
// the values quantized.
float weight_amax(const st::View& v, const st::TensorInfo& t, std::pair<Rotation, int> rot = {Rotation::none, 0},
                  std::uint64_t rot_seed = 0) {
  const auto d = v.data(t);
  const int es = st::find_dtype(t.dtype)->bytes;
  std::vector<std::uint8_t> copy;
  const std::uint8_t* p = d.data();
  if (reinterpret_cast<std::uintptr_t>(p) % std::uintptr_t(es) != 0) {  // a misaligned offset in the file
    copy.assign(d.begin(), d.end());
    p = copy.data();
  }
  const Tensor x = Tensor::of(p, mxq_dtype(t.dtype), t.shape[0], t.shape[1]);
  if (rot.first == Rotation::none) return tensor_amax(x, Backend::cpu);
  QuantOptions o = with_rotation(QuantOptions::nvfp4(), rot.first, rot.second, rot_seed);
  o.backend = Backend::cpu;
  return tensor_amax(x, o);
}

// The amax of a fused group as tensor_amax would give it over the members' weights side by side: NaN
// if any member's is NaN, else the largest (+Inf included).
float group_amax_of(float a, float b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }

// Non-finite values of a [N, K] weight and the blocks of g along its rows that hold them.
struct NonFinite {
  std::int64_t values = 0, blocks = 0;
};
NonFinite count_nonfinite(const std::uint8_t* x, const std::string& dtype, std::int64_t N, std::int64_t K, int g) {
  NonFinite r;
  const int es = st::find_dtype(dtype)->bytes;
  const SrcType xt = src_type(dtype);
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t j0 = 0; j0 < K; j0 += g) {
      std::int64_t bad = 0;
      for (std::int64_t j = j0; j < std::min<std::int64_t>(K, j0 + g); ++j) bad += !std::isfinite(load_f32(x + (i * K + j) * es, xt));
      r.values += bad;
      r.blocks += bad != 0;
    }
  return r;
}

// A conversion's output bytes: allocated without being zeroed first (the conversion writes every
// byte; a zeroing pass would fault every page in on the main thread).
template <class T>
struct NoInit : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = NoInit<U>;
  };
  NoInit() = default;
  template <class U>
  NoInit(const NoInit<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using Bytes = std::vector<std::uint8_t, NoInit<std::uint8_t>>;

// Output buffers recycled from tensor to tensor: a buffer goes back to the pool when its last owner
// (the write task) drops it, and the next output of at most its capacity takes it again, its pages
// already faulted in (fresh allocations of this size are new mappings, faulted page by page). At
// most kKeep wait in the pool; the pool's state outlives the pool in the owners still holding one.
class BytesPool {
 public:
  std::shared_ptr<Bytes> get(std::size_t n) {
    std::unique_ptr<Bytes> b;
    {
      std::lock_guard<std::mutex> l(st_->m);
      auto& free = st_->free;
      auto best = free.end();
      for (auto it = free.begin(); it != free.end(); ++it)
        if ((*it)->capacity() >= n && (best == free.end() || (*it)->capacity() < (*best)->capacity())) best = it;
      if (best != free.end()) {
        b = std::move(*best);
        free.erase(best);
      }
    }
    if (!b) b = std::make_unique<Bytes>();
    b->resize(n);  // no zeroing (NoInit)
    return std::shared_ptr<Bytes>(b.release(), [st = st_](Bytes* p) {
      std::unique_ptr<Bytes> owned(p);
      std::lock_guard<std::mutex> l(st->m);
      if (st->free.size() < kKeep) st->free.push_back(std::move(owned));
    });
  }

 private:
  static constexpr std::size_t kKeep = 12;
  struct State {
    std::mutex m;
    std::vector<std::unique_ptr<Bytes>> free;
  };
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

// Writes behind the conversion: tasks (a tensor's write, a shard's commit) run in order on one
// thread while the next tensors convert; at most kDepth wait, so memory stays bounded by the outputs
// of a few tensors. The first failure is rethrown by the next submit() or by drain(), and the tasks
// after it are skipped. The destructor drops what has not started and waits for the thread: on an
// exception nothing is written after it, and the staging directory (destroyed later) goes last.
class WriteBehind {
 public:
  WriteBehind() : thread_([this] { run(); }) {}
  ~WriteBehind() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
      tasks_.clear();
    }
    wake_.notify_all();
    thread_.join();
  }
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;
  void submit(std::function<void()> task) {
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [&] { return tasks_.size() < kDepth || error_; });
    if (error_) std::rethrow_exception(error_);
    tasks_.push_back(std::move(task));
    wake_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [&] { return (tasks_.empty() && !busy_) || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr std::size_t kDepth = 4;
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || !tasks_.empty(); });
        if (stop_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        busy_ = true;
      }
      std::exception_ptr e;
      try {
        task();
      } catch (...) {
        e = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> l(m_);
        busy_ = false;
        if (e && !error_) error_ = e;
        if (error_) tasks_.clear();
      }
      done_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::deque<std::function<void()>> tasks_;
  std::exception_ptr error_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // last: started once the rest is initialised
};

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
  std::string str() const {
    const double all = std::chrono::duration<double>(clock::now() - start).count();
    const std::string conv =
        gpu ? fmt::format(" (staging {:.2f} s, buffers {:.2f} s, waiting for the GPU {:.2f} s, results {:.2f} s)", gpu->staging,
                          gpu->buffers, gpu->waiting, gpu->results)
            : std::string();
    return fmt::format("time: {:.2f} s in all; setup {:.2f} s, planning {:.2f} s, conversion {:.2f} s{}, error statistics "
                       "{:.2f} s, writing {:.2f} s, the rest (reading, page faults) {:.2f} s",
                       all, setup, plan, convert, conv, error, write, all - setup - plan - convert - error - write);
  }
};

long peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

// Weights in another format (PyTorch pickles, TensorFlow, Flax, GGUF) are not the converted model:
// copied beside its shards they would be loaded instead of them, or unpickled (running code).
bool other_weight_format(const std::string& n) {
  for (const char* ext : {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".gguf", ".bin.index.json"})
    if (n.ends_with(ext)) return true;
  return false;
}

// The other regular files of IN's directory (tokenizer, generation config...), copied into OUT;
// weights in other formats are skipped, each named on stderr.
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

// The summary's warnings about NaN/Inf weights: on stdout after the summary, and one line on stderr.
void report_not_finite(const std::vector<std::string>& lines) {
  if (lines.empty()) return;
  for (const std::string& l : lines) fmt::print("NOT FINITE: {}\n", l);
  std::fflush(stdout);
  fmt::print(stderr, "mxq: warning: the input holds NaN or Inf weights: {} NOT FINITE line(s) in the summary\n", lines.size());
}

// Writes text to path through a temporary name: every write checked after it reached the disk
// (fflush, fsync, fclose), the temporary removed on failure, so a full disk never leaves an empty
// or partial file under the final name.
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

// A progress bar on stderr when it is a terminal (tensors done, bytes read); nothing otherwise, where
// the per-tensor lines on stdout are the record.
class Progress {
 public:
  explicit Progress(std::size_t total) : total_(total), tty_(::isatty(2) != 0) {}
  ~Progress() {
    if (tty_ && shown_) std::fprintf(stderr, "\n");
  }
  void step(const std::string& name, double bytes) {
    ++done_;
    bytes_ += bytes;
    if (!tty_) return;
    constexpr int kWidth = 30;
    const int fill = total_ ? int(kWidth * done_ / total_) : kWidth;
    std::fprintf(stderr, "\r[%.*s%*s] %zu/%zu tensors, %.1f MiB  %-40.40s", fill, "##############################",
                 kWidth - fill, "", done_, total_, bytes_ / 1048576, name.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void clear_line() {
    if (tty_ && shown_) std::fprintf(stderr, "\r%*s\r", 110, "");
  }

 private:
  std::size_t total_, done_ = 0;
  double bytes_ = 0;
  bool tty_, shown_ = false;
};

// ---- parts: --part I/N and mxq merge ---------------------------------------------------------------
struct Part {
  int i = 0, n = 0;  // 1 <= i <= n; n == 0: the whole checkpoint
};

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

// A directory as an absolute, normal path without a trailing separator: "." relative to /cwd and
// /cwd itself give the same string (a lone file named without a directory has the directory ".").
std::string normal_dir(const fs::path& d) {
  fs::path p = fs::absolute(d).lexically_normal();
  if (!p.has_filename() && p != p.root_path()) p = p.parent_path();
  return p.string();
}

// OUT as an absolute, normal path without a trailing separator; "." or ".." as its last component is
// refused (the parts are OUT's siblings: OUT must name a directory of its own).
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

// What identifies an input shard for merge: its size and modification time.
json shard_fingerprints(const Checkpoint& c) {
  json f = json::object();
  for (const std::string& sh : c.shards)
    f[sh] = {{"bytes", std::uint64_t(fs::file_size(c.dir / sh))},
             {"mtime", std::int64_t(fs::last_write_time(c.dir / sh).time_since_epoch().count())}};
  return f;
}

constexpr const char* kManifest = "mxq-part.json";

// What a conversion writes besides its shards: the index (sharded inputs), the config (or the lone
// file's quantization_config.json), and the input's side files (tokenizer, ...).
struct Finish {
  std::optional<json> index;
  std::optional<std::string> config_name, config_text;
  bool side_files = false;
};

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

// A part's end: its shards and a manifest (what merge needs to write the rest, and to check that
// every part came from the same input and options), published as OUT.part-I-of-N.
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

}  // namespace

// The name of mxq's transform scheme in compressed-tensors' transform_config (and of its matrix tensor,
// <module>.mxq_input.weight).
constexpr const char* kRotationScheme = "mxq";

int run_quantize(const QuantizeArgs& a) {
  Phases ph;  // from here: the GPU's context, the checkpoint's headers and the output's set-up are "setup"
  Format format;
  ScaleRule rule;
  std::string ct_format;
  // The default MX rule is compressed-tensors' (docs/numerics.md, presets::compressed_tensors_mx):
  // even_fp4, which equals even for MXFP4; qdq of the same format uses it too, so that a fake-quantized
  // copy decodes to what the checkpoint decodes to.
  if (a.fake) {  // QDQ: every format and rule of the library
    format = parse_format(a.format == "mxfp8" ? "mxfp8_e4m3" : a.format);
    rule = format == Format::nvfp4        ? ScaleRule::nvfp4
           : format == Format::mxfp8_e4m3 ? ScaleRule::even_fp4
                                          : ScaleRule::even;
  } else if (a.format == "mxfp4") format = Format::mxfp4, rule = ScaleRule::even, ct_format = "mxfp4-pack-quantized";
  else if (a.format == "mxfp8" || a.format == "mxfp8_e4m3")
    format = Format::mxfp8_e4m3, rule = presets::compressed_tensors_mx(Format::mxfp8_e4m3).rule, ct_format = "mxfp8-quantized";
  else if (a.format == "nvfp4") format = Format::nvfp4, rule = ScaleRule::nvfp4, ct_format = "nvfp4-pack-quantized";
  else fail("--format '" + a.format + "': the checkpoint layouts vLLM loads are mxfp4, mxfp8 and nvfp4");
  if (!a.rule.empty()) {
    if (format == Format::nvfp4)
      fail("--rule: the tool's nvfp4 takes the NVFP4 recipe only (E4M3 block scales under the tensor scale); NVFP4 "
           "rule quest is in the library and the Python package");
    rule = parse_rule(a.rule);
    if (rule == ScaleRule::nvfp4 || (!a.fake && (rule == ScaleRule::quest || rule == ScaleRule::qutlass_absmax)))
      fail("--rule '" + a.rule + "': a checkpoint takes floor, ceil, even, rceil or even_fp4");
  }
  const int g = format == Format::nvfp4 ? 16 : 32;
  std::vector<std::regex> inc, exc;
  for (const std::string& s : a.include) inc.push_back(user_pattern("--include", s));
  for (const std::string& s : a.exclude) exc.push_back(user_pattern("--exclude", s));

  if (a.gpus < 0) fail("--gpus " + std::to_string(a.gpus) + ": expected 0 (every visible GPU) or more");
  const Part part = parse_part(a.part);
  const fs::path out_dir = part.n ? part_dir(fs::path(a.out), part) : fs::path(a.out);
  std::pair<Rotation, int> rot{Rotation::none, 0};
  if (a.rotate_seed && a.rotate.empty())
    fail("--rotate-seed " + std::to_string(*a.rotate_seed) + ": without --rotate rhad<RS> there are no random signs to seed");
  if (!a.rotate.empty()) {
    try {
      rot = parse_rotation(a.rotate);
    } catch (const std::exception& e) {
      fail(std::string("--rotate: ") + e.what());
    }
    if (rot.first == Rotation::none) fail("--rotate none: leave --rotate out for no rotation");
    if (a.rotate_seed && rot.first != Rotation::random_hadamard)
      fail("--rotate-seed " + std::to_string(*a.rotate_seed) + ": --rotate " + a.rotate +
           " has no random signs to seed (only rhad<RS> does)");
    // A rotated checkpoint is read through compressed-tensors' transform_config (docs/cli.md): only
    // what vLLM applies online is written.
    if (!a.fake && rot.first == Rotation::random_hadamard)
      fail("--rotate " + a.rotate + ": `mxq quantize` writes the deterministic Hadamard only (had<RS>): vLLM ignores "
           "compressed-tensors' `randomize` and its random-hadamard matrices are not mxq's random signs");
  }

  // A GPU is set up on a thread of its own while the checkpoint is opened and planned (and, with
  // cpu_while_gpu_sets_up, the first tensors convert on the CPU meanwhile): the device line comes
  // once the choice is settled.
  Engine eng(a.device, a.cpu_while_gpu_sets_up, a.gpus);
  bool device_said = false;
  // wait: 0 not, 1 for the GPU's probe (a refused --device cuda fails there), 2 for the choice
  auto say_device = [&](int wait) {
    if (device_said || !(wait == 2 || eng.settled(wait == 1))) return;
    device_said = true;
    fmt::print("device: {} ({})\n", eng.name(), eng.why());
  };
  const Checkpoint c = open_checkpoint(a.in);
  std::optional<json> config = read_config(c, a.in);
  check_output(fs::path(a.in), out_dir, a.overwrite);
  Staging stage{out_dir, a.overwrite};
  const fs::path& out = stage.dir();
  say_device(0);
  const LoaderFusion fusion = loader_fusion(config);
  if (!a.fake) {
    fmt::print("fused projections: {} ({})\n", fusion.family, fusion.source);
    // NOTE: NVFP4 only: there a wrong guess costs accuracy silently; for MX formats it only decides
    // which members an --exclude drags along, and a loader refuses what it cannot load.
    if (!fusion.known && format == Format::nvfp4)
      fmt::print(stderr, "mxq: warning: {}: the loader's fused projections are not known to mxq (docs/cli.md, \"Fused "
                 "projections\"); assuming the common names q/k/v_proj, gate/up_proj and w1/w3. A loader that fuses other "
                 "modules decodes them with another member's NVFP4 global scale\n", fusion.source);
  }

  ph.mark_setup();
  const Phases::clock::time_point plan_t0 = Phases::clock::now();
  // Plan: which tensors are quantized, and (NVFP4) the tensor amax of each, for the shared scales.
  struct Plan {
    bool quantize = false;
    std::string why;  // why not
  };
  std::map<std::string, Plan> plan;
  std::vector<std::string> ignored_modules, unfit;
  std::map<std::string, float> amax;  // NVFP4: per module
  std::map<std::string, std::size_t> shard_tensors;
  Engine::Sizes largest;  // of the conversions to come: the GPU engine's buffers, sized once
  for (const std::string& shard : c.shards) {
    const st::File f((c.dir / shard).string());
    for (const st::TensorInfo& t : f.view().tensors()) {
      ++shard_tensors[shard];
      Plan p;
      const bool is_weight = t.name.ends_with(".weight");
      const std::string module = is_weight ? t.name.substr(0, t.name.size() - 7) : t.name;
      const bool floating = t.dtype == "BF16" || t.dtype == "F16" || t.dtype == "F32";
      if (!is_weight || t.shape.size() != 2 || !floating) {
        p.why = "not a 2-D floating weight";
      } else if (default_ignored(module)) {
        p.why = "left unquantized for vLLM (head, embedding, router, vision)";
        ignored_modules.push_back(module);
      } else if (stored_transposed(fusion, module)) {
        p.why = "a Conv1D weight stored transposed ([K, N]) in this model family, not a Linear weight";
        ignored_modules.push_back(module);
        unfit.push_back(t.name + " (" + p.why + ")");
      } else if (!inc.empty() && std::none_of(inc.begin(), inc.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
        p.why = "not matched by --include";
        ignored_modules.push_back(module);
      } else if (std::any_of(exc.begin(), exc.end(), [&](const std::regex& r) { return std::regex_search(t.name, r); })) {
        p.why = "matched by --exclude";
        ignored_modules.push_back(module);
      } else if (!a.fake && module.size() + std::strlen(".weight_global_scale") > st::kMaxNameBytes) {
        // its quantized tensors' names would be longer than a reader accepts
        p.why = fmt::format("name too long for its quantized tensors (limit {} bytes)", st::kMaxNameBytes);
        ignored_modules.push_back(module);
        unfit.push_back(t.name);
      } else if (rot.second && t.shape[1] % rot.second != 0) {
        p.why = fmt::format("K = {} is not a multiple of the rotation size {}", t.shape[1], rot.second);
        ignored_modules.push_back(module);
        unfit.push_back(t.name);
      } else if (t.shape[0] == 0 || t.shape[1] == 0) {
        // Nothing to quantize, and a Linear module without rows or columns has no scales to load:
        // copied as it is and listed, quantize leaves it in the config's ignore list.
        p.why = fmt::format("empty weight [{}, {}]", t.shape[0], t.shape[1]);
        ignored_modules.push_back(module);
        unfit.push_back(t.name);
      } else if (!a.fake && t.shape[1] % g != 0) {
        p.why = fmt::format("K = {} is not a multiple of {} (vLLM could not load it)", t.shape[1], g);
        ignored_modules.push_back(module);
        unfit.push_back(t.name);
      } else {
        p.quantize = true;
        const std::int64_t N = t.shape[0], K = t.shape[1];
        const std::size_t xb = std::size_t(N * K * st::find_dtype(t.dtype)->bytes);
        largest.x = std::max(largest.x, xb);
        largest.y = std::max(largest.y, a.fake ? xb : std::size_t(N * code_cols(format, K)));
        largest.scales = std::max(largest.scales, std::size_t(N * ((K + g - 1) / g)));
        largest.elems = std::max(largest.elems, std::size_t(N * K));
      }
      plan[shard + "/" + t.name] = p;
    }
  }
  eng.expect(largest);  // (on the GPU's set-up thread, while the amax pass runs)
  if (format == Format::nvfp4)  // the tensor amax of each quantized weight, for the global scales
    for (const std::string& shard : c.shards) {
      const st::File f((c.dir / shard).string());
      for (const st::TensorInfo& t : f.view().tensors())
        if (plan[shard + "/" + t.name].quantize) {
          check_interrupted();
          amax[t.name.substr(0, t.name.size() - 7)] = weight_amax(f.view(), t, rot, a.rotate_seed.value_or(0));
          f.release(t);
        }
    }
  // A fused parameter holds one precision (vLLM refuses a layer with some shards quantized and
  // others not): a member left unquantized (--exclude, --include, a name too long) leaves the whole
  // group unquantized, each member saying why.
  std::map<std::string, std::string> group_unquantized;  // group -> the member that is not quantized
  for (const auto& [key, p] : plan) {
    if (a.fake) break;  // a fake-quantized copy loads as the original model: no fused precision to keep
    const std::string name = key.substr(key.find('/') + 1);
    if (p.quantize || !name.ends_with(".weight")) continue;
    const std::string gk = fused_group(fusion, name.substr(0, name.size() - 7));
    if (!gk.empty() && !group_unquantized.count(gk)) group_unquantized[gk] = name;
  }
  for (auto& [key, p] : plan) {
    const std::string name = key.substr(key.find('/') + 1);
    if (!p.quantize) continue;
    const std::string module = name.substr(0, name.size() - 7);
    const auto it = group_unquantized.find(fused_group(fusion, module));
    if (it == group_unquantized.end()) continue;
    p.quantize = false;
    p.why = "fused into " + it->first + " with " + it->second + ", which is left unquantized";
    ignored_modules.push_back(module);
    unfit.push_back(name + " (fused into " + it->first + " with " + it->second + ", which is left unquantized)");
    amax.erase(module);
  }
  // quantize --rotate: every quantized Linear is rotated (its input, online, by the loader; its weight
  // here). Refused where vLLM would not rotate the input: MoE experts, Linear layers with a bias. The
  // transform's +-1 matrix is stored once, beside the first rotated module (as compressed-tensors'
  // save_pretrained does).
  std::string rot_shard, rot_module;
  if (rot.first != Rotation::none && !a.fake) {
    std::set<std::string> names;
    for (const auto& [key, p] : plan) names.insert(key.substr(key.find('/') + 1));
    for (const auto& [key, p] : plan) {
      if (!p.quantize) continue;
      const std::string name = key.substr(key.find('/') + 1), module = name.substr(0, name.size() - 7);
      if (module.find(".experts.") != std::string::npos)
        fail("--rotate: " + name + " is an MoE expert weight; vLLM applies no online rotation to MoE experts, so a rotated "
             "expert would compute the wrong product there: --exclude the experts (e.g. --exclude '\\.experts\\.') or "
             "drop --rotate");
      if (names.count(module + ".bias"))
        fail("--rotate: " + module + " has a bias; vLLM applies online rotations only to Linear layers without one: "
             "--exclude it or drop --rotate");
    }
    for (const std::string& shard : c.shards) {
      const st::File f((c.dir / shard).string());
      for (const st::TensorInfo& t : f.view().tensors())
        if (plan[shard + "/" + t.name].quantize) {
          rot_shard = shard, rot_module = t.name.substr(0, t.name.size() - 7);
          break;
        }
      if (!rot_shard.empty()) break;
    }
  }
  ph.plan = std::chrono::duration<double>(Phases::clock::now() - plan_t0).count();
  // Shared global scales of fused projections: the amax of the group (NaN or Inf when a member's is:
  // then S = 1 for every member, docs/numerics.md, and the summary says so).
  std::map<std::string, float> group_amax;
  for (const auto& [m, v] : amax) {
    const std::string gk = fused_group(fusion, m);
    if (!gk.empty()) group_amax[gk] = group_amax.count(gk) ? group_amax_of(group_amax[gk], v) : v;
  }
  std::vector<std::string> not_finite;  // the summary's warnings: tensors with NaN/Inf, global scales they forced

  json weight_map = json::object();
  Progress progress(plan.size());
  std::int64_t n_quant = 0, n_copy = 0;
  double bytes_in = 0, bytes_out = 0;
  std::size_t done = 0, total = plan.size();
  // The writes and each shard's commit (flush, fsync, rename) run on the writer thread while the
  // next tensors convert. Declared after `stage`: on an exception its destructor stops it before the
  // staging directory is removed.
  BytesPool pool;  // before the writer: its tasks hold the pool's buffers
  WriteBehind wb;
  // What follows each tensor's conversion (its error line, its write), in file order: a tensor's
  // conversion runs on the engine while the next one's input is staged (the GPU engine keeps two per
  // GPU in flight), and the writes must follow the order declared. A job with `conv` waits for the engine's
  // oldest conversion; the others (an unchanged tensor's write, a shard's commit) only for the jobs
  // before them.
  struct Job {
    bool conv;
    std::function<void(const std::optional<ErrorTotals>&)> complete;
  };
  std::deque<Job> jobs;
  auto complete_front = [&] {
    Job j = std::move(jobs.front());
    jobs.pop_front();
    std::optional<ErrorTotals> t;
    if (j.conv) ph.time(ph.convert, [&] { t = eng.finish(); });
    j.complete(t);
  };
  // the jobs that need not wait (an engine that converts in start_* finishes there)
  auto complete_ready = [&] {
    while (!jobs.empty() && (!jobs.front().conv || eng.oldest_ready())) complete_front();
  };
  // room on the engine for one more conversion
  auto make_room = [&] {
    while (eng.in_flight() >= eng.depth()) complete_front();
  };
  auto then = [&](std::function<void()> f) {
    jobs.push_back({false, [f = std::move(f)](const std::optional<ErrorTotals>&) { f(); }});
    complete_ready();
  };
  // A converted tensor's error line: NaN/Inf weights counted per block (such a block is stored as NaN
  // and decodes to NaN everywhere; the error pass saw them first, so finite tensors cost no extra
  // pass), its pages released, the line printed.
  auto finish_tensor = [&](const st::File& f, std::size_t idx, const st::TensorInfo& t, const std::uint8_t* xp,
                           const std::string& to, const ErrorSum& err) {
    if (err.bad_in) {
      const std::int64_t N = t.shape[0], K = t.shape[1];
      const NonFinite nf = count_nonfinite(xp, t.dtype, N, K, g);
      not_finite.push_back(fmt::format("{}: {} NaN/Inf values in {} of {} blocks of {}: those blocks decode to NaN", t.name,
                                       nf.values, nf.blocks, N * ((K + g - 1) / g), g));
    }
    f.release(t);
    ++n_quant;
    progress.clear_line();
    fmt::print("[{}/{}] {} [{}, {}] {} -> {}: {}\n", idx, total, printable(t.name), t.shape[0], t.shape[1], t.dtype, to, err.str());
    std::fflush(stdout);
  };
  for (std::size_t si = 0; si < c.shards.size(); ++si) {
    const std::string& shard = c.shards[si];
    if (part.n && int(si % std::size_t(part.n)) != part.i - 1) {  // another part's shard
      done += shard_tensors[shard];
      continue;
    }
    check_interrupted();
    // shared with the jobs and the writer thread's tasks (the unchanged tensors are written from the
    // mapping; the jobs of a shard may complete while the next shard converts)
    const auto file = std::make_shared<const st::File>((c.dir / shard).string());
    const st::File& f = *file;
    const auto writer = std::make_shared<st::Writer>((out / shard).string());
    st::Writer& w = *writer;
    w.metadata("format", "pt");
    for (const auto& [k, v] : f.view().metadata())
      if (k != "format") w.metadata(k, v);
    // Declare every output tensor of this shard, then write them in order.
    for (const st::TensorInfo& t : f.view().tensors()) {
      const std::string module = t.name.substr(0, t.name.size() - 7);
      if (!plan[shard + "/" + t.name].quantize) {
        w.declare(t.name, t.dtype, t.shape);
        weight_map[t.name] = shard;
        continue;
      }
      const std::int64_t N = t.shape[0], K = t.shape[1];
      if (a.fake) {  // the fake-quantized weight replaces the original, same name, dtype and shape
        w.declare(t.name, t.dtype, t.shape);
        weight_map[t.name] = shard;
        continue;
      }
      if (format == Format::mxfp8_e4m3) w.declare(module + ".weight", "F8_E4M3", {N, K});
      else w.declare(module + ".weight_packed", "U8", {N, K / 2});
      w.declare(module + ".weight_scale", format == Format::nvfp4 ? "F8_E4M3" : "U8", {N, K / g});
      if (format == Format::nvfp4) w.declare(module + ".weight_global_scale", "F32", {1});
      weight_map[module + (format == Format::mxfp8_e4m3 ? ".weight" : ".weight_packed")] = shard;
      weight_map[module + ".weight_scale"] = shard;
      if (format == Format::nvfp4) weight_map[module + ".weight_global_scale"] = shard;
    }
    const std::string rot_name = rot_module + "." + kRotationScheme + "_input.weight";
    if (shard == rot_shard) {
      w.declare(rot_name, "F32", {rot.second, rot.second});
      weight_map[rot_name] = shard;
    }

    for (const st::TensorInfo& t : f.view().tensors()) {
      check_interrupted();
      if (!device_said) {
        progress.clear_line();
        say_device(plan[shard + "/" + t.name].quantize ? 1 : 0);
      }
      const std::size_t idx = ++done;
      const auto src = f.view().data(t);
      bytes_in += double(src.size());
      progress.step(t.name, double(src.size()));
      if (!plan[shard + "/" + t.name].quantize) {
        // t by value: the tensor list may be a temporary of this loop
        then([&ph, &wb, writer, file, t, src] {
          ph.time(ph.write, [&] {
            wb.submit([writer, file, t, src] {
              writer->write(t.name, src);
              file->release(t);
            });
          });
        });
        bytes_out += double(src.size());
        ++n_copy;
        continue;
      }
      const std::string module = t.name.substr(0, t.name.size() - 7);
      const std::int64_t N = t.shape[0], K = t.shape[1];
      // The mapped bytes themselves, or an aligned copy where the file puts the tensor at an offset
      // that is not a multiple of its element size (kept until the tensor's job completes).
      const int es = st::find_dtype(t.dtype)->bytes;
      auto xcopy = std::make_shared<std::vector<std::uint8_t>>();
      const std::uint8_t* xp = src.data();
      if (reinterpret_cast<std::uintptr_t>(xp) % std::uintptr_t(es) != 0) {
        xcopy->assign(src.begin(), src.end());
        xp = xcopy->data();
        f.release(t);
      }
      const Tensor xt = Tensor::of(const_cast<std::uint8_t*>(xp), mxq_dtype(t.dtype), N, K);  // read only
      QuantOptions o = format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(format, rule);
      if (format == Format::nvfp4) {
        const std::string gk = fused_group(fusion, module);
        const float m = gk.empty() ? amax[module] : group_amax[gk];
        o.tensor_scale = nvfp4_tensor_scale_from_amax(m);
        if (!std::isfinite(m))
          not_finite.push_back(fmt::format(
              "{}: NVFP4 global scale {} (the amax of {} is {}; docs/numerics.md: S = 1 when the amax is not finite)",
              t.name, *o.tensor_scale, gk.empty() ? "the tensor" : "its fused group " + gk, m));
      }
      // the weight's input rotated: W @ (H / sqrt(RS)) per group of RS (the seed: rhad, qdq only)
      if (rot.first != Rotation::none) o = with_rotation(o, rot.first, rot.second, a.rotate_seed.value_or(0));
      const SrcType xty = src_type(t.dtype);
      if (a.fake) {
        auto yq = pool.get(src.size());
        const Tensor yt = Tensor::of(yq->data(), mxq_dtype(t.dtype), N, K);
        const std::string to = "qdq " + a.format + (a.rotate.empty() ? std::string() : " " + a.rotate);
        // the error line and the write, once the QDQ'd values are on the host
        auto complete = [&, file, idx, t, xp, xcopy, yq, writer, to, xty, es, N, K](const std::optional<ErrorTotals>& gt) {
          ErrorSum err;
          ph.time(ph.error, [&] {
            if (gt) {  // on the GPU, where the engine had the tensors
              err = ErrorSum(*gt);
              return;
            }
            err = error_sum(xp, xty, es, N, K, [&](std::int64_t r0, std::int64_t nr, float* y) {
              load_f32s(yq->data() + r0 * K * es, xty, nr * K, y);
            });
          });
          ph.time(ph.write, [&] { wb.submit([writer, name = t.name, yq] { writer->write(name, *yq); }); });
          finish_tensor(*file, idx, t, xp, to, err);
        };
        try {
          if (rot.first != Rotation::none) {  // rotate, quantize, dequantize, rotate back (one-shot, in order)
            // NVFP4: the (fused group's) global scale from the rotated weights' amax, as quantize --rotate
            const Shape2 ss = scale_shape(o, N, K);
            std::vector<std::uint8_t> codes(N * code_cols(format, K)), scales(ss.rows * ss.cols);
            QuantizedOut q;
            q.codes = Tensor::of(codes.data(), DType::u8, N, code_cols(format, K));
            q.scales = Tensor::of(scales.data(), DType::u8, ss.rows, ss.cols);
            float S = 1.0f;
            q.tensor_scale = format == Format::nvfp4 ? &S : nullptr;
            while (eng.in_flight()) complete_front();  // the one-shot API runs with nothing in flight
            ph.time(ph.convert, [&] {
              eng.quantize(xt, q, o);
              QuantOptions od = o;
              if (format == Format::nvfp4) od.tensor_scale = S;
              eng.dequantize(QuantizedIn{q.codes, q.scales}, yt, od);
            });
            jobs.push_back({false, complete});
          } else {
            make_room();
            ph.time(ph.convert, [&] { eng.start_qdq(xt, yt, o); });
            jobs.push_back({true, complete});
          }
        } catch (const std::exception& e) {
          fail((c.dir / shard).string() + ": tensor '" + t.name + "': " + e.what());
        }
        bytes_out += double(src.size());  // the same size as the input
        complete_ready();
        continue;
      }
      const Shape2 ss = scale_shape(o, N, K);
      const std::int64_t cc = code_cols(format, K);
      auto codes = pool.get(N * cc);
      auto scales = pool.get(ss.rows * ss.cols);
      QuantizedOut q;
      q.codes = Tensor::of(codes->data(), DType::u8, N, cc);
      q.scales = Tensor::of(scales->data(), DType::u8, ss.rows, ss.cols);
      try {
        make_room();
        ph.time(ph.convert, [&] { eng.start_quantize(xt, q, o); });
      } catch (const std::exception& e) {
        fail((c.dir / shard).string() + ": tensor '" + t.name + "': " + e.what());
      }
      bytes_out += double(codes->size() + scales->size()) + (format == Format::nvfp4 ? 4 : 0);
      const std::string to = a.format + (a.rotate.empty() ? std::string() : " " + a.rotate);
      jobs.push_back({true, [&, file, idx, t, xp, xcopy, codes, scales, writer, module, to, o, ss, cc, es, N, K](
                                const std::optional<ErrorTotals>& gt) {
                        // The error this tensor carries: on the GPU where the engine had the tensors; else
                        // the codes dequantized a band of rows at a time on the host's cores and compared
                        // (no full-size fp32 copies: peak memory stays about the input tensor plus its
                        // outputs and a band per thread). The host's dequantize whatever the engine: the
                        // bytes are the same on every backend.
                        check_interrupted();
                        ErrorSum err;
                        ph.time(ph.error, [&] {
                          if (gt) {
                            err = ErrorSum(*gt);
                            return;
                          }
                          QuantOptions oh = o;
                          oh.backend = Backend::cpu;
                          err = error_sum(xp, src_type(t.dtype), es, N, K, [&](std::int64_t r0, std::int64_t nr, float* y) {
                            mxq::dequantize(QuantizedIn{Tensor::of(codes->data() + r0 * cc, DType::u8, nr, cc),
                                                        Tensor::of(scales->data() + r0 * ss.cols, DType::u8, nr, ss.cols)},
                                            Tensor::of(y, DType::f32, nr, K), oh);
                          });
                        });
                        ph.time(ph.write, [&] {
                          wb.submit([writer, module, fp8 = format == Format::mxfp8_e4m3,
                                     S = format == Format::nvfp4 ? *o.tensor_scale : NAN, codes, scales] {
                            writer->write(module + (fp8 ? ".weight" : ".weight_packed"), *codes);
                            writer->write(module + ".weight_scale", *scales);
                            if (!std::isnan(S))
                              writer->write(module + ".weight_global_scale", {reinterpret_cast<const std::uint8_t*>(&S), 4});
                          });
                        });
                        finish_tensor(*file, idx, t, xp, to, err);
                      }});
      complete_ready();
    }
    if (shard == rot_shard) {  // the Sylvester Hadamard matrix, entries +-1 (the loader normalises)
      const int n = rot.second;
      std::vector<float> h(std::size_t(n) * n);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) h[std::size_t(i) * n + j] = (__builtin_popcount(unsigned(i & j)) & 1) ? -1.0f : 1.0f;
      bytes_out += double(h.size() * sizeof(float));
      then([&wb, writer, rot_name, hm = std::make_shared<const std::vector<float>>(std::move(h))] {
        wb.submit([writer, rot_name, hm] {
          writer->write(rot_name, {reinterpret_cast<const std::uint8_t*>(hm->data()), hm->size() * sizeof(float)});
        });
      });
    }
    then([&ph, &wb, writer] { ph.time(ph.write, [&] { wb.submit([writer] { writer->commit(); }); }); });
  }
  while (!jobs.empty()) complete_front();
  ph.time(ph.write, [&] { wb.drain(); });  // every shard written and synced (a failure throws here)
  progress.clear_line();
  say_device(2);
  if (eng.gpu()) ph.gpu = eng.breakdown();
  if (eng.converted_while_setting_up())
    fmt::print("device: the first {} conversions ran on the CPU while the GPU was being set up (the same bytes)\n",
               eng.converted_while_setting_up());

  Finish fin;
  fin.index = c.index;
  fin.side_files = fs::is_directory(a.in);
  if (a.fake) {  // a fake-quantized checkpoint loads as the original model: every side file copied
    if (part.n) return finish_part(a, part, c, stage, fin, weight_map, bytes_out, n_quant, n_copy);
    write_finish(c, out, fin, weight_map, std::uint64_t(bytes_out));
    stage.publish();
    fmt::print("fake-quantized {} tensors ({}), copied {} unchanged; peak memory {} MiB\n", n_quant, a.format, n_copy,
               peak_rss_mib());
    fmt::print("{}\n", ph.str());
    for (const std::string& u : unfit) fmt::print("left unchanged (empty, stored transposed, or K not a multiple of --rotate's size): {}\n", u);
    report_not_finite(not_finite);
    return 0;
  }
  // config.json with the quantization_config vLLM reads.
  std::sort(ignored_modules.begin(), ignored_modules.end());
  ignored_modules.erase(std::unique(ignored_modules.begin(), ignored_modules.end()), ignored_modules.end());
  if (std::find(ignored_modules.begin(), ignored_modules.end(), "lm_head") == ignored_modules.end())
    ignored_modules.insert(ignored_modules.begin(), "lm_head");
  json weights = {{"num_bits", format == Format::mxfp8_e4m3 ? 8 : 4},
                  {"type", "float"},
                  {"strategy", format == Format::nvfp4 ? "tensor_group" : "group"},
                  {"group_size", g},
                  {"symmetric", true},
                  {"dynamic", false},
                  {"scale_dtype", format == Format::nvfp4 ? "torch.float8_e4m3fn" : "torch.uint8"}};
  json qc = {{"quant_method", "compressed-tensors"},
             {"format", ct_format},
             {"quantization_status", "compressed"},
             {"ignore", ignored_modules},
             {"config_groups",
              {{"group_0",
                {{"targets", {"Linear"}},
                 {"format", ct_format},
                 {"weights", weights},
                 {"input_activations", nullptr},
                 {"output_activations", nullptr}}}}},
             {"kv_cache_scheme", nullptr},
             {"sparsity_config", json::object()},
             {"transform_config", json::object()},
             {"global_compression_ratio", nullptr}};
  if (rot.first != Rotation::none && rot_shard.empty())
    fmt::print("--rotate: no weight is quantized, so nothing is rotated and no transform_config is written\n");
  if (!rot_shard.empty()) {
    // compressed-tensors' TransformConfig (docs/cli.md "--rotate"): the input of every quantized Linear
    // rotated online by H / sqrt(RS) per head_dim = RS block, the weight's input side already rotated.
    const json ignore = ignored_modules;
    qc["transform_config"] = {
        {"config_groups",
         {{kRotationScheme,
           {{"type", "hadamard"},
            {"apply",
             {{{"targets", {"Linear"}}, {"location", "input"}, {"inverse", false}, {"ignore", ignore}},
              {{"targets", {"Linear"}}, {"location", "weight_input"}, {"inverse", true}, {"ignore", ignore}}}},
            {"randomize", false},
            {"requires_grad", false},
            {"head_dim", rot.second},
            {"precision", "torch.float32"}}}}}};
  }
  if (config) {
    json& cfg = *config;
    cfg["quantization_config"] = qc;
    // transformers' default loading decompresses compressed-tensors weights to bf16 and, for a model
    // whose config names no dtype, builds the rest in fp32: its first forward pass then fails mixing
    // the two. A config without a dtype gets the one the decompressed weights have; an explicit other
    // dtype is the user's and stays, with a note (docs/cli.md says what to pass instead).
    const auto dtype_of = [&](const char* k) { return cfg.contains(k) && cfg[k].is_string() ? cfg[k].get<std::string>() : ""; };
    const std::string dt = !dtype_of("torch_dtype").empty() ? dtype_of("torch_dtype") : dtype_of("dtype");
    if (dt.empty()) {
      cfg["torch_dtype"] = "bfloat16";
      fmt::print("config.json: torch_dtype bfloat16 added (it named no dtype; the decompressed weights are bf16)\n");
    } else if (dt != "bfloat16") {
      fmt::print(stderr, "mxq: note: config.json says dtype {}; transformers decompresses these weights to bf16 and "
                 "cannot run them in {} unless loaded with CompressedTensorsConfig(dequantize=True) or "
                 "torch_dtype=torch.bfloat16 (docs/cli.md)\n", dt, dt);
    }
    fin.config_name = "config.json";
    fin.config_text = dump_json(cfg) + "\n";
  } else {
    fin.side_files = false;  // a lone file: only its quantization_config.json beside it
    fin.config_name = "quantization_config.json";
    fin.config_text = dump_json(qc) + "\n";
  }
  if (part.n) return finish_part(a, part, c, stage, fin, weight_map, bytes_out, n_quant, n_copy);
  write_finish(c, out, fin, weight_map, std::uint64_t(bytes_out));

  stage.publish();
  fmt::print("quantized {} tensors to {}, copied {} unchanged; {:.1f} MiB -> {:.1f} MiB; peak memory {} MiB\n", n_quant,
             a.format, n_copy, bytes_in / 1048576, bytes_out / 1048576, peak_rss_mib());
  fmt::print("{}\n", ph.str());
  for (const std::string& u : unfit)
    fmt::print("left unquantized (empty, a shape vLLM could not load, stored transposed, or fused with a module left "
               "unquantized): {}\n", u);
  report_not_finite(not_finite);
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

// A part's shard, hard-linked or copied (see below) into the staging directory and checked there against the
// input shard it was converted from and the part's manifest: the staged file is a regular file of its
// own whose safetensors header is valid and declares exactly the tensors the manifest's weight map
// gives this shard, each either the input's tensor (same dtype and shape) or a quantized module of
// the input's weight (its shape, the manifest's format), or the transform's matrix. Returns the
// staged file's tensors (name -> data bytes).
std::map<std::string, std::uint64_t> stage_part_shard(const fs::path& from, const fs::path& to, const fs::path& input_shard,
                                                      const fs::path& manifest, const json& part_map,
                                                      const std::string& shard, const json& m0, int& rotation_matrices) {
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
  }
  for (const st::TensorInfo& t : v.tensors()) {
    if (consumed.count(t.name)) continue;
    const st::TensorInfo* x = iv.find(t.name);
    if (!x) fail(where + ": tensor '" + t.name + "' is neither in " + input_shard.string() + " nor a quantized module of it");
    if (x->dtype != t.dtype || x->shape != t.shape)
      fail(where + ": tensor '" + t.name + "' has dtype " + t.dtype + " and another shape or dtype than in " +
           input_shard.string() + " (" + x->dtype + ")");
  }
  for (const st::TensorInfo& x : iv.tensors())
    if (!v.find(x.name) && !replaced.count(x.name))
      fail(where + ": tensor '" + x.name + "' of " + input_shard.string() + " is missing");
  return found;
}

}  // namespace

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
  if (fake != m0.at("config_text").is_null())
    fail(m0_path.string() + ": key 'config_text' is " + std::string(fake ? "not null" : "null") + " for " +
         m0.at("command").get<std::string>());
  if (!fake) {
    json cfg = parse_json(m0.at("config_text").get<std::string>(), m0_path.string() + ": key 'config_text'");
    const json* qc = in_cfg ? (cfg.is_object() && cfg.contains("quantization_config") ? &cfg["quantization_config"] : nullptr)
                            : &cfg;
    if (!cfg.is_object() || !qc || !qc->is_object() || qc->value("quant_method", json()) != "compressed-tensors")
      fail(m0_path.string() + ": key 'config_text' is not a JSON object with a compressed-tensors quantization_config");
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
                                          man[std::size_t(i) - 1]["weight_map"], shard, m0, rotation_matrices);
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

int run_dequantize(const DequantizeArgs& a) {
  const DType odt = a.dtype == "bf16" ? DType::bf16 : a.dtype == "f16" ? DType::f16 : a.dtype == "f32" ? DType::f32 : DType::u8;
  if (odt == DType::u8) fail("--dtype '" + a.dtype + "': expected bf16, f16 or f32");
  const char* st_dt = odt == DType::bf16 ? "BF16" : odt == DType::f16 ? "F16" : "F32";
  const int ob = odt == DType::f32 ? 4 : 2;
  Engine eng(a.device);
  const Checkpoint c = open_checkpoint(a.in);
  std::optional<json> config = read_config(c, a.in);
  // A rotated checkpoint: its weights are W @ (H / sqrt(n)); they are rotated back, the transform's
  // matrix dropped, and the config no longer names the transform.
  const CheckpointRotation rot = checkpoint_rotation(c, config, a.in);
  check_output(fs::path(a.in), fs::path(a.out), a.overwrite);
  Staging stage{fs::path(a.out), a.overwrite};
  const fs::path& out = stage.dir();
  fmt::print("device: {} ({})\n", eng.name(), eng.why());
  if (rot.size) fmt::print("rotation: hadamard, blocks of {} (transform_config scheme '{}'): rotated back\n", rot.size, rot.scheme);
  json weight_map = json::object();
  std::int64_t n_deq = 0;
  for (const std::string& shard : c.shards) {
    check_interrupted();
    const std::string path = (c.dir / shard).string();
    const st::File f(path);
    const st::View& v = f.view();
    const std::map<std::string, QuantizedModule> mods = quantized_modules(v, path);
    std::set<std::string> consumed;
    for (const auto& [m, md] : mods) {
      consumed.insert(md.codes->name);
      consumed.insert(md.scale->name);
      if (md.global) consumed.insert(md.global->name);
    }
    for (const st::TensorInfo& t : v.tensors()) {
      if (rot.is_matrix(t.name)) {  // the transform's matrix: not part of the model
        consumed.insert(t.name);
        // ... but what it is: a matrix of another size than head_dim says which transform is wrong
        if (t.name.ends_with("_input.weight") &&
            (t.shape.size() != 2 || t.shape[0] != rot.size || t.shape[1] != rot.size))
          fail(path + ": tensor '" + t.name + "' is the transform's matrix, of shape " + shape_text(t.shape) +
               ", but transform_config's head_dim is " + std::to_string(rot.size) + " (a [" + std::to_string(rot.size) +
               ", " + std::to_string(rot.size) + "] matrix): the checkpoint contradicts itself");
      }
      const std::string module = t.name.ends_with(".weight") ? t.name.substr(0, t.name.size() - 7) : "";
      if (rot.size && !consumed.count(t.name) && t.shape.size() == 2 && !module.empty() && rot.rotates(module) &&
          !mods.count(module))
        fail(path + ": tensor '" + t.name + "' is not quantized and the transform_config rotates its module's weight "
             "(not in its ignore list): mxq undoes the rotation of quantized weights only");
    }
    st::Writer w((out / shard).string());
    w.metadata("format", "pt");
    for (const st::TensorInfo& t : v.tensors()) {
      if (consumed.count(t.name)) continue;
      w.declare(t.name, t.dtype, t.shape);
      weight_map[t.name] = shard;
    }
    for (const auto& [m, md] : mods) {
      w.declare(m + ".weight", st_dt, {md.N, md.K});
      weight_map[m + ".weight"] = shard;
    }
    for (const st::TensorInfo& t : v.tensors())
      if (!consumed.count(t.name)) w.write(t.name, v.data(t));
    for (const auto& [m, md] : mods) {
      check_interrupted();
      std::vector<std::uint8_t> y(md.N * md.K * ob);
      if (rot.rotates(m) && md.K % rot.size != 0)
        fail(path + ": module '" + m + "': K = " + std::to_string(md.K) + " is not a multiple of the transform's head_dim " +
             std::to_string(rot.size));
      dequantize_module(eng, v, path, m, rot.rotates(m) ? rot.undone(md) : md, odt, y.data());
      w.write(m + ".weight", y);
      ++n_deq;
    }
    w.commit();
  }
  if (c.index) {
    json idx = *c.index;
    idx["weight_map"] = weight_map;
    write_text(out / "model.safetensors.index.json", dump_json(idx) + "\n");
  }
  if (config) {
    json& cfg = *config;
    cfg.erase("quantization_config");
    copy_side_files(c, out, {"config.json"});
    write_text(out / "config.json", dump_json(cfg) + "\n");
  }
  stage.publish();
  fmt::print("dequantized {} modules to {}; peak memory {} MiB\n", n_deq, a.dtype, peak_rss_mib());
  return 0;
}

}  // namespace mxq::cli

namespace mxq::cli {

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

}  // namespace mxq::cli
