// The tool's compute engine: the CPU backends on host tensors, or the CUDA backend with the host
// tensors copied through device buffers on a stream of its own.
#include "engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(MXQ_TOOL_HAVE_CUDA)
#include "cuda_util.hpp"
#endif

namespace mxq::cli {

namespace {

template <class F>
double wall(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

#if defined(MXQ_TOOL_HAVE_CUDA)

// Bytes a (host, dense-rowed) tensor spans.
std::int64_t bytes_of(const Tensor& t) {
  const int es = t.dtype == DType::f32 ? 4 : (t.dtype == DType::f16 || t.dtype == DType::bf16) ? 2 : 1;
  if (t.rows == 0 || t.cols == 0) return 0;
  return ((t.rows - 1) * t.stride() + t.cols) * es;
}

struct Engine::Gpu {
  cuda_util::Stream stream;
  cuda_util::EventTimer timer;
  // x, codes/y, scales, mask, 4-byte scalar; the error pass: fp32 dequantized values, partial sums
  cuda_util::DeviceBuffer buf[7];
  cuda_util::PinnedBuffer pinned[3];  // the uploads' staging (x or codes, -, scales)
  std::string device_name = cuda_util::device_properties().name;

  // Device buffer i of at least n bytes (contents undefined; kept while it need not grow).
  void* get(int i, std::size_t n) {
    buf[i].reserve(n);
    return buf[i].get();
  }
  // A device tensor shaped as t in buffer i, with t's contents when upload. An upload goes through
  // page-locked memory, filled by every core (the host tensor is often a file mapping: its pages
  // are faulted in in parallel), then copied at the link's speed. Safe to reuse at the next call:
  // every operation waits for its stream before returning (finish()).
  Tensor stage(int i, const Tensor& t, bool upload) {
    const std::size_t n = std::size_t(bytes_of(t));
    Tensor d = t;
    d.data = get(i, n);
    d.device = Device::cuda;
    if (upload && n) {
      cuda_util::PinnedBuffer& h = pinned[i < 3 ? i : 0];
      h.reserve(n);
      parallel_copy(h.get(), t.data, n);
      buf[i].upload_async(h.get(), n, stream);
    }
    return d;
  }
  static void parallel_copy(void* dst, const void* src, std::size_t n) {
    constexpr std::size_t kChunk = std::size_t(4) << 20;
    const std::int64_t chunks = std::int64_t((n + kChunk - 1) / kChunk);
#if defined(MXQ_TOOL_HAVE_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (chunks > 1)
#endif
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::size_t o = std::size_t(c) * kChunk;
      std::memcpy(static_cast<char*>(dst) + o, static_cast<const char*>(src) + o, std::min(kChunk, n - o));
    }
  }
  void download(int i, void* host, std::size_t n) { buf[i].download_async(host, n, stream); }
  void download(int i, const Tensor& host) { download(i, host.data, std::size_t(bytes_of(host))); }
  template <class F>
  void timed(F&& f) {
    timer.start(stream);
    f();
    timer.stop(stream);
  }
  double finish() {
    stream.sync("the GPU operation");
    return timer.seconds();
  }
  QuantOptions on_stream(QuantOptions o) {
    o.stream = stream;
    o.backend = Backend::cuda;
    o.workspace = get(4, 4);
    return o;
  }
};

#else

struct Engine::Gpu {};

#endif

Engine::Engine(const std::string& device) {
  if (device != "cpu" && device != "cuda" && device != "auto")
    throw std::runtime_error("--device '" + device + "': expected cpu, cuda or auto");
  std::string why_not;
  const bool usable = cuda_available(&why_not);
  if (device == "cuda" && !usable) throw std::runtime_error("--device cuda: no usable GPU: " + why_not);
  if (device == "cpu" || !usable) {
    name_ = "cpu";
    why_ = device == "cpu" ? "asked for" : "no usable GPU: " + why_not;
    return;
  }
#if defined(MXQ_TOOL_HAVE_CUDA)
  gpu_ = std::make_unique<Gpu>();
  name_ = "cuda";
  why_ = (device == "cuda" ? "asked for: " : "a GPU is usable: ") + gpu_->device_name;
#else
  if (device == "cuda") throw std::runtime_error("--device cuda: this build of the tool has no CUDA support");
  name_ = "cpu";
  why_ = "this build of the tool has no CUDA support";
#endif
}

Engine::~Engine() = default;

double Engine::quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o) {
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) {
    Gpu& g = *gpu_;
    const Tensor xd = g.stage(0, x, true);
    QuantizedOut qd;
    qd.codes = g.stage(1, q.codes, false);
    qd.scales = g.stage(2, q.scales, false);
    if (q.clip_mask.data) qd.clip_mask = g.stage(3, q.clip_mask, false);
    if (q.tensor_scale) qd.tensor_scale = static_cast<float*>(g.get(4, 4));
    const QuantOptions od = g.on_stream(o);
    g.timed([&] { mxq::quantize(xd, qd, od); });
    g.download(1, q.codes);
    g.download(2, q.scales);
    if (q.clip_mask.data) g.download(3, q.clip_mask);
    if (q.tensor_scale) g.download(4, q.tensor_scale, 4);
    return g.finish();
  }
#endif
  return wall([&] { mxq::quantize(x, q, o); });
}

