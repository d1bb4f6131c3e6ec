// The W4A16 linear on the GPU against cuBLAS bf16 (cublasGemmEx, what torch.matmul calls) in the same
// run. Byte model: weight bytes = packed codes + scales (MXFP4 0.53125 B per element, NVFP4 0.5625,
// bf16 2), plus x and y; FLOPs = 2 M N K. Every timed run starts with the L2 flushed (a memset of twice
// its size); the median of --reps runs is reported. Decode rows also run as a CUDA graph of --layers
// distinct layers (weights larger than L2 in total), reported per layer.
//
//   linear_bench [--quick] [--reps R] [--layers L] [--format mxfp4|nvfp4|both]
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <mxq/mxq.hpp>

#include "cuda_util.hpp"

using mxq::cuda_util::DeviceBuffer;
using mxq::cuda_util::EventTimer;

namespace {

cudaStream_t g_stream = nullptr;
DeviceBuffer* g_flush = nullptr;
std::size_t g_flush_bytes = 0;

void flush_l2() { MXQ_CUDA_CHECK(cudaMemsetAsync(g_flush->get(), 0x5A, g_flush_bytes, g_stream)); }

template <class F>
double median_us(int reps, F&& f) {
  EventTimer t;
  std::vector<double> us;
  f();  // warm-up
  MXQ_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  for (int r = 0; r < reps; ++r) {
    flush_l2();
    us.push_back(t.time(f, g_stream) * 1e6);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "linear_bench: %s failed (cuBLAS status %d)\n", what, int(s));
    std::exit(1);
  }
}

// A random quantized weight prepacked on the host, then on the device; bf16 weights of the same shape for
// cuBLAS (random values: the time does not depend on them).
struct Layer {
  mxq::PackedWeight w;
  DeviceBuffer codes, scales, wbf16;
};
Layer make_layer(mxq::Format f, std::int64_t N, std::int64_t K, std::uint32_t seed, bool with_bf16) {
  const int g = f == mxq::Format::nvfp4 ? 16 : 32;
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> codes(std::size_t(N * K / 2)), scales(std::size_t(N * K / g));
  for (auto& b : codes) b = std::uint8_t(rng());
  for (auto& b : scales) b = f == mxq::Format::nvfp4 ? std::uint8_t(0x28 + rng() % 0x30) : std::uint8_t(115 + rng() % 10);
  const mxq::PackedLayout L = mxq::packed_layout(f, N, K);
  std::vector<std::uint8_t> pc(std::size_t(L.codes.rows * L.codes.cols)), ps(std::size_t(L.scales.rows * L.scales.cols));
  Layer l;
  l.w.format = f;
  l.w.N = N;
  l.w.K = K;
  l.w.codes = mxq::Tensor::of(pc.data(), mxq::DType::u8, L.codes.rows, L.codes.cols);
  l.w.scales = mxq::Tensor::of(ps.data(), mxq::DType::u8, L.scales.rows, L.scales.cols);
  l.w.tensor_scale = 100.0f;
  mxq::QuantOptions o = f == mxq::Format::nvfp4 ? mxq::QuantOptions::nvfp4(1.0f) : mxq::QuantOptions::mx(f, mxq::ScaleRule::floor);
  mxq::prepack({mxq::Tensor::of(codes.data(), mxq::DType::u8, N, K / 2), mxq::Tensor::of(scales.data(), mxq::DType::u8, N, K / g)}, o, l.w);
  l.codes.reserve(pc.size());
  l.codes.upload(pc.data(), pc.size());
  l.scales.reserve(ps.size());
  l.scales.upload(ps.data(), ps.size());
  l.w.codes.data = l.codes.get();
  l.w.codes.device = mxq::Device::cuda;
  l.w.scales.data = l.scales.get();
  l.w.scales.device = mxq::Device::cuda;
  if (with_bf16) {
    std::vector<std::uint16_t> wb(std::size_t(N * K));
    for (auto& v : wb) v = mxq::f32_to_bf16(float(int(rng() % 13) - 6) * 0.01f);
    l.wbf16.reserve(wb.size() * 2);
    l.wbf16.upload(wb.data(), wb.size() * 2);
  }
  return l;
}

