// The tool's compute engine: the CPU backends on host tensors, or the CUDA backend with the host
// tensors copied through device buffers on a stream of its own.
#include "engine.hpp"

#include "error_sum.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
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

// The CPU engine's conversion with its error statistics in one pass: bands of rows converted and
// compared while they are in cache (error_sum's bands, in parallel; the library's calls inside run
// on one thread each). Only where a band's conversion is the whole tensor's rows: dense rows, linear
// scales, no clip mask, NVFP4 with its tensor scale given, no stochastic rounding or random signs
// (their counters and seeds run over the whole tensor). Else none: the caller sums on the host.
bool bandable(const Tensor& x, const QuantOptions& o) {
  return x.stride() == x.cols && x.rows > 0 && x.cols > 0 && o.scale_layout == ScaleLayout::linear &&
         o.rounding != Rounding::stochastic && o.rotation != Rotation::random_hadamard &&
         (o.format != Format::nvfp4 || o.tensor_scale) &&
         (x.dtype == DType::bf16 || x.dtype == DType::f16 || x.dtype == DType::f32);
}
std::int64_t elem_bytes(DType t) { return t == DType::f32 ? 4 : (t == DType::bf16 || t == DType::f16) ? 2 : 1; }
SrcType src_of(DType t) { return t == DType::f32 ? SrcType::f32 : t == DType::bf16 ? SrcType::bf16 : SrcType::f16; }
Tensor rows_of(const Tensor& t, std::int64_t r0, std::int64_t nr) {
  Tensor b = t;
  b.data = static_cast<char*>(t.data) + r0 * t.stride() * elem_bytes(t.dtype);
  b.rows = nr;
  return b;
}

std::optional<ErrorTotals> cpu_quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o) {
  if (!bandable(x, o) || q.clip_mask.data || q.codes.stride() != q.codes.cols || q.scales.stride() != q.scales.cols) {
    mxq::quantize(x, q, o);
    return std::nullopt;
  }
  const ErrorSum s = error_sum(static_cast<const std::uint8_t*>(x.data), src_of(x.dtype), int(elem_bytes(x.dtype)), x.rows,
                               x.cols, [&](std::int64_t r0, std::int64_t nr, float* y) {
                                 QuantizedOut qb;
                                 qb.codes = rows_of(q.codes, r0, nr);
                                 qb.scales = rows_of(q.scales, r0, nr);
                                 qb.tensor_scale = q.tensor_scale;  // the given scale, written by every band alike
                                 mxq::quantize(rows_of(x, r0, nr), qb, o);
                                 mxq::dequantize(QuantizedIn{qb.codes, qb.scales}, Tensor::of(y, DType::f32, nr, x.cols), o);
                               });
  return ErrorTotals(s);
}

std::optional<ErrorTotals> cpu_qdq(const Tensor& x, const Tensor& y, const QuantOptions& o) {
  if (!bandable(x, o) || y.stride() != y.cols) {
    mxq::qdq(x, y, o);
    return std::nullopt;
  }
  const ErrorSum s = error_sum(static_cast<const std::uint8_t*>(x.data), src_of(x.dtype), int(elem_bytes(x.dtype)), x.rows,
                               x.cols, [&](std::int64_t r0, std::int64_t nr, float* yf) {
                                 const Tensor yb = rows_of(y, r0, nr);
                                 mxq::qdq(rows_of(x, r0, nr), yb, o);
                                 load_f32s(static_cast<const std::uint8_t*>(yb.data), src_of(y.dtype), nr * x.cols, yf);
                               });
  return ErrorTotals(s);
}

}  // namespace

#if defined(MXQ_TOOL_HAVE_CUDA)

// Bytes a (host, dense-rowed) tensor spans.
std::int64_t bytes_of(const Tensor& t) {
  const int es = t.dtype == DType::f32 ? 4 : (t.dtype == DType::f16 || t.dtype == DType::bf16) ? 2 : 1;
  if (t.rows == 0 || t.cols == 0) return 0;
  return ((t.rows - 1) * t.stride() + t.cols) * es;
}

