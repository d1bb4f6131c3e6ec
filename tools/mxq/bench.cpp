// `mxq bench`: each operation x format on each usable backend at the given shapes: us, GB/s, % of
// the memcpy bandwidth measured here on the same device, and the speed-up over the reference.
//
// Byte model (what must cross memory once): QDQ in + out; quantize input + codes + scales;
// dequantize the reverse. Median of --reps runs after one warm-up. CPU memcpy: all hardware threads
// copying disjoint slices of a buffer larger than the caches. GPU: device-to-device cudaMemcpy.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <mxq/mxq.hpp>

#include "commands.hpp"
#include "convert.hpp"

#if defined(MXQ_TOOL_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "stats.hpp"  // bench/

namespace mxq::cli {

namespace {

using mxq::bench::median;

double time_host(const std::function<void()>& f, int reps) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

// Read + write bytes per second of a parallel memcpy of 256 MiB.
double host_memcpy_bandwidth() {
  const std::size_t n = 256u << 20;
  std::vector<std::uint8_t> a(n, 1), b(n, 0);
  const unsigned th = std::max(1u, std::thread::hardware_concurrency());
  const double s = time_host(
      [&] {
        std::vector<std::thread> ts;
        for (unsigned i = 0; i < th; ++i)
          ts.emplace_back([&, i] {
            const std::size_t lo = n * i / th, hi = n * (i + 1) / th;
            std::memcpy(b.data() + lo, a.data() + lo, hi - lo);
          });
        for (auto& t : ts) t.join();
      },
      5);
  return 2.0 * double(n) / s;
}

struct Op {
  const char* name;
  double bytes;
};

}  // namespace

int run_bench(const BenchArgs& a) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (const std::string& s : a.shapes) {
    std::int64_t r = 0, k = 0;
    char x = 0;
    std::istringstream is(s);
    if (!(is >> r >> x >> k) || x != 'x' || r <= 0 || k <= 0)
      throw std::runtime_error("--shape '" + s + "': expected ROWSxCOLS, e.g. 1024x4096");
    shapes.push_back({r, k});
  }
  std::vector<Format> formats;
  for (const std::string& f : a.formats) formats.push_back(parse_format(f == "mxfp8" ? "mxfp8_e4m3" : f));

  std::string why;
  const bool cuda = cuda_available(&why);
  const double host_bw = host_memcpy_bandwidth();
  fmt::print("mxq bench: host memcpy {:.1f} GB/s ({} threads, read + write)", host_bw / 1e9, std::thread::hardware_concurrency());
#if defined(MXQ_TOOL_HAVE_CUDA)
  double dev_bw = 0;
  if (cuda && a.gpu) {
    const std::size_t n = 1u << 30;
    void *s = nullptr, *d = nullptr;
    cudaMalloc(&s, n);
    cudaMalloc(&d, n);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<double> t;
    for (int i = 0; i < 6; ++i) {
      cudaEventRecord(e0);
      cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (i) t.push_back(ms / 1e3);
    }
    dev_bw = 2.0 * double(n) / median(t);
    cudaFree(s), cudaFree(d);
    fmt::print("; device copy {:.1f} GB/s", dev_bw / 1e9);
  }
#endif
  fmt::print("{}\n", cuda ? "" : "; cuda: " + why);
  fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11} {:>9} {:>9} {:>8}\n", "op", "format", "shape", "backend", "us", "GB/s",
             "% copy", "x ref");

  for (const auto& [rows, K] : shapes) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::uint16_t> x(rows * K);
    for (auto& v : x) v = to_bf16(nd(rng));
    std::vector<std::uint16_t> y(x.size());
    for (Format f : formats) {
      QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(1.0f) : QuantOptions::mx(f, ScaleRule::even);
      const Shape2 ss = scale_shape(o, rows, K);
      const std::int64_t cc = code_cols(f, K);
      std::vector<std::uint8_t> codes(rows * cc), scales(ss.rows * ss.cols);
      const double n = double(rows * K), qbytes = double(codes.size() + scales.size());
      const Op ops[] = {{"qdq", 4 * n}, {"quantize", 2 * n + qbytes}, {"dequantize", qbytes + 2 * n}};
      for (const Op& op : ops) {
        if (!a.ops.empty() && std::find(a.ops.begin(), a.ops.end(), op.name) == a.ops.end()) continue;
        double ref_s = 0;
        for (Backend b : {Backend::reference, Backend::cpu}) {
          if (b == Backend::reference && !a.reference) continue;
          QuantOptions ob = o;
          ob.backend = b;
          const Tensor xt = Tensor::of(x.data(), DType::bf16, rows, K), yt = Tensor::of(y.data(), DType::bf16, rows, K);
          QuantizedOut q;
          q.codes = Tensor::of(codes.data(), DType::u8, rows, cc);
          q.scales = Tensor::of(scales.data(), DType::u8, ss.rows, ss.cols);
          std::function<void()> fn;
          if (op.name == std::string("qdq")) fn = [&] { qdq(xt, yt, ob); };
          else if (op.name == std::string("quantize")) fn = [&] { quantize(xt, q, ob); };
          else fn = [&] { dequantize(QuantizedIn{q.codes, q.scales}, yt, ob); };
          if (op.name == std::string("dequantize")) quantize(xt, q, ob);
          const double s = time_host(fn, b == Backend::reference ? std::max(1, a.reps / 5) : a.reps);
          if (b == Backend::reference) ref_s = s;
          fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11.1f} {:>9.2f} {:>8.1f}% {:>8}\n", op.name, to_string(f),
                     fmt::format("{}x{}", rows, K), to_string(b), s * 1e6, op.bytes / s / 1e9, 100 * op.bytes / s / host_bw,
                     ref_s > 0 ? fmt::format("{:.1f}", ref_s / s) : "-");
        }
