// The tool's compute engine: the CPU backends on host tensors, or the CUDA backend with the host
// tensors copied through device buffers on a stream of its own.
#include "engine.hpp"

#include <chrono>
#include <stdexcept>
#include <vector>

#if defined(MXQ_TOOL_HAVE_CUDA)
#include <cuda_runtime.h>
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
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  struct Buf {
    void* p = nullptr;
    std::size_t n = 0;
  };
  Buf buf[5];  // x, codes/y, scales, mask, 4-byte scalar
  std::string device_name;

  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
  }
  Gpu() {
    int dev = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    device_name = prop.name;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~Gpu() {
    for (Buf& b : buf) cudaFree(b.p);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  // Device buffer i of at least n bytes (contents undefined).
  void* get(int i, std::size_t n) {
    Buf& b = buf[i];
    if (b.n < n) {
      cudaFree(b.p);
      b.p = nullptr;
      b.n = 0;
      check(cudaMalloc(&b.p, n ? n : 1), "cudaMalloc (device staging buffer)");
      b.n = n;
    }
    return b.p;
  }
  // A device tensor shaped as t in buffer i, with t's contents when upload.
  Tensor stage(int i, const Tensor& t, bool upload) {
    const std::size_t n = std::size_t(bytes_of(t));
    Tensor d = t;
    d.data = get(i, n);
    d.device = Device::cuda;
    if (upload && n) check(cudaMemcpyAsync(d.data, t.data, n, cudaMemcpyHostToDevice, stream), "copy to the GPU");
    return d;
  }
  void download(const Tensor& host, const Tensor& dev) {
    const std::size_t n = std::size_t(bytes_of(host));
    if (n) check(cudaMemcpyAsync(host.data, dev.data, n, cudaMemcpyDeviceToHost, stream), "copy from the GPU");
  }
  template <class F>
  void timed(F&& f) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    f();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
  }
  double finish() {
    check(cudaStreamSynchronize(stream), "the GPU operation");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms / 1e3;
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
    g.download(q.codes, qd.codes);
    g.download(q.scales, qd.scales);
    if (q.clip_mask.data) g.download(q.clip_mask, qd.clip_mask);
    if (q.tensor_scale) Gpu::check(cudaMemcpyAsync(q.tensor_scale, qd.tensor_scale, 4, cudaMemcpyDeviceToHost, g.stream), "copy from the GPU");
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
    g.download(y, yd);
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
    g.download(y, yd);
    return g.finish();
  }
#endif
  return wall([&] { mxq::dequantize(in, y, o); });
}

}  // namespace mxq::cli