// Makes a GPU the calling thread's current device: on construction (the first member of a Lane, so
// that the lane's stream, events and buffers belong to its GPU) and on use() (before each operation on
// the lane: the library runs on the current device and refuses memory of another).
struct OnDevice {
  int dev;
  explicit OnDevice(int d) : dev(d) { use(); }
  void use() const { cuda_util::check(cudaSetDevice(dev), "cudaSetDevice(" + std::to_string(dev) + ")"); }
};

// A stream with the device buffers and page-locked staging of one conversion at a time, on one GPU.
struct Lane {
  OnDevice on;
  Engine::Breakdown* bd;
  Lane(Engine::Breakdown* b, int dev) : on(dev), bd(b) {}
  ~Lane() { cudaSetDevice(on.dev); }  // the members' streams, events and buffers are freed on their GPU
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  cuda_util::Stream stream;
  cuda_util::EventTimer timer;  // around the work; its stop also marks the lane's end (downloads included)
  // x, codes/y, scales, mask, 4-byte scalar; the error pass: fp32 dequantized values, partial sums
  cuda_util::DeviceBuffer buf[7];
  cuda_util::PinnedBuffer up[3];    // the uploads' staging (x or codes, -, scales)
  cuda_util::PinnedBuffer down[7];  // the downloads of a conversion in flight (same indices as buf)
  struct Dest {
    void* host;
    std::size_t n;
    int buf;
  };
  std::vector<Dest> dests;  // where finish() copies down[] to
  bool stats = false;       // down[6] holds the error statistics' partials

  // Device buffer i of at least n bytes (contents undefined; kept while it need not grow).
  void* get(int i, std::size_t n) {
    if (n > buf[i].size()) bd->buffers += wall([&] { buf[i].reserve(n); });
    return buf[i].get();
  }
  static void grow(Engine::Breakdown* bd, cuda_util::PinnedBuffer& h, std::size_t n) {
    if (n > h.size()) bd->buffers += wall([&] { h.reserve(n); });
  }
  // A device tensor shaped as t in buffer i, with t's contents when upload. An upload goes through
  // page-locked memory, filled by every core (the host tensor is often a file mapping: its pages
  // are faulted in in parallel), then copied at the link's speed. The staging is reused by the lane's
  // next conversion, which starts after this one has finished.
  Tensor stage(int i, const Tensor& t, bool upload) {
    const std::size_t n = std::size_t(bytes_of(t));
    Tensor d = t;
    d.data = get(i, n);
    d.device = Device::cuda;
    if (upload && n) {
      cuda_util::PinnedBuffer& h = up[i < 3 ? i : 0];
      grow(bd, h, n);
      bd->staging += wall([&] { parallel_copy(h.get(), t.data, n); });
      buf[i].upload_async(h.get(), n, stream);
    }
    return d;
  }
  // Enqueues the copy of buffer i to page-locked memory; finish() copies it on to host.
  void download_later(int i, void* host, std::size_t n) {
    if (!n) return;
    grow(bd, down[i], n);
    buf[i].download_async(down[i].get(), n, stream);
    dests.push_back({host, n, i});
  }
  void download_later(int i, const Tensor& host) { download_later(i, host.data, std::size_t(bytes_of(host))); }
  QuantOptions on_stream(QuantOptions o) {
    o.stream = stream;
    o.backend = Backend::cuda;
    o.workspace = get(4, 4);
    return o;
  }
  // The error statistics of x against y (device tensors, dense), enqueued.
  void stats_later(const Tensor& xd, const Tensor& yd) {
    grow(bd, down[6], sizeof(double) * gpu::kErrorPartials);
    gpu::error_totals_async(xd.data, xd.dtype, yd.data, yd.dtype, xd.rows * xd.cols,
                            static_cast<double*>(get(6, sizeof(double) * gpu::kErrorPartials)),
                            static_cast<double*>(down[6].get()), stream);
    stats = true;
  }
  // Waits for the lane's work, copies its downloads to their host memory; the statistics if any.
  std::optional<ErrorTotals> finish() {
    bd->waiting += wall([&] { timer.seconds(); });  // an error there is the conversion's
    bd->results += wall([&] {
      for (const Dest& d : dests) parallel_copy(d.host, down[d.buf].get(), d.n);
    });
    dests.clear();
    std::optional<ErrorTotals> t;
    if (stats) t = gpu::sum_partials(static_cast<const double*>(down[6].get()));
    stats = false;
    return t;
  }
  // The one-shot API: downloads straight to the host memory, then waits.
  void download_now(int i, void* host, std::size_t n) { buf[i].download_async(host, n, stream); }
  void download_now(int i, const Tensor& host) { download_now(i, host.data, std::size_t(bytes_of(host))); }
  double wait() {
    stream.sync("the GPU operation");
    return timer.seconds();
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
};

// More GPUs asked for than are visible: the user's error, whether --device is cuda or auto.
struct GpuCount : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Engine::Gpu {
  // Two conversions in flight per GPU: one's staging and upload overlap the other's kernels and download.
  static constexpr int kPerDevice = 2;
  Engine::Breakdown bd;
  std::vector<std::unique_ptr<Lane>> lanes;  // lane i on GPU i % devices: consecutive conversions alternate GPUs
  int devices = 1;
  std::string device_name;

