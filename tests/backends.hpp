#pragma once
// Data on a backend's memory for the backend-vs-reference tests: host memory for the CPU backends,
// device memory (poisoned with 0xA5, so that bytes a kernel fails to write show up) for CUDA.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <mxq/mxq.hpp>

#if defined(MXQ_TEST_HAVE_CUDA)
#include "cuda_util.hpp"  // support/ (mxq_support)
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "helpers.hpp"

namespace th {

// The reason a backend cannot run here ("" when it can).
inline std::string unusable(mxq::Backend b) {
  std::string why;
  if (b == mxq::Backend::cuda && !mxq::cuda_available(&why)) return why;
  return "";
}
// GTEST_SKIP returns from the calling function, so this is a macro used in the test body itself.
#define TH_REQUIRE_BACKEND(b)                                                                    \
  do {                                                                                           \
    const std::string why_ = th::unusable(b);                                                    \
    if (!why_.empty()) GTEST_SKIP() << "backend " << mxq::to_string(b) << " not usable: " << why_; \
  } while (0)

// A HostTensor's layout on a backend: its data in host memory, or a device copy.
class Placed {
 public:
  Placed(mxq::Backend b, const HostTensor& h) : host_(h), device_(b == mxq::Backend::cuda) {
#if defined(MXQ_TEST_HAVE_CUDA)
    if (device_) {
      dev_.reserve(h.bytes.size());
      dev_.upload(h.bytes.data(), h.bytes.size());
    }
#else
    if (device_) throw std::runtime_error("this test build has no CUDA");
#endif
  }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;

  mxq::Tensor view() {
    mxq::Tensor t = host_.view();
    if (device_) {
      t.data = device_data();
      t.device = mxq::Device::cuda;
    }
    return t;
  }
  // The bytes as the backend left them (waits for the device).
  HostTensor get() const {
    HostTensor h = host_;
#if defined(MXQ_TEST_HAVE_CUDA)
    if (device_) {
      MXQ_CUDA_CHECK(cudaDeviceSynchronize());
      dev_.download(h.bytes.data(), h.bytes.size());
    }
#endif
    return h;
  }

 private:
  HostTensor host_;
  bool device_;
#if defined(MXQ_TEST_HAVE_CUDA)
  mxq::cuda_util::DeviceBuffer dev_;
  void* device_data() const { return dev_.get(); }
#else
  void* device_data() const { return nullptr; }
#endif
};

// Four bytes on a backend: the NVFP4 tensor-scale output and the CUDA workspace.
class Scalar {
 public:
  explicit Scalar(mxq::Backend b) : p_(b, HostTensor(mxq::DType::f32, 1, 1)) {}
  float* ptr() { return static_cast<float*>(p_.view().data); }
  float value() const { return p_.get().get(0, 0); }

 private:
  Placed p_;
};

// quantize's outputs (codes, scales, clip mask, tensor scale) on a backend, poisoned.
struct PlacedQuantized {
  Quantized host;  // shapes
  Placed codes, scales, mask;
  Scalar S;
  PlacedQuantized(mxq::Backend b, const mxq::QuantOptions& o, std::int64_t r, std::int64_t k, bool with_mask = true)
      : host(o, r, k, with_mask), codes(b, host.codes), scales(b, host.scales), mask(b, host.mask), S(b) {}
  mxq::QuantizedOut out() {
    mxq::QuantizedOut o;
    o.codes = codes.view();
    o.scales = scales.view();
    if (!host.mask.bytes.empty()) o.clip_mask = mask.view();
    o.tensor_scale = S.ptr();
    return o;
  }
};

// The options for backend b: the backend itself and, on CUDA, a workspace for the NVFP4 amax.
inline mxq::QuantOptions on(mxq::Backend b, mxq::QuantOptions o, Scalar& workspace) {
  o.backend = b;
  if (b == mxq::Backend::cuda) o.workspace = workspace.ptr();
  return o;
}

// Threads for the CPU backend's runs (results must not depend on them); one run elsewhere.
inline std::vector<int> thread_counts(mxq::Backend b) { return b == mxq::Backend::cpu ? std::vector<int>{1, 2, 3} : std::vector<int>{0}; }
inline void set_threads(int n) {
#if defined(_OPENMP)
  if (n > 0) omp_set_num_threads(n);
#else
  (void)n;
#endif
}

}  // namespace th