double Engine::qdq(const Tensor& x, const Tensor& y, const QuantOptions& o, int reps) {
  reps = reps < 1 ? 1 : reps;
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) {
    Gpu& g = *gpu_;
    const Tensor xd = g.stage(0, x, true), yd = g.stage(1, y, false);
    const QuantOptions od = g.on_stream(o);
    g.timed([&] {
      for (int r = 0; r < reps; ++r) mxq::qdq(xd, yd, od);
    });
    g.download(1, y);
    return g.finish() / reps;
  }
#endif
  return wall([&] {
           for (int r = 0; r < reps; ++r) mxq::qdq(x, y, o);
         }) /
         reps;
}

double Engine::dequantize(const QuantizedIn& in, const Tensor& y, const QuantOptions& o) {
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) {
    Gpu& g = *gpu_;
    const QuantizedIn ind{g.stage(0, in.codes, true), g.stage(2, in.scales, true)};
    const Tensor yd = g.stage(1, y, false);
    const QuantOptions od = g.on_stream(o);
    g.timed([&] { mxq::dequantize(ind, yd, od); });
    g.download(1, y);
    return g.finish();
  }
#endif
  return wall([&] { mxq::dequantize(in, y, o); });
}

bool Engine::quantize_error(const Tensor& x, const QuantizedOut& q, const QuantOptions& o, ErrorTotals& t) {
#if defined(MXQ_TOOL_HAVE_CUDA)
  // NOTE: dequantize needs NVFP4's tensor scale in o (the tool always gives it); without it the
  // caller's host pass decides
  if (gpu_ && x.stride() == x.cols && (o.format != Format::nvfp4 || o.tensor_scale)) {
    Gpu& g = *gpu_;
    // quantize() left x in buffer 0, the codes in 1 and the scales in 2 (same sizes: not reallocated)
    const Tensor xd = g.stage(0, x, false);
    const QuantizedIn qd{g.stage(1, q.codes, false), g.stage(2, q.scales, false)};
    Tensor yd = Tensor::of(g.get(5, std::size_t(x.rows * x.cols) * 4), DType::f32, x.rows, x.cols);
    yd.device = Device::cuda;
    mxq::dequantize(qd, yd, g.on_stream(o));
    t = gpu::error_totals(xd.data, x.dtype, yd.data, DType::f32, x.rows * x.cols,
                          static_cast<double*>(g.get(6, sizeof(double) * gpu::kErrorPartials)), g.stream);
    return true;
  }
#else
  (void)x, (void)q, (void)o, (void)t;
#endif
  return false;
}

bool Engine::qdq_error(const Tensor& x, const Tensor& y, ErrorTotals& t) {
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_ && x.stride() == x.cols && y.stride() == y.cols) {
    Gpu& g = *gpu_;
    // qdq() left x in buffer 0 and y in buffer 1
    const Tensor xd = g.stage(0, x, false), yd = g.stage(1, y, false);
    t = gpu::error_totals(xd.data, x.dtype, yd.data, y.dtype, x.rows * x.cols,
                          static_cast<double*>(g.get(6, sizeof(double) * gpu::kErrorPartials)), g.stream);
    return true;
  }
#else
  (void)x, (void)y, (void)t;
#endif
  return false;
}

}  // namespace mxq::cli
