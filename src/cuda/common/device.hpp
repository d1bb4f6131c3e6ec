#pragma once
// Host-side helpers of the CUDA backend: CUDA errors as mxq::Error(device_error), pointer checks for
// the entry layer's validation, device facts. The one place that turns a cudaError_t into an error.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace mxq::cuda {

// Throws mxq::Error(device_error) for fn: "what: cudaErrorName (description)"; clears a non-sticky
// error first so that later calls start clean.
[[noreturn]] void device_fail(const char* fn, const std::string& what, cudaError_t e);
inline void check(cudaError_t e, const char* fn, const std::string& what) {
  if (e != cudaSuccess) device_fail(fn, what, e);
}
// After a kernel launch: a launch the runtime refused is an error, never a silently unwritten output.
void check_launch(const char* fn, const char* kernel);

// SMs and L2 bytes of the current device.
int sm_count(const char* fn);
int l2_bytes(const char* fn);
// The current device's compute capability, major * 10 + minor.
int compute_capability(const char* fn);

// Blocks of kThreads threads for `threads` threads; refuses grids past the hardware's x limit.
std::int64_t launch_blocks(const char* fn, std::int64_t threads);

inline bool aligned(const void* ptr, std::int64_t stride_bytes, int a) {
  return reinterpret_cast<std::uintptr_t>(ptr) % a == 0 && stride_bytes % a == 0;
}

}  // namespace mxq::cuda
