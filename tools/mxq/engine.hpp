#pragma once
// Where the tool's conversions run: on the CPU with the host tensors themselves, or on the GPU with
// the host tensors staged through device buffers (grown as needed, reused from tensor to tensor).
// The results are the same bytes either way (the backends are bit-exact with the reference).
#include <deque>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include <mxq/mxq.hpp>

#include "gpu_stats.hpp"

namespace mxq::cli {

class Engine {
 public:
  // device: "cpu", "cuda" or "auto" (the GPU when one is usable); anything else fails naming the
  // accepted values. For "cuda" and "auto" the GPU is probed and set up (driver, context, streams: a
  // few tenths of a second) on a thread of its own while the caller goes on: the first call that
  // needs the choice waits for it, and there "cuda" without a usable GPU fails, naming why. With
  // early_cpu, start_quantize / start_qdq convert on the CPU (the same bytes) while a usable GPU's
  // context is being created (they wait for the probe itself).
  // gpus: how many of the visible GPUs the conversions use: kFirstGpu (the default) the first one, 0
  // all, N > 0 the first N as the user asked (--gpus N: with --device cpu, more than are visible, or
  // with no usable GPU, refused, the last two at the probe, naming the count). start_quantize /
  // start_qdq spread the conversions over the GPUs in turn; the one-shot API uses the first.
  static constexpr int kFirstGpu = -1;
  explicit Engine(const std::string& device, bool early_cpu = false, int gpus = kFirstGpu);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  bool gpu() const;
  // The choice is made (gpu(), name() would not wait); probe: waits for the GPU's probe (throws for
  // "cuda" without a usable GPU), not for the rest of its set-up.
  bool settled(bool probe = false) const { return settle(probe ? Wait::probe : Wait::no); }
  const std::string& name() const;  // "cpu" or "cuda"
  const std::string& why() const;   // how the choice was made, for one line of output
  // Conversions started on the CPU while the GPU was being set up.
  int converted_while_setting_up() const { return early_; }

  // Host tensors in, host tensors out (dense rows). Each returns the seconds the operation itself took
  // (on the GPU: between events around the kernels, transfers excluded).
  double quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o);
  // qdq: reps > 1 runs it that many times back to back and returns the mean.
  double qdq(const Tensor& x, const Tensor& y, const QuantOptions& o, int reps = 1);
  double dequantize(const QuantizedIn& in, const Tensor& y, const QuantOptions& o);

  // Conversions overlapped with the host's work (the checkpoint conversion). start_quantize and
  // start_qdq begin a conversion with its error statistics and return once x has been read (its memory
  // may be released then); the outputs' host memory (q's, y's) must stay alive and is written by the
  // time finish() returns that conversion. Conversions finish in the order started. The GPU engine keeps
  // up to depth() = 2 per GPU in flight, each with a stream and buffers of its own, the GPUs taken in
  // turn: the next tensor's staging copy and upload overlap the previous one's kernels and download, and
  // with several GPUs the tensors convert side by side. The CPU engine converts in
  // start_* (depth 1), a band of rows at a time with each band's statistics while it is in cache.
  // finish() waits for the oldest and returns its statistics (dense x, linear scales, no clip mask,
  // NVFP4 with o.tensor_scale; on the CPU also no stochastic rounding or random signs); otherwise
  // none: the caller sums them on the host. Starting beyond depth() is refused (std::logic_error),
  // as is the one-shot API above while conversions are in flight.
  int depth() const;
  int in_flight() const { return in_flight_; }
  bool oldest_ready() const;  // finish() would not wait (false when none is in flight)
  void start_quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o);
  void start_qdq(const Tensor& x, const Tensor& y, const QuantOptions& o);
  std::optional<ErrorTotals> finish();

  // The largest conversion to come (bytes of its input, of its codes or y, of its scales; elements):
  // the GPU engine sizes its buffers once, on the set-up thread when that is still running, instead
  // of growing them tensor by tensor on the caller's. Nothing on the CPU engine.
  struct Sizes {
    std::size_t x = 0, y = 0, scales = 0, elems = 0;
  };
  void expect(const Sizes& s);

  // Where the GPU engine's conversion time went (seconds, host wall time): copying inputs into
  // page-locked staging, growing device and page-locked buffers, waiting for the GPU in finish(),
  // copying results out of page-locked memory.
  struct Breakdown {
    double staging = 0, buffers = 0, waiting = 0, results = 0;
  };
  Breakdown breakdown() const;

 private:
  struct Gpu;
  void check_idle(const char* what) const;
  void check_room() const;
  // Takes the set-up's outcome when it is there; true when it is settled. Wait::all waits for it,
  // Wait::probe for the probe only (an unusable GPU is settled then), Wait::no for nothing.
  enum class Wait { no, probe, all };
  bool settle(Wait w) const;
  // start_quantize's and start_qdq's bookkeeping: the GPU lane a conversion takes (its index; CUDA
  // builds), and the conversion queued once enqueued on that lane (lane >= 0) or done on the CPU
  // (lane -1, its statistics already in cpu_totals_).
  int begin_lane();
  void queued(int lane);
  std::string device_;
  bool early_cpu_;
  struct Hint;
  std::shared_ptr<Hint> hint_;  // expect()'s sizes, for the set-up thread
  mutable std::future<std::unique_ptr<Gpu>> setup_;  // the GPU's set-up in flight
  mutable std::shared_future<std::string> probe_;     // its first step: "" when a GPU is usable, else why not
  mutable std::unique_ptr<Gpu> gpu_;
  mutable std::string name_, why_, failed_;
  std::deque<bool> order_;  // the conversions in flight, oldest first: true on the GPU
  std::deque<std::optional<ErrorTotals>> cpu_totals_;  // those on the CPU: their statistics
  int in_flight_ = 0, early_ = 0;
};

}  // namespace mxq::cli