  // The first `want` visible GPUs (0: all of them; Engine::kFirstGpu: the first).
  explicit Gpu(int want) {
    int n = 0;
    cuda_util::check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    devices = want > 0 ? std::min(want, n) : want == 0 ? n : 1;  // more than n: refused at the probe
    for (int i = 0; i < kPerDevice * devices; ++i) {
      try {
        lanes.push_back(std::make_unique<Lane>(&bd, i % devices));
      } catch (const std::exception& e) {
        throw std::runtime_error("CUDA device " + std::to_string(i % devices) + " of " + std::to_string(devices) + ": " + e.what());
      }
    }
    std::string first;
    bool same = true;
    for (int d = 0; d < devices; ++d) {
      cudaDeviceProp prop{};
      cuda_util::check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
      if (d == 0) first = prop.name;
      same = same && first == prop.name;
      device_name += (d ? ", " : "") + std::string(prop.name);
    }
    if (devices > 1 && same) device_name = std::to_string(devices) + " x " + first;
  }
  int depth() const { return int(lanes.size()); }
  Lane& lane(int i) {
    Lane& l = *lanes[std::size_t(i)];
    l.on.use();
    return l;
  }
  // Every buffer a conversion of up to these sizes needs, in every lane.
  void reserve(const Engine::Sizes& s) {
    for (std::size_t i = 0; i < lanes.size(); ++i) {
      Lane& l = lane(int(i));
      l.get(0, s.x);
      l.get(1, s.y);
      l.get(2, s.scales);
      l.get(4, 4);
      l.get(5, s.elems * 4);
      l.get(6, sizeof(double) * gpu::kErrorPartials);
      Lane::grow(&bd, l.up[0], s.x);
      Lane::grow(&bd, l.down[1], s.y);
      Lane::grow(&bd, l.down[2], s.scales);
      Lane::grow(&bd, l.down[4], 4);
      Lane::grow(&bd, l.down[6], sizeof(double) * gpu::kErrorPartials);
    }
  }
  std::deque<int> order;  // the lanes in flight, oldest first