double copy_limit_gbs() {
  const std::size_t bytes = std::size_t(1) << 30;
  DeviceBuffer a(bytes), b(bytes);
  const double us = median_us(10, [&] { MXQ_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, g_stream)); });
  return 2.0 * bytes / us / 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int reps = 50, layers = 16;
  std::string fmt = "both";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--layers" && i + 1 < argc) layers = std::atoi(argv[++i]);
    else if (a == "--format" && i + 1 < argc) fmt = argv[++i];
    else {
      std::fprintf(stderr, "usage: linear_bench [--quick] [--reps R] [--layers L] [--format mxfp4|nvfp4|both]\n");
      return 2;
    }
  }
  const cudaDeviceProp prop = mxq::cuda_util::device_properties();
  MXQ_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  g_flush_bytes = std::size_t(std::max(prop.l2CacheSize, 1 << 20)) * 2;
  g_flush = new DeviceBuffer(g_flush_bytes);
  cublasHandle_t h;
  check_cublas(cublasCreate(&h), "cublasCreate");
  check_cublas(cublasSetStream(h, g_stream), "cublasSetStream");
  const double copy = copy_limit_gbs();
  std::printf("# mxq W4A16 linear vs cuBLAS bf16: %s, %d SMs, copy %.0f GB/s (1 GiB D2D, read + write)\n", prop.name,
              prop.multiProcessorCount, copy);
  std::printf("# bf16 activations; cold L2; median of %d; weight GB/s = packed weight bytes / time; %% copy = (weight + x + y bytes) / time / copy\n", reps);
  std::printf("%-6s %-12s %5s %9s %9s %8s %7s %8s %9s %8s\n", "format", "N x K", "M", "mxq us", "cuBLAS us", "x cuBLAS",
              "%copy", "w GB/s", "TFLOP/s", "plan");

  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4096}, {14336, 4096}, {4096, 14336}, {8192, 8192}, {28672, 8192}, {2880, 2880}};
  std::vector<std::int64_t> Ms = {1, 16, 64, 128, 256, 1024, 4096};
  if (quick) {
    shapes = {{4096, 4096}, {8192, 8192}, {2880, 2880}};
    Ms = {1, 16, 64, 256, 1024};
  }
  std::vector<mxq::Format> formats;
  if (fmt == "mxfp4" || fmt == "both") formats.push_back(mxq::Format::mxfp4);
  if (fmt == "nvfp4" || fmt == "both") formats.push_back(mxq::Format::nvfp4);

  const std::int64_t maxM = *std::max_element(Ms.begin(), Ms.end());
  for (auto [N, K] : shapes) {
    DeviceBuffer x(std::size_t(maxM * K * 2)), y(std::size_t(maxM * N * 2)), yb(std::size_t(maxM * N * 2));
    MXQ_CUDA_CHECK(cudaMemset(x.get(), 0x3C, x.size()));  // bf16 0x3C3C ~ 0.0115
    for (mxq::Format f : formats) {
      Layer l = make_layer(f, N, K, std::uint32_t(N + K), f == formats.front());
      static DeviceBuffer* wbf16 = nullptr;
      if (f == formats.front()) wbf16 = &l.wbf16;
      const double wbytes = double(l.w.codes.rows * l.w.codes.cols + l.w.scales.rows * l.w.scales.cols);
      for (std::size_t mi = 0; mi < Ms.size(); ++mi) {
        const std::int64_t M = Ms[mi];
        const mxq::Tensor xt = mxq::Tensor::of(x.get(), mxq::DType::bf16, M, K, 0, mxq::Device::cuda);
        const mxq::Tensor yt = mxq::Tensor::of(y.get(), mxq::DType::bf16, M, N, 0, mxq::Device::cuda);
        const double us = median_us(reps, [&] { mxq::linear(xt, l.w, nullptr, yt, mxq::Backend::cuda, g_stream); });
        double cub = 0;
        if (f == formats.front()) {
          const float alpha = 1.0f, beta = 0.0f;
          cub = median_us(reps, [&] {
            check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, wbf16->get(), CUDA_R_16BF, int(K),
                                      x.get(), CUDA_R_16BF, int(K), &beta, yb.get(), CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT),
                         "cublasGemmEx");
          });
        }
        static double cub_by_m[64];
        if (f == formats.front()) cub_by_m[mi] = cub;
        cub = cub_by_m[mi];
        const double bytes = wbytes + double(M * K * 2 + M * N * 2);
        char shape[32];
        std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)N, (long long)K);
        std::printf("%-6s %-12s %5lld %9.2f %9.2f %8.2f %6.1f%% %8.0f %9.1f  %s\n", std::string(mxq::to_string(f)).c_str(), shape,
                    (long long)M, us, cub, cub / us, 100.0 * bytes / us / 1e3 / copy, wbytes / us / 1e3,
                    2.0 * M * N * K / us / 1e6, mxq::linear_plan(l.w, M).c_str());
        std::fflush(stdout);
      }
    }
  }

  // Decode in a CUDA graph: `layers` distinct layers of one shape, replayed; time per layer (L2 warm
  // only as far as the layers' weights fit, which at these sizes they do not).
  std::printf("\n# decode in a CUDA graph of %d distinct layers (per-layer us, median of %d replays)\n", layers, reps);
  std::printf("%-6s %-12s %5s %9s %9s %8s\n", "format", "N x K", "M", "mxq us", "cuBLAS us", "x cuBLAS");
  for (auto [N, K] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 4096}, {8192, 8192}}) {
    for (mxq::Format f : formats) {
      std::vector<Layer> ls;
      for (int i = 0; i < layers; ++i) ls.push_back(make_layer(f, N, K, std::uint32_t(1000 + i), f == formats.front()));
      DeviceBuffer x(std::size_t(16 * K * 2)), y(std::size_t(16 * N * 2));
      MXQ_CUDA_CHECK(cudaMemset(x.get(), 0x3C, x.size()));
      for (std::int64_t M : {1, 16}) {
        static double cub_graph[2];
        const mxq::Tensor xt = mxq::Tensor::of(x.get(), mxq::DType::bf16, M, K, 0, mxq::Device::cuda);
        const mxq::Tensor yt = mxq::Tensor::of(y.get(), mxq::DType::bf16, M, N, 0, mxq::Device::cuda);
        auto graph_us = [&](auto&& body) {
          cudaGraph_t gr;
          cudaGraphExec_t ge;
          MXQ_CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
          body();
          MXQ_CUDA_CHECK(cudaStreamEndCapture(g_stream, &gr));
          MXQ_CUDA_CHECK(cudaGraphInstantiate(&ge, gr, 0));
          const double us = median_us(reps, [&] { MXQ_CUDA_CHECK(cudaGraphLaunch(ge, g_stream)); });
          cudaGraphExecDestroy(ge);
          cudaGraphDestroy(gr);
          return us / layers;
        };
        const double us = graph_us([&] {
          for (auto& l : ls) mxq::linear(xt, l.w, nullptr, yt, mxq::Backend::cuda, g_stream);
        });
        double cub = 0;
        if (f == formats.front()) {
          const float alpha = 1.0f, beta = 0.0f;
          cub = graph_us([&] {
            for (auto& l : ls)
              check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, l.wbf16.get(), CUDA_R_16BF, int(K),
                                        x.get(), CUDA_R_16BF, int(K), &beta, y.get(), CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT),
                           "cublasGemmEx");
          });
        }
        if (f == formats.front()) cub_graph[M == 16] = cub;
        cub = cub_graph[M == 16];
        char shape[32];
        std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)N, (long long)K);
        std::printf("%-6s %-12s %5lld %9.2f %9.2f %8.2f\n", std::string(mxq::to_string(f)).c_str(), shape, (long long)M, us, cub,
                    cub > 0 ? cub / us : 0.0);
        std::fflush(stdout);
      }
    }
  }
  cublasDestroy(h);
  delete g_flush;
  return 0;
}
