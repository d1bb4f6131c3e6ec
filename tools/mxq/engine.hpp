#pragma once
// Where the tool's conversions run: on the CPU with the host tensors themselves, or on the GPU with
// the host tensors staged through device buffers (grown as needed, reused from tensor to tensor).
// The results are the same bytes either way (the backends are bit-exact with the reference).
#include <memory>
#include <string>

#include <mxq/mxq.hpp>

#include "gpu_stats.hpp"

namespace mxq::cli {

class Engine {
 public:
  // device: "cpu", "cuda" or "auto" (the GPU when one is usable). "cuda" without a usable GPU fails,
  // naming why; anything else fails naming the accepted values.
  explicit Engine(const std::string& device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  bool gpu() const { return gpu_ != nullptr; }
  const std::string& name() const { return name_; }  // "cpu" or "cuda"
  const std::string& why() const { return why_; }    // how the choice was made, for one line of output

  // Host tensors in, host tensors out (dense rows). Each returns the seconds the operation itself took
  // (on the GPU: between events around the kernels, transfers excluded).
  double quantize(const Tensor& x, const QuantizedOut& q, const QuantOptions& o);
  // qdq: reps > 1 runs it that many times back to back and returns the mean.
  double qdq(const Tensor& x, const Tensor& y, const QuantOptions& o, int reps = 1);
  double dequantize(const QuantizedIn& in, const Tensor& y, const QuantOptions& o);

  // The error statistics of the conversion just made, on the GPU, where its input and result still
  // are: quantize_error right after quantize(x, q, o) (the codes dequantized there to fp32, with o),
  // qdq_error right after qdq(x, y, o). False on the CPU engine, for tensors with strided rows and
  // for NVFP4 without o.tensor_scale: the caller computes them on the host then.
  bool quantize_error(const Tensor& x, const QuantizedOut& q, const QuantOptions& o, ErrorTotals& t);
  bool qdq_error(const Tensor& x, const Tensor& y, ErrorTotals& t);

 private:
  struct Gpu;
  std::unique_ptr<Gpu> gpu_;
  std::string name_, why_;
};

}  // namespace mxq::cli