  int next_lane() const { return order.empty() ? 0 : (order.back() + 1) % depth(); }
};

#else

struct Engine::Gpu {
  void reserve(const Engine::Sizes&) {}
};

#endif

struct Engine::Hint {
  std::mutex m;
  std::optional<Sizes> sizes;  // given by expect()
  bool set_up = false;         // the set-up thread is past the point where it takes them
};

Engine::Engine(const std::string& device, bool early_cpu, int gpus) : device_(device), early_cpu_(early_cpu) {
  if (device != "cpu" && device != "cuda" && device != "auto")
    throw std::runtime_error("--device '" + device + "': expected cpu, cuda or auto");
  if (gpus < kFirstGpu) throw std::logic_error("Engine: gpus " + std::to_string(gpus) + " (expected kFirstGpu, 0 or more)");
  if (gpus > 0 && device == "cpu") throw std::runtime_error("--gpus " + std::to_string(gpus) + " with --device cpu: expected --device cuda or auto");
  if (device == "cpu") {
    name_ = "cpu";
    why_ = "asked for";
    return;
  }
#if defined(MXQ_TOOL_HAVE_CUDA)
  auto probed = std::make_shared<std::promise<std::string>>();
  probe_ = probed->get_future().share();
  hint_ = std::make_shared<Hint>();
  setup_ = std::async(std::launch::async, [probed, hint = hint_, gpus] {
    std::string why_not;
    const bool usable = cuda_available(&why_not);
    // GPUs asked for by number must all be there (cuda or auto): refused at the probe, before any
    // conversion starts on the CPU meanwhile
    int visible = 0;
    if (usable && gpus > 0 && cudaGetDeviceCount(&visible) != cudaSuccess) visible = 0;
    if (gpus > 0 && (!usable || gpus > visible)) {
      const std::string m = "--gpus " + std::to_string(gpus) + ": " +
                            (usable ? std::to_string(visible) + " CUDA device" + (visible == 1 ? " is" : "s are") +
                                          " visible (CUDA_VISIBLE_DEVICES chooses which)"
                                    : "no usable GPU: " + why_not);
      probed->set_value(m);
      throw GpuCount(m);
    }
    probed->set_value(usable ? std::string() : why_not);
    if (!usable) throw std::runtime_error(why_not);
    auto g = std::make_unique<Gpu>(gpus);
    std::lock_guard<std::mutex> l(hint->m);
    if (hint->sizes) g->reserve(*hint->sizes);
    g->bd.buffers = 0;  // spent here, off the caller's thread
    hint->set_up = true;
    return g;
  });
#else
  std::string why_not;
  const bool usable = cuda_available(&why_not);
  const std::string why = usable ? "this build of the tool has no CUDA support" : "no usable GPU: " + why_not;
  if (device == "cuda") throw std::runtime_error("--device cuda: " + why);
  if (gpus > 0) throw std::runtime_error("--gpus " + std::to_string(gpus) + ": " + why);
  name_ = "cpu";
  why_ = why;
#endif
}

bool Engine::settle(Wait w) const {
  if (!failed_.empty()) throw std::runtime_error(failed_);
  if (!setup_.valid()) return true;
  const auto ready = [](const auto& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; };
  if (w == Wait::no && !ready(setup_)) return false;
  // the probe's answer: an unusable GPU is settled here, before any conversion starts on the CPU
  if (w == Wait::probe && probe_.get().empty() && !ready(setup_)) return false;
  try {
    gpu_ = setup_.get();
#if defined(MXQ_TOOL_HAVE_CUDA)
    name_ = "cuda";
    why_ = (device_ == "cuda" ? "asked for: " : "a GPU is usable: ") + gpu_->device_name;
#endif
  }
#if defined(MXQ_TOOL_HAVE_CUDA)
  catch (const GpuCount& e) {
    failed_ = e.what();
    throw std::runtime_error(failed_);
  }
#endif
  catch (const std::exception& e) {
    if (device_ == "cuda") {
      failed_ = std::string("--device cuda: no usable GPU: ") + e.what();
      throw std::runtime_error(failed_);
    }
    name_ = "cpu";
    why_ = std::string("no usable GPU: ") + e.what();
  }
  return true;
}

bool Engine::gpu() const {
  settle(Wait::all);
  return gpu_ != nullptr;
}

const std::string& Engine::name() const {
  settle(Wait::all);
  return name_;
}

const std::string& Engine::why() const {
  settle(Wait::all);
  return why_;
}

Engine::~Engine() = default;

void Engine::check_idle(const char* what) const {
  if (in_flight_) throw std::logic_error(std::string("Engine::") + what + ": conversions are in flight (finish() them first)");
}

void Engine::check_room() const {
  if (in_flight_ >= depth()) throw std::logic_error("Engine::start_*: depth() conversions are in flight already");
}

double Engine::quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o) {
  check_idle("quantize");
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu()) {
    Lane& g = gpu_->lane(0);
    const Tensor xd = g.stage(0, x, true);
    QuantizedOut qd;
    qd.codes = g.stage(1, q.codes, false);
    qd.scales = g.stage(2, q.scales, false);
    if (q.clip_mask.data) qd.clip_mask = g.stage(3, q.clip_mask, false);
    if (q.tensor_scale) qd.tensor_scale = static_cast<float*>(g.get(4, 4));
    const QuantOptions od = g.on_stream(o);
    g.timer.start(g.stream);
    mxq::quantize(xd, qd, od);
    g.timer.stop(g.stream);
    g.download_now(1, q.codes);
    g.download_now(2, q.scales);
    if (q.clip_mask.data) g.download_now(3, q.clip_mask);
    if (q.tensor_scale) g.download_now(4, q.tensor_scale, 4);
    return g.wait();
  }
