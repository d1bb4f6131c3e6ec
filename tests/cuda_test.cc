// What only the CUDA backend has: CUDA-graph capture and replay, streams, device-memory errors at the
// boundary. (Its bytes are checked against the reference with every other backend's by
// quantize_test, dequantize_test, qdq_test and layout_test.) Skipped (with the reason) where no CUDA
// device is usable, as on the CI machine; scripts/device-check.sh runs it on the GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>

#include <gtest/gtest.h>

#include "cuda_util.hpp"  // support/ (mxq_support)
#include "helpers.hpp"

using namespace mxq;
using th::HostTensor;
using th::Quantized;
namespace cuda_util = mxq::cuda_util;

namespace {

#define CUDA_OK(expr)                                                                     \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    ASSERT_EQ(err_, cudaSuccess) << cuda_util::error_message(err_, #expr);                \
  } while (0)

// GTEST_SKIP returns from the calling function, so this is a macro used in the test body itself.
#define REQUIRE_CUDA()                                                              \
  do {                                                                              \
    std::string why_;                                                               \
    if (!cuda_available(&why_)) GTEST_SKIP() << "no usable CUDA device: " << why_; \
  } while (0)

// Device memory, poisoned with 0xA5 so that bytes a kernel fails to write show up.
struct DevBuf : cuda_util::DeviceBuffer {
  explicit DevBuf(std::size_t bytes) : DeviceBuffer(bytes) { poison(); }
  void poison() { fill(0xA5); }
};

// A device copy of a HostTensor's layout (same rows, cols, stride and dtype).
struct DevTensor {
  HostTensor shape;  // host mirror (layout and download target)
  std::unique_ptr<DevBuf> buf;
  explicit DevTensor(const HostTensor& h) : shape(h), buf(std::make_unique<DevBuf>(h.bytes.size())) {}
  static DevTensor upload(const HostTensor& h) {
    DevTensor d(h);
    d.buf->upload(h.bytes.data(), h.bytes.size());
    return d;
  }
  Tensor view() const {
    return Tensor::of(buf->get(), shape.dtype, shape.rows, shape.cols, shape.stride == shape.cols ? 0 : shape.stride,
                      Device::cuda);
  }
  HostTensor download() const {
    HostTensor h = shape;
    buf->download(h.bytes.data(), h.bytes.size());
    return h;
  }
};

// Quantized outputs in device memory.
struct DevQuantized {
  Quantized host;  // shapes
  DevTensor codes, scales, mask;
  DevBuf S{4};
  DevQuantized(const QuantOptions& o, std::int64_t r, std::int64_t k)
      : host(o, r, k, true), codes(host.codes), scales(host.scales), mask(host.mask) {}
  QuantizedOut out() {
    QuantizedOut o;
    o.codes = codes.view();
    o.scales = scales.view();
    o.clip_mask = mask.view();
    o.tensor_scale = S.as<float>();
    return o;
  }
  QuantizedIn in() const { return QuantizedIn{codes.view(), scales.view()}; }
  float tensor_scale() const {
    float v = 0;
    S.download(&v, 4);
    return v;
  }
};

void sync_ok() { CUDA_OK(cudaDeviceSynchronize()); }

// The ops captured in a CUDA graph (no allocation, no synchronisation inside), replayed twice with
// different inputs; every output checked against the reference.
TEST(CudaGraph, CaptureAndReplayMatchesReference) {
  REQUIRE_CUDA();
  const std::int64_t R = 64, K = 4096;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  HostTensor x = th::llm_like(DType::bf16, R, K, 21);
  DevTensor xd = DevTensor::upload(x);
  DevBuf workspace(4);
  QuantOptions mx = QuantOptions::mx(Format::mxfp4, ScaleRule::even), nv = QuantOptions::nvfp4();
  mx.scale_layout = ScaleLayout::swizzled;
  mx.stream = nv.stream = s;
  nv.workspace = workspace.get();
  DevQuantized q(mx, R, K);
  HostTensor y0(DType::bf16, R, K);
  DevTensor y_mx(y0), y_nv(y0), y_dq(y0);

  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  qdq(xd.view(), y_mx.view(), mx);
  qdq(xd.view(), y_nv.view(), nv);  // tensor amax reduced on the device, in the graph
  quantize(xd.view(), q.out(), mx);
  dequantize(q.in(), y_dq.view(), mx);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    if (replay == 1) {
      x = th::llm_like(DType::bf16, R, K, 77);
      xd.buf->upload(x.bytes.data(), x.bytes.size());
    }
    for (DevBuf* b : {y_mx.buf.get(), y_nv.buf.get(), y_dq.buf.get(), q.codes.buf.get(), q.scales.buf.get()}) b->poison();
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    QuantOptions rmx = mx, rnv = nv;
    rmx.backend = rnv.backend = Backend::reference;
    HostTensor e_mx(DType::bf16, R, K), e_nv(DType::bf16, R, K), e_dq(DType::bf16, R, K);
    qdq(x.view(), e_mx.view(), rmx);
    qdq(x.view(), e_nv.view(), rnv);
    Quantized qr(rmx, R, K, true);
    quantize(x.view(), qr.out(), rmx);
    dequantize(qr.in(), e_dq.view(), rmx);
    th::expect_same_bytes(e_mx, y_mx.download(), "graph qdq mxfp4");
    th::expect_same_bytes(e_nv, y_nv.download(), "graph qdq nvfp4 (computed tensor scale)");
    th::expect_same_bytes(qr.codes, q.codes.download(), "graph quantize codes");
    th::expect_same_bytes(qr.scales, q.scales.download(), "graph quantize swizzled scales");
    th::expect_same_bytes(e_dq, y_dq.download(), "graph dequantize");
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

TEST(CudaErrors, ClearMessagesNeverSilentOutput) {
  REQUIRE_CUDA();
  HostTensor x = th::llm_like(DType::bf16, 4, 64, 1);
  const DevTensor xd = DevTensor::upload(x);
  DevTensor yd(x);
  // A host pointer marked as device memory.
  Tensor bad = x.view();
  bad.device = Device::cuda;
  try {
    qdq(bad, yd.view(), QuantOptions::mx(Format::mxfp4, ScaleRule::floor));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(int(e.code()), int(Error::Code::invalid_argument));
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
  }
  // NVFP4 with a computed tensor scale needs somewhere on the device to reduce the amax.
  try {
    qdq(xd.view(), yd.view(), QuantOptions::nvfp4());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
  // Backends that cannot reach device data refuse it.
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  o.backend = Backend::cpu;
  EXPECT_THROW(qdq(xd.view(), yd.view(), o), Error);
  // A launch that the runtime refuses is an error, not a silently unwritten output: launching on the
  // legacy default stream while another stream captures in global mode is illegal.
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));  // a blocking stream: the legacy stream would have to wait on it
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  bool threw = false;
  try {
    qdq(xd.view(), yd.view(), QuantOptions::mx(Format::mxfp4, ScaleRule::floor));  // legacy stream
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(int(e.code()), int(Error::Code::device_error)) << e.what();
  }
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(s, &g);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
  EXPECT_TRUE(threw);
  CUDA_OK(cudaStreamDestroy(s));
}

}  // namespace