#if defined(MXQ_TOOL_HAVE_CUDA)
        if (cuda && a.gpu) {
          void *xd = nullptr, *yd = nullptr, *cd = nullptr, *sd = nullptr;
          cudaMalloc(&xd, x.size() * 2), cudaMalloc(&yd, y.size() * 2), cudaMalloc(&cd, codes.size()),
              cudaMalloc(&sd, scales.size());
          cudaMemcpy(xd, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
          QuantOptions ob = o;
          ob.backend = Backend::cuda;
          const Tensor xt = Tensor::of(xd, DType::bf16, rows, K, 0, Device::cuda),
                       yt = Tensor::of(yd, DType::bf16, rows, K, 0, Device::cuda);
          QuantizedOut q;
          q.codes = Tensor::of(cd, DType::u8, rows, cc, 0, Device::cuda);
          q.scales = Tensor::of(sd, DType::u8, ss.rows, ss.cols, 0, Device::cuda);
          std::function<void()> fn;
          if (op.name == std::string("qdq")) fn = [&] { qdq(xt, yt, ob); };
          else if (op.name == std::string("quantize")) fn = [&] { quantize(xt, q, ob); };
          else fn = [&] { dequantize(QuantizedIn{q.codes, q.scales}, yt, ob); };
          quantize(xt, q, ob);
          cudaEvent_t e0, e1;
          cudaEventCreate(&e0), cudaEventCreate(&e1);
          fn();
          std::vector<double> t;
          for (int i = 0; i < std::max(a.reps, 5); ++i) {
            cudaEventRecord(e0);
            fn();
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            t.push_back(ms / 1e3);
          }
          const double s = median(t);
          fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11.1f} {:>9.2f} {:>8.1f}% {:>8}\n", op.name, to_string(f),
                     fmt::format("{}x{}", rows, K), "cuda", s * 1e6, op.bytes / s / 1e9, 100 * op.bytes / s / dev_bw,
                     ref_s > 0 ? fmt::format("{:.1f}", ref_s / s) : "-");
          cudaEventDestroy(e0), cudaEventDestroy(e1);
          cudaFree(xd), cudaFree(yd), cudaFree(cd), cudaFree(sd);
        }
#endif
      }
    }
  }
  fmt::print("bytes: qdq 4 B/element; quantize 2 B in + codes + scales; dequantize the reverse. % copy: of the memcpy\n"
             "bandwidth of the same device (host for cpu/reference). x ref: the reference backend's time over this one's.\n");
  return 0;
}

}  // namespace mxq::cli