#endif
  return wall([&] { mxq::quantize(x, q, o); });
}

double Engine::qdq(const Tensor& x, const Tensor& y, const QuantOptions& o, int reps) {
  check_idle("qdq");
  reps = reps < 1 ? 1 : reps;
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu()) {
    Lane& g = gpu_->lane(0);
    const Tensor xd = g.stage(0, x, true), yd = g.stage(1, y, false);
    const QuantOptions od = g.on_stream(o);
    g.timer.start(g.stream);
    for (int r = 0; r < reps; ++r) mxq::qdq(xd, yd, od);
    g.timer.stop(g.stream);
    g.download_now(1, y);
    return g.wait() / reps;
  }
#endif
  return wall([&] {
           for (int r = 0; r < reps; ++r) mxq::qdq(x, y, o);
         }) /
         reps;
}

double Engine::dequantize(const QuantizedIn& in, const Tensor& y, const QuantOptions& o) {
  check_idle("dequantize");
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu()) {
    Lane& g = gpu_->lane(0);
    const QuantizedIn ind{g.stage(0, in.codes, true), g.stage(2, in.scales, true)};
    const Tensor yd = g.stage(1, y, false);
    const QuantOptions od = g.on_stream(o);
    g.timer.start(g.stream);
    mxq::dequantize(ind, yd, od);
    g.timer.stop(g.stream);
    g.download_now(1, y);
    return g.wait();
  }
#endif
  return wall([&] { mxq::dequantize(in, y, o); });
}

void Engine::expect(const Sizes& s) {
  if (hint_) {
    std::lock_guard<std::mutex> l(hint_->m);
    if (!hint_->set_up) {  // the set-up thread takes them
      hint_->sizes = s;
      return;
    }
  }
  if (gpu()) gpu_->reserve(s);
}

Engine::Breakdown Engine::breakdown() const {
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) return gpu_->bd;
#endif
  return {};
}

int Engine::depth() const {
  settle(Wait::no);
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) return gpu_->depth();
#endif
  return setup_.valid() ? 2 : 1;
}

bool Engine::oldest_ready() const {
  if (!in_flight_) return false;
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (order_.front()) return gpu_->lane(gpu_->order.front()).timer.done();
#endif
  return true;  // converted on the CPU in start_*
}

