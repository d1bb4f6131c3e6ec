#include "cuda/common/device.hpp"

#include <atomic>

#include <mxq/ops.hpp>

#include "core/validate.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/config.cuh"

namespace mxq::cuda {

void device_fail(const char* fn, const std::string& what, cudaError_t e) {
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  core::fail(Error::Code::device_error, fn, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void check_launch(const char* fn, const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) device_fail(fn, std::string("launching ") + kernel, e);
}

int sm_count(const char* fn) {
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn, "cudaDeviceGetAttribute");
  return sms;
}

int compute_capability(const char* fn) {
  // Queried once per device (the hot paths call this per launch); 0 marks a device not yet asked.
  static std::atomic<int> cache[64] = {};
  int dev = 0, major = 0, minor = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  if (dev >= 0 && dev < 64) {
    const int cc = cache[dev].load(std::memory_order_relaxed);
    if (cc != 0) return cc;
  }
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), fn, "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), fn, "cudaDeviceGetAttribute");
  if (dev >= 0 && dev < 64) cache[dev].store(major * 10 + minor, std::memory_order_relaxed);
  return major * 10 + minor;
}

int l2_bytes(const char* fn) {
  int dev = 0, bytes = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  check(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev), fn, "cudaDeviceGetAttribute");
  return bytes;
}

std::int64_t launch_blocks(const char* fn, std::int64_t threads) {
  const std::int64_t b = (threads + kThreads - 1) / kThreads;
  if (b > 0x7FFFFFFF)
    core::fail(Error::Code::unsupported, fn, "tensor too large for one launch (" + std::to_string(threads) + " chunks)");
  return b;
}

int device_sm() { return compute_capability("linear_plan"); }

bool available(std::string* why_not) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why_not) *why_not = std::string("no usable CUDA driver/device: ") + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    if (why_not) *why_not = "no CUDA device present";
    return false;
  }
  return true;
}

// The view's memory must be device (or managed) memory of the current device: a host pointer marked
// Device::cuda would fault inside the kernel, so the entry layer refuses it.
void check_device_pointer(const char* fn, const char* arg, const void* ptr) {
  if (ptr == nullptr) return;
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) device_fail(fn, std::string("argument '") + arg + "': cudaPointerGetAttributes", e);
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    core::fail(Error::Code::invalid_argument, fn,
               std::string("argument '") + arg + "' is marked Device::cuda but points to " +
                   (a.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory") +
                   "; the CUDA backend needs device memory (mxq never copies between host and device)");
  int cur = 0;
  check(cudaGetDevice(&cur), fn, "cudaGetDevice");
  if (a.device != cur)
    core::fail(Error::Code::invalid_argument, fn,
               std::string("argument '") + arg + "' is on CUDA device " + std::to_string(a.device) +
                   " but the current device is " + std::to_string(cur) + "; call cudaSetDevice first");
}

}  // namespace mxq::cuda
