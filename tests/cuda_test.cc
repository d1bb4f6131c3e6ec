// The CUDA backend against the CPU reference, byte for byte: every format x rule x rounding, every
// input dtype, both scale layouts, awkward shapes, strided rows, every group size, the exhaustive
// bf16 sweep; CUDA-graph capture and replay; errors at the boundary. Skipped (with the reason) where
// no CUDA device is usable, as on the CI machine; scripts/device-check.sh runs it on the GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>

#include <gtest/gtest.h>

#include "helpers.hpp"

using namespace mxq;
using th::HostTensor;
using th::Quantized;

namespace {

#define CUDA_OK(expr)                                                                     \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);            \
  } while (0)

// GTEST_SKIP returns from the calling function, so this is a macro used in the test body itself.
#define REQUIRE_CUDA()                                                              \
  do {                                                                              \
    std::string why_;                                                               \
    if (!cuda_available(&why_)) GTEST_SKIP() << "no usable CUDA device: " << why_; \
  } while (0)

// Device memory, poisoned with 0xA5 so that bytes a kernel fails to write show up.
struct DevBuf {
  void* p = nullptr;
  std::size_t n = 0;
  explicit DevBuf(std::size_t bytes) : n(bytes) {
    if (cudaMalloc(&p, std::max<std::size_t>(n, 16)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    poison();
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void poison() { cudaMemset(p, 0xA5, std::max<std::size_t>(n, 16)); }
};

// A device copy of a HostTensor's layout (same rows, cols, stride and dtype).
struct DevTensor {
  HostTensor shape;  // host mirror (layout and download target)
  std::unique_ptr<DevBuf> buf;
  explicit DevTensor(const HostTensor& h) : shape(h), buf(std::make_unique<DevBuf>(h.bytes.size())) {}
  static DevTensor upload(const HostTensor& h) {
    DevTensor d(h);
    cudaMemcpy(d.buf->p, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice);
    return d;
  }
  Tensor view() const {
    return Tensor::of(buf->p, shape.dtype, shape.rows, shape.cols, shape.stride == shape.cols ? 0 : shape.stride,
                      Device::cuda);
  }
  HostTensor download() const {
    HostTensor h = shape;
    cudaMemcpy(h.bytes.data(), buf->p, h.bytes.size(), cudaMemcpyDeviceToHost);
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
    o.tensor_scale = static_cast<float*>(S.p);
    return o;
  }
  QuantizedIn in() const { return QuantizedIn{codes.view(), scales.view()}; }
  float tensor_scale() const {
    float v = 0;
    cudaMemcpy(&v, S.p, 4, cudaMemcpyDeviceToHost);
    return v;
  }
};

void sync_ok() {
  const cudaError_t e = cudaDeviceSynchronize();
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}

using th::Case;
using th::Shape;

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (Rounding rd : {Rounding::nearest_even, Rounding::stochastic}) {
    th::add_default_cases(rd, v);
    v.push_back({Format::nvfp4, ScaleRule::nvfp4, rd, 32});
    // every other group size, through the C = 2 and C = 8 kernels and T = 1 .. 32 lanes per group
    for (int g : {2, 4, 8, 16, 64, 128, 256}) {
      v.push_back({Format::mxfp4, ScaleRule::quest, rd, g});
      v.push_back({Format::mxfp8_e4m3, ScaleRule::even, rd, g});
    }
    v.push_back({Format::mxint8, ScaleRule::floor, rd, 2});
    v.push_back({Format::mxfp6_e3m2, ScaleRule::rceil, rd, 4});
  }
  return v;
}

std::vector<Shape> shapes_for(int g) {
  return {{1, 1, 0}, {1, g - 1 > 0 ? g - 1 : 1, 0}, {1, g, 0}, {1, g + 1, 0}, {3, 97, 0}, {130, 65, 80},
          {2, 4103, 0}, {16, 1024, 0}, {5, 256, 259}, {257, 96, 0}};
}

class CudaVsReference : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override { REQUIRE_CUDA(); }
};

TEST_P(CudaVsReference, QuantizeDequantizeQdqBitExact) {
  const Case c = GetParam();
  QuantOptions o = c.format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(c.format, c.rule);
  o.rounding = c.rounding;
  o.group_size = c.group;
  o.seed = 0xC0FFEE;
  o.offset = 12345;
  const int g = group_size(o);
  DevBuf workspace(4);
  int seed = 1;
  for (const Shape& s : shapes_for(g)) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      HostTensor x = th::llm_like(dt, s.rows, s.cols, seed++, s.stride);
      if (s.rows >= 3) {  // a NaN block and an Inf block
        x.set(1, 0, NAN);
        x.set(2, s.cols - 1, -INFINITY);
      }
      const DevTensor xd = DevTensor::upload(x);
      for (ScaleLayout layout : {ScaleLayout::linear, ScaleLayout::swizzled}) {
        o.scale_layout = layout;
        const std::string what = th::name_of(o) + " " + std::string(to_string(dt)) + " [" + std::to_string(s.rows) +
                                 ", " + std::to_string(s.cols) + "] stride " + std::to_string(s.stride);
        SCOPED_TRACE(what);
        QuantOptions oref = o, ogpu = o;
        oref.backend = Backend::reference;
        ogpu.backend = Backend::automatic;  // data on the GPU: the CUDA backend
        ogpu.workspace = workspace.p;
        Quantized qr(oref, s.rows, s.cols, true);
        quantize(x.view(), qr.out(), oref);
        DevQuantized qg(ogpu, s.rows, s.cols);
        quantize(xd.view(), qg.out(), ogpu);
        sync_ok();
        th::expect_same_bytes(qr.codes, qg.codes.download(), "codes");
        th::expect_same_bytes(qr.scales, qg.scales.download(), "scales");
        th::expect_same_bytes(qr.mask, qg.mask.download(), "clip mask");
        EXPECT_EQ(std::bit_cast<std::uint32_t>(qr.S), std::bit_cast<std::uint32_t>(qg.tensor_scale())) << "tensor scale";
        // Dequantize the reference codes on the GPU, to every dtype.
        QuantOptions dref = oref, dgpu = ogpu;
        if (c.format == Format::nvfp4) dref.tensor_scale = dgpu.tensor_scale = qr.S;
        const DevTensor rc = DevTensor::upload(qr.codes), rs = DevTensor::upload(qr.scales);
        for (DType ot : {DType::f32, DType::bf16, DType::f16}) {
          HostTensor yr(ot, s.rows, s.cols);
          dequantize(qr.in(), yr.view(), dref);
          DevTensor yg(yr);
          dequantize(QuantizedIn{rc.view(), rs.view()}, yg.view(), dgpu);
          sync_ok();
          th::expect_same_bytes(yr, yg.download(), "dequantize to " + std::string(to_string(ot)));
        }
        if (layout == ScaleLayout::linear) {  // QDQ, out of place and in place
          HostTensor yr(dt, s.rows, s.cols, s.stride);
          qdq(x.view(), yr.view(), oref);
          DevTensor yg(yr);
          qdq(xd.view(), yg.view(), ogpu);
          sync_ok();
          th::expect_same_bytes(yr, yg.download(), "qdq");
          DevTensor z = DevTensor::upload(x);
          qdq(z.view(), z.view(), ogpu);
          sync_ok();
          th::expect_same_bytes(yr, z.download(), "in-place qdq");
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormatsRulesRoundings, CudaVsReference, testing::ValuesIn(all_cases()), th::case_name);

// Every bf16 bit pattern through quantize and QDQ on the GPU (as FastVsReferenceExhaustive does for
// the CPU path): shuffled blocks of 32, and each pattern beside a fixed anchor in a group of 2.
TEST(CudaExhaustive, AllBf16PatternsThroughQuantizeAndQdq) {
  REQUIRE_CUDA();
  const HostTensor shuffled = th::all_bf16_shuffled(), anchored = th::all_bf16_anchored();
  std::vector<QuantOptions> opts = th::sweep_options();
  for (std::size_t i = 0, n = opts.size(); i < n; ++i) {  // and each with stochastic rounding
    QuantOptions sr = opts[i];
    sr.rounding = Rounding::stochastic;
    sr.seed = 99;
    opts.push_back(sr);
  }
  DevBuf workspace(4);
  for (QuantOptions o : opts) {
    for (const HostTensor* x : {&shuffled, &anchored}) {
      o.group_size = x == &anchored ? 2 : 0;
      SCOPED_TRACE(th::name_of(o) + (x == &anchored ? " anchored" : " shuffled"));
      QuantOptions oref = o, ogpu = o;
      oref.backend = Backend::reference;
      ogpu.backend = Backend::cuda;
      ogpu.workspace = workspace.p;
      const DevTensor xd = DevTensor::upload(*x);
      Quantized qr(oref, x->rows, x->cols, true);
      quantize(x->view(), qr.out(), oref);
      DevQuantized qg(ogpu, x->rows, x->cols);
      quantize(xd.view(), qg.out(), ogpu);
      sync_ok();
      th::expect_same_bytes(qr.codes, qg.codes.download(), "codes");
      th::expect_same_bytes(qr.scales, qg.scales.download(), "scales");
      th::expect_same_bytes(qr.mask, qg.mask.download(), "clip mask");
      HostTensor yr(DType::bf16, x->rows, x->cols);
      qdq(x->view(), yr.view(), oref);
      DevTensor yg(yr);
      qdq(xd.view(), yg.view(), ogpu);
      sync_ok();
      th::expect_same_bytes(yr, yg.download(), "qdq");
    }
  }
}

TEST(CudaDequantize, ArbitraryCodeBytesIncludingNaNCodes) {
  REQUIRE_CUDA();
  std::mt19937 rng(3);
  for (Format f : {Format::mxfp4, Format::mxfp6_e2m3, Format::mxfp6_e3m2, Format::mxfp8_e4m3, Format::mxfp8_e5m2, Format::mxint8, Format::nvfp4}) {
    QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(3.0f) : QuantOptions::mx(f, ScaleRule::floor);
    Quantized q(o, 7, 300);
    for (auto& b : q.codes.bytes) b = std::uint8_t(rng());
    for (auto& b : q.scales.bytes) b = std::uint8_t(rng());
    const DevTensor c = DevTensor::upload(q.codes), s = DevTensor::upload(q.scales);
    for (DType ot : {DType::f32, DType::bf16, DType::f16}) {
      HostTensor yr(ot, 7, 300);
      o.backend = Backend::reference;
      dequantize(q.in(), yr.view(), o);
      DevTensor yg(yr);
      o.backend = Backend::cuda;
      dequantize(QuantizedIn{c.view(), s.view()}, yg.view(), o);
      sync_ok();
      th::expect_same_bytes(yr, yg.download(), std::string(to_string(f)) + " random bytes to " + std::string(to_string(ot)));
    }
  }
}

TEST(CudaScales, SwizzleUnswizzleAndAmax) {
  REQUIRE_CUDA();
  std::mt19937 rng(8);
  for (auto [r, c] : {std::pair<int, int>{1, 1}, {130, 7}, {256, 8}, {300, 65}}) {
    HostTensor lin(DType::u8, r, c, c + 3);
    for (auto& b : lin.bytes) b = std::uint8_t(rng());
    HostTensor swr(DType::u8, (r + 127) / 128 * 128, (c + 3) / 4 * 4);
    swizzle_scales(lin.view(), swr.view(), Backend::reference);
    const DevTensor ld = DevTensor::upload(lin);
    DevTensor swg(swr);
    swizzle_scales(ld.view(), swg.view());
    sync_ok();
    th::expect_same_bytes(swr, swg.download(), "swizzle");
    HostTensor back(DType::u8, r, c, c + 3);
    DevTensor bd(back);
    unswizzle_scales(swg.view(), bd.view());
    sync_ok();
    th::expect_same_bytes(lin, bd.download(), "unswizzle");
  }
  HostTensor x = th::llm_like(DType::bf16, 33, 1000, 4, 1003);
  DevTensor xd = DevTensor::upload(x);
  EXPECT_EQ(tensor_amax(xd.view()), tensor_amax(x.view(), Backend::reference));
  x.set(5, 5, -INFINITY);
  xd = DevTensor::upload(x);
  EXPECT_TRUE(std::isinf(tensor_amax(xd.view())));
  x.set(7, 999, NAN);
  xd = DevTensor::upload(x);
  EXPECT_TRUE(std::isnan(tensor_amax(xd.view())));
}

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
  nv.workspace = workspace.p;
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
      CUDA_OK(cudaMemcpy(xd.buf->p, x.bytes.data(), x.bytes.size(), cudaMemcpyHostToDevice));
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
