#pragma once
// The CUDA runtime as the programs around the library use it (the tool, bench/cuda_bench, the tests):
// one checked call, device buffers, a stream, an event timer and the device's facts, so that none of
// them repeats cudaMalloc / cudaMemcpy / cudaEvent* or the error wording. The library itself reports
// CUDA errors as mxq::Error(device_error) naming the API function (src/cuda/common/device.hpp); here
// the same text is a std::runtime_error. Header-only, in the mxq_support target (support/CMakeLists.txt)
// that the tool, the tests and the benchmarks link. Only for builds with CUDA (MXQ_TOOL_HAVE_CUDA,
// MXQ_TEST_HAVE_CUDA, cuda_bench, linear_bench).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace mxq::cuda_util {

// "what: cudaErrorName (description)", the library's wording of a CUDA error.
inline std::string error_message(cudaError_t e, const std::string& what) {
  return what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Throws std::runtime_error("CUDA: " + error_message) unless e is cudaSuccess; clears a non-sticky
// error first so that later calls start clean (as the library does).
inline void check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error("CUDA: " + error_message(e, what));
}

// check() naming the call itself: MXQ_CUDA_CHECK(cudaMemset(p, 0, n)).
#define MXQ_CUDA_CHECK(expr) ::mxq::cuda_util::check((expr), #expr)

// Device memory of the current device, freed with the object. At least 16 bytes are allocated, so that
// an empty tensor still has an aligned, non-null pointer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) { reserve(n); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }

  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  std::size_t size() const { return n_; }

  // At least n bytes; when it has to grow, the old contents are lost.
  void reserve(std::size_t n) {
    if (p_ && n_ >= n) return;
    cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
    check(cudaMalloc(&p_, std::max<std::size_t>(n, 16)), "cudaMalloc of " + std::to_string(n) + " bytes");
    n_ = n;
  }
  // Every allocated byte set to `byte` (cudaMemset: ordered with the legacy default stream).
  void fill(int byte) { check(cudaMemset(p_, byte, std::max<std::size_t>(n_, 16)), "cudaMemset"); }

  // n bytes from / to host memory: synchronous (cudaMemcpy), or ordered on stream s.
  void upload(const void* host, std::size_t n) { copy(p_, host, n, cudaMemcpyHostToDevice, "copy to the GPU"); }
  void download(void* host, std::size_t n) const { copy(host, p_, n, cudaMemcpyDeviceToHost, "copy from the GPU"); }
  void upload_async(const void* host, std::size_t n, cudaStream_t s) {
    if (n) check(cudaMemcpyAsync(p_, host, n, cudaMemcpyHostToDevice, s), "copy to the GPU");
  }
  void download_async(void* host, std::size_t n, cudaStream_t s) const {
    if (n) check(cudaMemcpyAsync(host, p_, n, cudaMemcpyDeviceToHost, s), "copy from the GPU");
  }

 private:
  static void copy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, const char* what) {
    if (n) check(cudaMemcpy(dst, src, n, kind), what);
  }
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

// Page-locked host memory (cudaHostAlloc), freed with the object: copies from it to the device run
// at the link's speed and asynchronously. Grown as needed; the old contents are lost then.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { cudaFreeHost(p_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* get() const { return p_; }
  std::size_t size() const { return n_; }
  void reserve(std::size_t n) {
    if (p_ && n_ >= n) return;
    cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
    check(cudaHostAlloc(&p_, std::max<std::size_t>(n, 16), cudaHostAllocDefault),
          "cudaHostAlloc of " + std::to_string(n) + " bytes");
    n_ = n;
  }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

// A non-blocking stream of its own.
class Stream {
 public:
  Stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }
  // Waits for everything queued on it; an error names `what` (the work that failed).
  void sync(const std::string& what) const { check(cudaStreamSynchronize(s_), what); }

 private:
  cudaStream_t s_ = nullptr;
};

// GPU time between two events recorded on a stream.
class EventTimer {
 public:
  EventTimer() {
    check(cudaEventCreate(&start_), "cudaEventCreate");
    const cudaError_t e = cudaEventCreate(&stop_);
    if (e != cudaSuccess) cudaEventDestroy(start_);
    check(e, "cudaEventCreate");
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void start(cudaStream_t s = nullptr) { check(cudaEventRecord(start_, s), "cudaEventRecord"); }
  void stop(cudaStream_t s = nullptr) { check(cudaEventRecord(stop_, s), "cudaEventRecord"); }
  // Seconds from start to stop; waits for stop. An error there is the timed work's.
  double seconds() const {
    check(cudaEventSynchronize(stop_), "the timed GPU work");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms / 1e3;
  }
  // Whether the stream has passed stop (seconds() would not wait); an error there is the timed work's.
  bool done() const {
    const cudaError_t e = cudaEventQuery(stop_);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    check(e, "the timed GPU work");
    return true;
  }
  // start, f(), stop and seconds(): f's GPU time on stream s.
  template <class F>
  double time(F&& f, cudaStream_t s = nullptr) {
    start(s);
    f();
    stop(s);
    return seconds();
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// The current device's number and properties.
inline cudaDeviceProp device_properties(int* device = nullptr) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  if (device) *device = dev;
  return prop;
}

}  // namespace mxq::cuda_util
