// The tool's compute engine: the CPU backends on host tensors, or the CUDA backend with the host
// tensors copied through device buffers on a stream of its own.
#include "engine.hpp"

#include <chrono>
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
  cuda_util::DeviceBuffer buf[5];  // x, codes/y, scales, mask, 4-byte scalar
  std::string device_name = cuda_util::device_properties().name;

  // Device buffer i of at least n bytes (contents undefined).
  void* get(int i, std::size_t n) {
    buf[i].reserve(n);
    return buf[i].get();
  }
  // A device tensor shaped as t in buffer i, with t's contents when upload.
  Tensor stage(int i, const Tensor& t, bool upload) {
    const std::size_t n = std::size_t(bytes_of(t));
    Tensor d = t;
    d.data = get(i, n);
    d.device = Device::cuda;
    if (upload) buf[i].upload_async(t.data, n, stream);
    return d;
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

}  // namespace mxq::cli