int Engine::begin_lane() {
#if defined(MXQ_TOOL_HAVE_CUDA)
  const int li = gpu_->next_lane();
  Lane& g = gpu_->lane(li);
  g.dests.clear();
  g.stats = false;
  g.timer.start(g.stream);
  return li;
#else
  throw std::logic_error("Engine::begin_lane: a build without CUDA");
#endif
}

void Engine::queued(int lane) {
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (lane >= 0) {
    Lane& g = gpu_->lane(lane);
    g.timer.stop(g.stream);
    gpu_->order.push_back(lane);
  }
#endif
  if (lane < 0) early_ += setup_.valid();
  order_.push_back(lane >= 0);
  ++in_flight_;
}

void Engine::start_quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o) {
  check_room();
  settle(early_cpu_ ? Wait::probe : Wait::all);
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) {
    const int li = begin_lane();
    Lane& g = gpu_->lane(li);
    const Tensor xd = g.stage(0, x, true);
    QuantizedOut qd;
    qd.codes = g.stage(1, q.codes, false);
    qd.scales = g.stage(2, q.scales, false);
    if (q.clip_mask.data) qd.clip_mask = g.stage(3, q.clip_mask, false);
    if (q.tensor_scale) qd.tensor_scale = static_cast<float*>(g.get(4, 4));
    const QuantOptions od = g.on_stream(o);
    mxq::quantize(xd, qd, od);
    // the statistics: the codes dequantized on the device to fp32 (needs NVFP4's tensor scale in o)
    if (x.stride() == x.cols && (o.format != Format::nvfp4 || o.tensor_scale)) {
      Tensor yd = Tensor::of(g.get(5, std::size_t(x.rows * x.cols) * 4), DType::f32, x.rows, x.cols);
      yd.device = Device::cuda;
      mxq::dequantize(QuantizedIn{qd.codes, qd.scales}, yd, od);
      g.stats_later(xd, yd);
    }
    g.download_later(1, q.codes);
    g.download_later(2, q.scales);
    if (q.clip_mask.data) g.download_later(3, q.clip_mask);
    if (q.tensor_scale) g.download_later(4, q.tensor_scale, 4);
    queued(li);
    return;
  }
#endif
  QuantOptions oc = o;
  oc.backend = Backend::cpu;
  cpu_totals_.push_back(cpu_quantize(x, q, oc));
  queued(-1);
}

void Engine::start_qdq(const Tensor& x, const Tensor& y, const QuantOptions& o) {
  check_room();
  settle(early_cpu_ ? Wait::probe : Wait::all);
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (gpu_) {
    const int li = begin_lane();
    Lane& g = gpu_->lane(li);
    const Tensor xd = g.stage(0, x, true), yd = g.stage(1, y, false);
    mxq::qdq(xd, yd, g.on_stream(o));
    if (x.stride() == x.cols && y.stride() == y.cols) g.stats_later(xd, yd);
    g.download_later(1, y);
    queued(li);
    return;
  }
#endif
  QuantOptions oc = o;
  oc.backend = Backend::cpu;
  cpu_totals_.push_back(cpu_qdq(x, y, oc));
  queued(-1);
}

std::optional<ErrorTotals> Engine::finish() {
  if (!in_flight_) throw std::logic_error("Engine::finish: no conversion in flight");
  const bool on_gpu = order_.front();
  // the slot is free again whatever happens: an error is the conversion's, thrown to the caller
  order_.pop_front();
  --in_flight_;
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (on_gpu) {
    const int li = gpu_->order.front();
    gpu_->order.pop_front();
    return gpu_->lane(li).finish();
  }
#else
  (void)on_gpu;
#endif
  std::optional<ErrorTotals> t = cpu_totals_.front();
  cpu_totals_.pop_front();
  return t;
}

}  // namespace mxq::cli
