#include "checkpoint_pipeline.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "compressed_tensors.hpp"
#include "convert.hpp"
#include "error_sum.hpp"
#include "fail.hpp"
#include "safetensors.hpp"
#include "staging.hpp"
#include "write_behind.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mxq::cli {

namespace {

DType mxq_dtype(const std::string& dt) { return dt == "F32" ? DType::f32 : dt == "F16" ? DType::f16 : DType::bf16; }

// The tensor amax of a 2-D floating weight as the library defines it, on the CPU: the planning pass
// reads the mapped file. rot: the rotation quantize applies (none: the plain amax).
float weight_amax(const st::View& v, const st::TensorInfo& t, std::pair<Rotation, int> rot, std::uint64_t rot_seed) {
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

// One conversion of convert_checkpoint: its state, shared by the jobs that complete each tensor.
class Conversion {
 public:
  Conversion(Engine& eng, const Checkpoint& c, const fs::path& out, const QuantizePlan& plan,
             const std::map<std::string, ScaleAmax>& scales, const ConvertSpec& spec, Phases& ph, Progress& progress,
             DeviceLine& device)
      : eng_(eng), c_(c), out_(out), plan_(plan), scales_(scales), spec_(spec), ph_(ph), progress_(progress), device_(device),
        g_(format_info(spec.format).default_group), total_(plan.tensors.size()) {}

  Converted run() {
    for (std::size_t si = 0; si < c_.shards.size(); ++si) {
      const std::string& shard = c_.shards[si];
      const Part& part = spec_.part;
      if (part.n && int(si % std::size_t(part.n)) != part.i - 1) {  // another part's shard
        done_ += plan_.shard_tensors.at(shard);
        continue;
      }
      convert_shard(shard);
    }
    while (!jobs_.empty()) complete_front();
    ph_.time(ph_.write, [&] { wb_.drain(); });  // every shard written and synced (a failure throws here)
    return std::move(r_);
  }

 private:
  // What follows each tensor's conversion (its error line, its write), in file order: a tensor's
  // conversion runs on the engine while the next one's input is staged (the GPU engine keeps two per
  // GPU in flight), and the writes must follow the order declared. A job with `conv` waits for the engine's
  // oldest conversion; the others (an unchanged tensor's write, a shard's commit) only for the jobs
  // before them.
  struct Job {
    bool conv;
    std::function<void(const std::optional<ErrorTotals>&)> complete;
  };
  void complete_front() {
    Job j = std::move(jobs_.front());
    jobs_.pop_front();
    std::optional<ErrorTotals> t;
    if (j.conv) ph_.time(ph_.convert, [&] { t = eng_.finish(); });
    j.complete(t);
  }
  // the jobs that need not wait (an engine that converts in start_* finishes there)
  void complete_ready() {
    while (!jobs_.empty() && (!jobs_.front().conv || eng_.oldest_ready())) complete_front();
  }
  // room on the engine for one more conversion
  void make_room() {
    while (eng_.in_flight() >= eng_.depth()) complete_front();
  }
  void then(std::function<void()> f) {
    jobs_.push_back({false, [f = std::move(f)](const std::optional<ErrorTotals>&) { f(); }});
    complete_ready();
  }

  void convert_shard(const std::string& shard);
  // A quantized tensor's conversion started, and its job queued (qdq: fake_quantize's).
  void quantize_tensor(const std::string& shard, const std::shared_ptr<const st::File>& file,
                       const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx);
  // A gpt-oss experts tensor [E, K, N]: transposed to [E, N, K] and quantized along K (one-shot, with
  // nothing in flight), written as X_blocks / X_scales (the codes' and scales' bytes as they are).
  void quantize_experts(const std::string& shard, const std::shared_ptr<const st::File>& file,
                        const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx);
  void fake_quantize(const std::string& shard, const std::shared_ptr<const st::File>& file,
                     const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx,
                     const std::uint8_t* xp, const std::shared_ptr<std::vector<std::uint8_t>>& xcopy, const QuantOptions& o);
  // A converted tensor's error line: NaN/Inf weights counted per block (such a block is stored as NaN
  // and decodes to NaN everywhere; the error pass saw them first, so finite tensors cost no extra
  // pass), its pages released, the line printed.
  // rows, cols: of the 2-D weight xp holds (-1: t's shape)
  void finish_tensor(const st::File& f, std::size_t idx, const st::TensorInfo& t, const std::uint8_t* xp,
                     const std::string& to, const ErrorSum& err, std::int64_t rows = -1, std::int64_t cols = -1);

  Engine& eng_;
  const Checkpoint& c_;
  const fs::path& out_;
  const QuantizePlan& plan_;
  const std::map<std::string, ScaleAmax>& scales_;
  const ConvertSpec& spec_;
  Phases& ph_;
  Progress& progress_;
  DeviceLine& device_;
  const int g_;
  const std::size_t total_;
  std::size_t done_ = 0;
  Converted r_;
  // The writes and each shard's commit (flush, fsync, rename) run on the writer thread while the
  // next tensors convert. On an exception the writer is stopped (~WriteBehind) before the caller's
  // staging directory is removed.
  BytesPool pool_;  // before the writer: its tasks hold the pool's buffers
  WriteBehind wb_;
  std::deque<Job> jobs_;
};

void Conversion::convert_shard(const std::string& shard) {
  check_interrupted();
  // shared with the jobs and the writer thread's tasks (the unchanged tensors are written from the
  // mapping; the jobs of a shard may complete while the next shard converts)
  const auto file = std::make_shared<const st::File>((c_.dir / shard).string());
  const st::File& f = *file;
  const auto writer = std::make_shared<st::Writer>((out_ / shard).string());
  st::Writer& w = *writer;
  w.metadata("format", "pt");
  for (const auto& [k, v] : f.view().metadata())
    if (k != "format") w.metadata(k, v);
  // Declare every output tensor of this shard, then write them in order.
  for (const st::TensorInfo& t : f.view().tensors()) {
    // not quantized, or qdq: the fake-quantized weight replaces the original, same name, dtype and shape
    if (!plan_.quantized(shard, t.name) || spec_.fake) {
      w.declare(t.name, t.dtype, t.shape);
      r_.weight_map[t.name] = shard;
      continue;
    }
    if (plan_.tensors.at(shard + "/" + t.name).gpt_oss_experts) {
      for (const ExpertsDecl& d : gpt_oss_experts_tensors(t.name, t.shape)) {
        w.declare(d.name, d.dtype, d.shape);
        r_.weight_map[d.name] = shard;
      }
      continue;
    }
    for (const TensorDecl& d : quantized_tensors(spec_.format, t.name.substr(0, t.name.size() - 7), t.shape[0], t.shape[1])) {
      w.declare(d.name, d.dtype, d.shape);
      r_.weight_map[d.name] = shard;
    }
  }
  const bool rotation_matrix = shard == plan_.rotation_shard;
  const std::string rot_name = rotation_matrix_name(plan_.rotation_module);
  const int rs = spec_.rotation.second;
  if (rotation_matrix) {
    w.declare(rot_name, "F32", {rs, rs});
    r_.weight_map[rot_name] = shard;
  }

  for (const st::TensorInfo& t : f.view().tensors()) {
    check_interrupted();
    if (!device_.said()) {
      progress_.clear_line();
      device_.say(plan_.quantized(shard, t.name) ? 1 : 0);
    }
    const std::size_t idx = ++done_;
    const auto src = f.view().data(t);
    r_.bytes_in += double(src.size());
    progress_.step(t.name, double(src.size()));
    if (plan_.quantized(shard, t.name)) {
      quantize_tensor(shard, file, writer, t, idx);
      continue;
    }
    // t by value: the tensor list may be a temporary of this loop
    then([&ph = ph_, &wb = wb_, writer, file, t, src] {
      ph.time(ph.write, [&] {
        wb.submit([writer, file, t, src] {
          writer->write(t.name, src);
          file->release(t);
        });
      });
    });
    r_.bytes_out += double(src.size());
    ++r_.n_copy;
  }
  if (rotation_matrix) {  // the Sylvester Hadamard matrix, entries +-1 (the loader normalises)
    std::vector<float> h = hadamard_matrix(rs);
    r_.bytes_out += double(h.size() * sizeof(float));
    then([&wb = wb_, writer, rot_name, hm = std::make_shared<const std::vector<float>>(std::move(h))] {
      wb.submit([writer, rot_name, hm] {
        writer->write(rot_name, {reinterpret_cast<const std::uint8_t*>(hm->data()), hm->size() * sizeof(float)});
      });
    });
  }
  then([&ph = ph_, &wb = wb_, writer] { ph.time(ph.write, [&] { wb.submit([writer] { writer->commit(); }); }); });
}

void Conversion::quantize_tensor(const std::string& shard, const std::shared_ptr<const st::File>& file,
                                 const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx) {
  if (plan_.tensors.at(shard + "/" + t.name).gpt_oss_experts) {
    quantize_experts(shard, file, writer, t, idx);
    return;
  }
  const st::File& f = *file;
  const auto src = f.view().data(t);
  const Format format = spec_.format;
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
  QuantOptions o = format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(format, spec_.rule);
  if (format == Format::nvfp4) {
    const ScaleAmax& s = scales_.at(module);
    const float m = s.amax;
    o.tensor_scale = nvfp4_tensor_scale_from_amax(m);
    if (!std::isfinite(m))
      r_.not_finite.push_back(fmt::format(
          "{}: NVFP4 global scale {} (the amax of {} is {}; docs/numerics.md: S = 1 when the amax is not finite)",
          t.name, *o.tensor_scale, s.group.empty() ? "the tensor" : "its fused group " + s.group, m));
  }
  // the weight's input rotated: W @ (H / sqrt(RS)) per group of RS (the seed: rhad, qdq only)
  if (spec_.rotation.first != Rotation::none)
    o = with_rotation(o, spec_.rotation.first, spec_.rotation.second, spec_.rotation_seed);
  if (spec_.fake) {
    fake_quantize(shard, file, writer, t, idx, xp, xcopy, o);
    return;
  }
  const Shape2 ss = scale_shape(o, N, K);
  const std::int64_t cc = code_cols(format, K);
  auto codes = pool_.get(N * cc);
  auto scales = pool_.get(ss.rows * ss.cols);
  QuantizedOut q;
  q.codes = Tensor::of(codes->data(), DType::u8, N, cc);
  q.scales = Tensor::of(scales->data(), DType::u8, ss.rows, ss.cols);
  try {
    make_room();
    ph_.time(ph_.convert, [&] { eng_.start_quantize(xt, q, o); });
  } catch (const std::exception& e) {
    fail((c_.dir / shard).string() + ": tensor '" + t.name + "': " + e.what());
  }
  r_.bytes_out += double(codes->size() + scales->size()) + (format == Format::nvfp4 ? 4 : 0);
  const std::string& to = spec_.label;
  jobs_.push_back({true, [this, file, idx, t, xp, xcopy, codes, scales, writer, module, to, o, ss, cc, es, N, K](
                             const std::optional<ErrorTotals>& gt) {
                     // The error this tensor carries: on the GPU where the engine had the tensors; else
                     // the codes dequantized a band of rows at a time on the host's cores and compared
                     // (no full-size fp32 copies: peak memory stays about the input tensor plus its
                     // outputs and a band per thread). The host's dequantize whatever the engine: the
                     // bytes are the same on every backend.
                     check_interrupted();
                     ErrorSum err;
                     ph_.time(ph_.error, [&] {
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
                     const Format format = spec_.format;
                     ph_.time(ph_.write, [&] {
                       wb_.submit([writer, module, fp8 = format == Format::mxfp8_e4m3,
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

void Conversion::fake_quantize(const std::string& shard, const std::shared_ptr<const st::File>& file,
                               const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx,
                               const std::uint8_t* xp, const std::shared_ptr<std::vector<std::uint8_t>>& xcopy,
                               const QuantOptions& o) {
  const Format format = spec_.format;
  const auto src = file->view().data(t);
  const std::int64_t N = t.shape[0], K = t.shape[1];
  const int es = st::find_dtype(t.dtype)->bytes;
  const Tensor xt = Tensor::of(const_cast<std::uint8_t*>(xp), mxq_dtype(t.dtype), N, K);  // read only
  const SrcType xty = src_type(t.dtype);
  auto yq = pool_.get(src.size());
  const Tensor yt = Tensor::of(yq->data(), mxq_dtype(t.dtype), N, K);
  const std::string& to = spec_.label;
  // the error line and the write, once the QDQ'd values are on the host
  auto complete = [this, file, idx, t, xp, xcopy, yq, writer, to, xty, es, N, K](const std::optional<ErrorTotals>& gt) {
    ErrorSum err;
    ph_.time(ph_.error, [&] {
      if (gt) {  // on the GPU, where the engine had the tensors
        err = ErrorSum(*gt);
        return;
      }
      err = error_sum(xp, xty, es, N, K, [&](std::int64_t r0, std::int64_t nr, float* y) {
        load_f32s(yq->data() + r0 * K * es, xty, nr * K, y);
      });
    });
    ph_.time(ph_.write, [&] { wb_.submit([writer, name = t.name, yq] { writer->write(name, *yq); }); });
    finish_tensor(*file, idx, t, xp, to, err);
  };
  try {
    if (spec_.rotation.first != Rotation::none) {  // rotate, quantize, dequantize, rotate back (one-shot, in order)
      // NVFP4: the (fused group's) global scale from the rotated weights' amax, as quantize --rotate
      const Shape2 ss = scale_shape(o, N, K);
      std::vector<std::uint8_t> codes(N * code_cols(format, K)), scales(ss.rows * ss.cols);
      QuantizedOut q;
      q.codes = Tensor::of(codes.data(), DType::u8, N, code_cols(format, K));
      q.scales = Tensor::of(scales.data(), DType::u8, ss.rows, ss.cols);
      float S = 1.0f;
      q.tensor_scale = format == Format::nvfp4 ? &S : nullptr;
      while (eng_.in_flight()) complete_front();  // the one-shot API runs with nothing in flight
      ph_.time(ph_.convert, [&] {
        eng_.quantize(xt, q, o);
        QuantOptions od = o;
        if (format == Format::nvfp4) od.tensor_scale = S;
        eng_.dequantize(QuantizedIn{q.codes, q.scales}, yt, od);
      });
      jobs_.push_back({false, complete});
    } else {
      make_room();
      ph_.time(ph_.convert, [&] { eng_.start_qdq(xt, yt, o); });
      jobs_.push_back({true, complete});
    }
  } catch (const std::exception& e) {
    fail((c_.dir / shard).string() + ": tensor '" + t.name + "': " + e.what());
  }
  r_.bytes_out += double(src.size());  // the same size as the input
  complete_ready();
}

void Conversion::quantize_experts(const std::string& shard, const std::shared_ptr<const st::File>& file,
                                  const std::shared_ptr<st::Writer>& writer, const st::TensorInfo& t, std::size_t idx) {
  const auto src = file->view().data(t);
  const std::int64_t E = t.shape.at(0), K = t.shape.at(1), N = t.shape.at(2);
  const int es = st::find_dtype(t.dtype)->bytes;
  if (std::int64_t(src.size()) != E * K * N * es)
    fail((c_.dir / shard).string() + ": tensor '" + t.name + "': its data does not hold its shape");
  // [E, K, N] -> [E, N, K], element by element (memcpy: the mapped data need not be aligned)
  auto xt_bytes = std::make_shared<std::vector<std::uint8_t>>(src.size());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::uint8_t* row = src.data() + ((e * K + k) * N) * es;
      std::uint8_t* dst = xt_bytes->data() + (e * N * K + k) * es;
      for (std::int64_t n = 0; n < N; ++n) std::memcpy(dst + n * K * es, row + n * es, std::size_t(es));
    }
  const std::int64_t rows = E * N;
  const Tensor xt = Tensor::of(xt_bytes->data(), mxq_dtype(t.dtype), rows, K);
  const QuantOptions o = QuantOptions::mx(Format::mxfp4, spec_.rule);
  const Shape2 ss = scale_shape(o, rows, K);
  const std::int64_t cc = code_cols(Format::mxfp4, K);
  auto codes = pool_.get(rows * cc);
  auto scales = pool_.get(ss.rows * ss.cols);
  QuantizedOut q;
  q.codes = Tensor::of(codes->data(), DType::u8, rows, cc);
  q.scales = Tensor::of(scales->data(), DType::u8, ss.rows, ss.cols);
  try {
    while (!jobs_.empty()) complete_front();  // the one-shot API runs with nothing in flight; the lines in order
    ph_.time(ph_.convert, [&] { eng_.quantize(xt, q, o); });
  } catch (const std::exception& e) {
    fail((c_.dir / shard).string() + ": tensor '" + t.name + "': " + e.what());
  }
  r_.bytes_out += double(codes->size() + scales->size());
  ErrorSum err;
  ph_.time(ph_.error, [&] {
    QuantOptions oh = o;
    oh.backend = Backend::cpu;
    err = error_sum(xt_bytes->data(), src_type(t.dtype), es, rows, K, [&](std::int64_t r0, std::int64_t nr, float* y) {
      mxq::dequantize(QuantizedIn{Tensor::of(codes->data() + r0 * cc, DType::u8, nr, cc),
                                  Tensor::of(scales->data() + r0 * ss.cols, DType::u8, nr, ss.cols)},
                      Tensor::of(y, DType::f32, nr, K), oh);
    });
  });
  then([&ph = ph_, &wb = wb_, writer, name = t.name, codes, scales] {
    ph.time(ph.write, [&] {
      wb.submit([writer, name, codes, scales] {
        writer->write(name + "_blocks", *codes);
        writer->write(name + "_scales", *scales);
      });
    });
  });
  finish_tensor(*file, idx, t, xt_bytes->data(), spec_.label + " (gpt-oss blocks)", err, rows, K);
}

void Conversion::finish_tensor(const st::File& f, std::size_t idx, const st::TensorInfo& t, const std::uint8_t* xp,
                               const std::string& to, const ErrorSum& err, std::int64_t rows, std::int64_t cols) {
  if (err.bad_in) {
    const std::int64_t N = rows >= 0 ? rows : t.shape[0], K = cols >= 0 ? cols : t.shape[1];
    const NonFinite nf = count_nonfinite(xp, t.dtype, N, K, g_);
    // nvfp4_e5m3 has no NaN scale (docs/numerics.md): the QDQ keeps a NaN, an Inf gives +-688128, the rest of
    // the block is quantized under the largest scale.
    const char* what = spec_.format == Format::nvfp4_e5m3 ? "NaN stays NaN, Inf becomes +-688128 and the other values of "
                                                            "those blocks take the largest scale, 114688"
                                                          : "those blocks decode to NaN";
    r_.not_finite.push_back(fmt::format("{}: {} NaN/Inf values in {} of {} blocks of {}: {}", t.name, nf.values, nf.blocks,
                                        N * ((K + g_ - 1) / g_), g_, what));
  }
  f.release(t);
  ++r_.n_quant;
  progress_.clear_line();
  std::string shape;
  for (std::size_t i = 0; i < t.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
  fmt::print("[{}/{}] {} [{}] {} -> {}: {}\n", idx, total_, printable(t.name), shape, t.dtype, to, err.str());
  std::fflush(stdout);
}

}  // namespace

std::string Phases::str() const {
  const double all = std::chrono::duration<double>(clock::now() - start).count();
  const std::string conv =
      gpu ? fmt::format(" (staging {:.2f} s, buffers {:.2f} s, waiting for the GPU {:.2f} s, results {:.2f} s)", gpu->staging,
                        gpu->buffers, gpu->waiting, gpu->results)
          : std::string();
  return fmt::format("time: {:.2f} s in all; setup {:.2f} s, planning {:.2f} s, conversion {:.2f} s{}, error statistics "
                     "{:.2f} s, writing {:.2f} s, the rest (reading, page faults) {:.2f} s",
                     all, setup, plan, convert, conv, error, write, all - setup - plan - convert - error - write);
}

Progress::Progress(std::size_t total) : total_(total), tty_(::isatty(2) != 0) {}

Progress::~Progress() {
  if (tty_ && shown_) std::fprintf(stderr, "\n");
}

void Progress::step(const std::string& name, double bytes) {
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

void Progress::clear_line() {
  if (tty_ && shown_) std::fprintf(stderr, "\r%*s\r", 110, "");
}

void DeviceLine::say(int wait) {
  if (said_ || !(wait == 2 || eng_.settled(wait == 1))) return;
  said_ = true;
  fmt::print("device: {} ({})\n", eng_.name(), eng_.why());
}

long peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

void report_not_finite(const std::vector<std::string>& lines) {
  if (lines.empty()) return;
  for (const std::string& l : lines) fmt::print("NOT FINITE: {}\n", l);
  std::fflush(stdout);
  fmt::print(stderr, "mxq: warning: the input holds NaN or Inf weights: {} NOT FINITE line(s) in the summary\n", lines.size());
}

std::map<std::string, float> weight_amaxes(const Checkpoint& c, const QuantizePlan& plan, std::pair<Rotation, int> rotation,
                                           std::uint64_t rotation_seed) {
  std::map<std::string, float> amax;
  for (const std::string& shard : c.shards) {
    const st::File f((c.dir / shard).string());
    for (const st::TensorInfo& t : f.view().tensors())
      if (plan.quantized(shard, t.name)) {
        check_interrupted();
        amax[t.name.substr(0, t.name.size() - 7)] = weight_amax(f.view(), t, rotation, rotation_seed);
        f.release(t);
      }
  }
  return amax;
}

Converted convert_checkpoint(Engine& eng, const Checkpoint& c, const fs::path& out, const QuantizePlan& plan,
                             const std::map<std::string, ScaleAmax>& scales, const ConvertSpec& spec, Phases& ph,
                             Progress& progress, DeviceLine& device) {
  Converted r = Conversion(eng, c, out, plan, scales, spec, ph, progress, device).run();
  progress.clear_line();
  device.say(2);
  if (eng.gpu()) ph.gpu = eng.breakdown();
  if (eng.converted_while_setting_up())
    fmt::print("device: the first {} conversions ran on the CPU while the GPU was being set up (the same bytes)\n",
               eng.converted_while_setting_up());
  return r;
}

}  // namespace mxq::cli
