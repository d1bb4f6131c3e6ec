// GPU benchmark of the CUDA backend (issue 3's performance table).
//
// Method: bf16 input drawn from an LLM-like distribution (never zeros), output buffers allocated once;
// before every timed run the L2 cache is flushed by writing a buffer twice its size; each run is timed
// with CUDA events around the one operation; the median of --reps runs is reported. Decode shapes
// (few rows) are timed as the amortised cost of one op inside a captured CUDA graph of 64 ops (the
// way inference runs them; L2 warm, since the graph reuses one input).
//
// Byte model (bytes that must cross DRAM per element): QDQ bf16 -> bf16: 4; quantize: 2 (read) +
// element bits / 8 + 1 / group (scales); dequantize: the reverse. GB/s = model bytes / time, and %
// of copy = that over the device-to-device copy bandwidth measured in the same run (bytes read +
// written).
//
// Output: a table on stdout, and with --json FILE one JSON object per line for bench/torch_peers.py.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <mxq/mxq.hpp>

#include "cuda_util.hpp"  // support/ (mxq_support)
#include "stats.hpp"

namespace {

using mxq::cuda_util::DeviceBuffer;
using mxq::cuda_util::EventTimer;

cudaStream_t g_stream;
DeviceBuffer* g_flush = nullptr;
std::size_t g_flush_bytes = 0;

// Flushes the L2 by writing a buffer twice its size (as triton's do_bench and nvbench do).
// NOTE: measured on the H200 (2026-12-03): following the write with a read of another such buffer (an
// L2 of clean lines, none of them the op's) made every row slower, the copy too (87% against 93% of
// the 1 GiB copy at 8192x8192): the dirty lines the write leaves are not what costs small shapes.
void flush_l2() { MXQ_CUDA_CHECK(cudaMemsetAsync(g_flush->get(), 0x5A, g_flush_bytes, g_stream)); }

using mxq::bench::median;

// Median microseconds of `reps` cold-L2 runs of f.
double time_cold(const std::function<void()>& f, int reps) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) f();  // warm-up: module load, first-touch
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    flush_l2();
    us.push_back(timer.time(f, g_stream) * 1e6);
  }
  return median(us);
}

// Amortised microseconds per op of a graph holding `n` back-to-back copies of f.
double time_graph(const std::function<void()>& f, int n, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  MXQ_CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) f();
  MXQ_CUDA_CHECK(cudaStreamEndCapture(g_stream, &g));
  MXQ_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  EventTimer timer;
  for (int i = 0; i < 3; ++i) MXQ_CUDA_CHECK(cudaGraphLaunch(ge, g_stream));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) us.push_back(timer.time([&] { MXQ_CUDA_CHECK(cudaGraphLaunch(ge, g_stream)); }, g_stream) * 1e6 / n);
  MXQ_CUDA_CHECK(cudaGraphExecDestroy(ge));
  MXQ_CUDA_CHECK(cudaGraphDestroy(g));
  return median(us);
}

std::vector<std::uint16_t> llm_like_bf16(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  std::vector<std::uint16_t> v(std::size_t(rows * cols));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    float x = nd(rng);
    if ((i % cols) % 97 == 13) x *= 150.0f;  // outlier channels
    v[std::size_t(i)] = mxq::f32_to_bf16(x);
  }
  return v;
}

bool selected(const std::string& only, const char* op, const char* fmt, const char* mode) {
  return only.empty() || (std::string(op) + " " + fmt + " " + mode).find(only) != std::string::npos;
}

struct Row {
  std::string op, format, shape, mode;
  double us, bytes;
};

}  // namespace

int run(int argc, char** argv) {
  int reps = 50;
  std::string json;
  bool quick = false;
  std::string only;  // run only rows whose "op format mode" contains this
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--quick") quick = true;
    else if (a == "--only" && i + 1 < argc) only = argv[++i];

    else {
      std::fprintf(stderr, "usage: cuda_bench [--reps N] [--json FILE] [--quick] [--only 'op format mode']\n");
      return 2;
    }
  }
  std::string why;
  if (!mxq::cuda_available(&why)) {
    std::fprintf(stderr, "cuda_bench: no usable CUDA device: %s\n", why.c_str());
    return 1;
  }
  const cudaDeviceProp prop = mxq::cuda_util::device_properties();
  MXQ_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  g_flush_bytes = std::size_t(std::max(prop.l2CacheSize, 1 << 20)) * 2;
  g_flush = new DeviceBuffer(g_flush_bytes);

  // Device copy bandwidth: a 1 GiB device-to-device copy, bytes read + written.
  double copy_gbs = 0;
  {
    const std::size_t n = std::size_t(1) << 30;
    DeviceBuffer a(n), b(n);
    a.fill(1);
    const double us = time_cold([&] { MXQ_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice, g_stream)); }, reps);
    copy_gbs = 2.0 * n / us / 1e3;
  }

  std::vector<Row> rows;
  const std::vector<std::pair<std::int64_t, std::int64_t>> big =
      quick ? std::vector<std::pair<std::int64_t, std::int64_t>>{{8192, 8192}}
            : std::vector<std::pair<std::int64_t, std::int64_t>>{{8192, 8192}, {32768, 8192}};
  DeviceBuffer ws(4);
  for (auto [R, K] : big) {
    const std::string shape = std::to_string(R) + "x" + std::to_string(K);
    const double n = double(R) * double(K);
    const auto host = llm_like_bf16(R, K, 7);
    DeviceBuffer x(std::size_t(R * K * 2)), y(std::size_t(R * K * 2)), codes(std::size_t(R * K)),
        scales(std::size_t((R + 127) / 128 * 128 * ((K / 16 + 3) / 4 * 4))), S(4);
    x.upload(host.data(), host.size() * 2);
    const mxq::Tensor xt = mxq::Tensor::of(x.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    const mxq::Tensor yt = mxq::Tensor::of(y.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    const float given_S = mxq::nvfp4_tensor_scale_from_amax(mxq::tensor_amax(xt, mxq::Backend::automatic, g_stream));

    auto opts = [&](mxq::QuantOptions o) {
      o.stream = g_stream;
      o.workspace = ws.get();
      return o;
    };
    const mxq::QuantOptions mxfp4 = opts(mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even));
    const mxq::QuantOptions mxfp8 = opts(mxq::QuantOptions::mx(mxq::Format::mxfp8_e4m3, mxq::ScaleRule::floor));
    const mxq::QuantOptions nv_given = opts(mxq::QuantOptions::nvfp4(given_S));
    const mxq::QuantOptions nv_auto = opts(mxq::QuantOptions::nvfp4());
    mxq::QuantOptions mxfp4_sr = mxfp4;
    mxfp4_sr.rounding = mxq::Rounding::stochastic;
    mxfp4_sr.seed = 1234;

    auto qdq_row = [&](const char* fmt, const mxq::QuantOptions& o, const char* mode) {
      if (!selected(only, "qdq", fmt, mode)) return;
      rows.push_back({"qdq", fmt, shape, mode, time_cold([&] { mxq::qdq(xt, yt, o); }, reps), 4.0 * n});
    };
    // The copy limit at this size, flushed the same way (the headline % is against the 1 GiB copy).
    if (selected(only, "copy", "-", "same size"))
      rows.push_back({"copy", "-", shape, "same size",
                      time_cold([&] { MXQ_CUDA_CHECK(cudaMemcpyAsync(y.get(), x.get(), std::size_t(R * K * 2), cudaMemcpyDeviceToDevice, g_stream)); }, reps),
                      4.0 * n});
    qdq_row("mxfp4", mxfp4, "even");
    qdq_row("mxfp4", opts(mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::quest)), "quest");
    qdq_row("mxfp8_e4m3", mxfp8, "floor");
    qdq_row("nvfp4", nv_given, "given S");
    qdq_row("nvfp4", nv_auto, "computed S");
    qdq_row("mxfp4", mxfp4_sr, "even, stochastic");
    mxq::QuantOptions mxfp4_sr16 = mxfp4_sr, mxfp4_sr8 = mxfp4_sr, nv_sr8 = nv_given, mxfp8_sr8 = mxfp8;
    mxfp4_sr16.random_bits = 16;
    mxfp4_sr8.random_bits = 8;
    for (mxq::QuantOptions* o : {&nv_sr8, &mxfp8_sr8}) o->rounding = mxq::Rounding::stochastic, o->seed = 1234, o->random_bits = 8;
    qdq_row("mxfp4", mxfp4_sr16, "even, stochastic 16-bit");
    qdq_row("mxfp4", mxfp4_sr8, "even, stochastic 8-bit");
    qdq_row("mxfp8_e4m3", mxfp8_sr8, "floor, stochastic 8-bit");
    qdq_row("nvfp4", nv_sr8, "given S, stochastic 8-bit");

    auto quant_row = [&](const char* fmt, mxq::QuantOptions o, const char* mode) {
      if (!selected(only, "quantize", fmt, mode) && !selected(only, "dequantize", fmt, mode)) return;
      o.scale_layout = mxq::ScaleLayout::swizzled;
      const mxq::FormatInfo fi = mxq::format_info(o.format);
      const mxq::Shape2 ss = mxq::scale_shape(o, R, K);
      mxq::QuantizedOut out;
      out.codes = mxq::Tensor::of(codes.get(), mxq::DType::u8, R, mxq::code_cols(o.format, K), 0, mxq::Device::cuda);
      out.scales = mxq::Tensor::of(scales.get(), mxq::DType::u8, ss.rows, ss.cols, 0, mxq::Device::cuda);
      out.tensor_scale = o.format == mxq::Format::nvfp4 ? static_cast<float*>(S.get()) : nullptr;
      const double bytes = n * (2.0 + fi.elem_bits / 8.0 + 1.0 / mxq::group_size(o));
      rows.push_back({"quantize", fmt, shape, mode, time_cold([&] { mxq::quantize(xt, out, o); }, reps), bytes});
      // and back: dequantize the codes just written
      const mxq::QuantizedIn in{out.codes, out.scales};
      mxq::QuantOptions od = o;
      if (o.format == mxq::Format::nvfp4) od.tensor_scale = given_S;
      rows.push_back({"dequantize", fmt, shape, mode, time_cold([&] { mxq::dequantize(in, yt, od); }, reps), bytes});
    };
    quant_row("mxfp4", mxfp4, "even, swizzled");
    quant_row("mxfp8_e4m3", mxfp8, "floor, swizzled");
    quant_row("nvfp4", nv_given, "given S, swizzled");

    // Rotation before quantization (issue 15): the same byte model (the rotation moves no extra bytes).
    auto rot = [](mxq::QuantOptions o, mxq::Rotation r, int rs) {
      o.rotation = r;
      o.rotation_size = rs;
      o.rotation_seed = 5;
      return o;
    };
    const mxq::Rotation had = mxq::Rotation::hadamard, rhad = mxq::Rotation::random_hadamard;
    qdq_row("mxfp4", rot(mxfp4, had, 32), "even, had32");
    qdq_row("mxfp4", rot(mxfp4, had, 128), "even, had128");
    qdq_row("mxfp4", rot(mxfp4, rhad, 128), "even, rhad128");
    qdq_row("mxfp4", rot(mxfp4, had, 256), "even, had256");
    qdq_row("mxfp4", rot(opts(mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::quest)), had, 128), "quest, had128");
    qdq_row("nvfp4", rot(nv_given, had, 128), "given S, had128");
    qdq_row("nvfp4", rot(nv_auto, had, 128), "computed S, had128");
    quant_row("mxfp4", rot(mxfp4, had, 32), "even, swizzled, had32");
    quant_row("mxfp4", rot(mxfp4, had, 128), "even, swizzled, had128");
    quant_row("mxfp4", rot(mxfp4, had, 256), "even, swizzled, had256");
    quant_row("nvfp4", rot(nv_given, had, 32), "given S, swizzled, had32");
    quant_row("nvfp4", rot(nv_given, had, 128), "given S, swizzled, had128");

    // A runtime matrix (Rotation::matrix; bf16 R in device memory, its own inverse here: the normalised
    // Hadamard matrix rounded to bf16): the same byte model, plus 2 RS FP64 flops per element on the
    // FP64 tensor cores (at RS = 128 at least 1 ms at the 67 TFLOP/s of the H100 / H200 for 32768 x 8192).
    std::vector<DeviceBuffer> mats;
    auto mat = [&](mxq::QuantOptions o, int rs) {
      std::vector<std::uint16_t> h(std::size_t(rs) * rs);
      for (int i = 0; i < rs; ++i)
        for (int j = 0; j < rs; ++j)
          h[std::size_t(i) * rs + j] = mxq::f32_to_bf16(float(((__builtin_popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) / std::sqrt(double(rs))));
      mats.emplace_back(h.size() * 2);
      mats.back().upload(h.data(), h.size() * 2);
      o.rotation = mxq::Rotation::matrix;
      o.rotation_size = rs;
      o.rotation_matrix = o.rotation_inverse = mxq::Tensor::of(mats.back().get(), mxq::DType::bf16, rs, rs, 0, mxq::Device::cuda);
      return o;
    };
    mats.reserve(16);
    qdq_row("mxfp4", mat(mxfp4, 32), "even, matrix32");
    qdq_row("mxfp4", mat(mxfp4, 128), "even, matrix128");
    qdq_row("mxfp4", mat(mxfp4, 256), "even, matrix256");
    qdq_row("nvfp4", mat(nv_given, 128), "given S, matrix128");
    quant_row("mxfp4", mat(mxfp4, 128), "even, swizzled, matrix128");
    quant_row("nvfp4", mat(nv_given, 128), "given S, swizzled, matrix128");
    // The same with MatrixPrecision::bf16: the bf16 tensor cores' fp32 sums (within the stated bound, not
    // the exact bytes); 2 RS bf16 flops per element. Its dequantize rows sum R^-1 exactly, as above.
    auto matb = [&](mxq::QuantOptions o, int rs) {
      o = mat(o, rs);
      o.matrix_precision = mxq::MatrixPrecision::bf16;
      return o;
    };
    qdq_row("mxfp4", matb(mxfp4, 32), "even, matrix32 bf16");
    qdq_row("mxfp4", matb(mxfp4, 128), "even, matrix128 bf16");
    qdq_row("nvfp4", matb(nv_given, 128), "given S, matrix128 bf16");
    qdq_row("nvfp4", matb(nv_auto, 128), "computed S, matrix128 bf16");
    quant_row("mxfp4", matb(mxfp4, 128), "even, swizzled, matrix128 bf16");
    quant_row("nvfp4", matb(nv_given, 128), "given S, swizzled, matrix128 bf16");
  }

  // The vllm-qdq-plugin's benchmark shape (its CuTe kernel: 88 us for MXFP4 QDQ of [1024, 4096] bf16
  // on an A100), cold L2 as above.
  {
    const std::int64_t R = 1024, K = 4096;
    const auto host = llm_like_bf16(R, K, 11);
    DeviceBuffer x(std::size_t(R * K * 2)), y(std::size_t(R * K * 2));
    x.upload(host.data(), host.size() * 2);
    const mxq::Tensor xt = mxq::Tensor::of(x.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    const mxq::Tensor yt = mxq::Tensor::of(y.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    for (auto [fmt, rule, mode] : {std::tuple{mxq::Format::mxfp4, mxq::ScaleRule::even, "even, plugin shape"},
                                   std::tuple{mxq::Format::mxfp8_e4m3, mxq::ScaleRule::floor, "floor, plugin shape"}}) {
      mxq::QuantOptions o = mxq::QuantOptions::mx(fmt, rule);
      o.stream = g_stream;
      const std::string f(mxq::to_string(fmt));
      if (selected(only, "qdq", f.c_str(), mode))
        rows.push_back({"qdq", f, "1024x4096", mode, time_cold([&] { mxq::qdq(xt, yt, o); }, reps), 4.0 * R * K});
    }
  }

  // Decode shapes: amortised per-op time inside a CUDA graph.
  for (std::int64_t R : {16, 256}) {
    const std::int64_t K = 8192;
    const std::string shape = std::to_string(R) + "x" + std::to_string(K);
    const double n = double(R) * double(K);
    const auto host = llm_like_bf16(R, K, 9);
    DeviceBuffer x(std::size_t(R * K * 2)), y(std::size_t(R * K * 2)), codes(std::size_t(R * K)), scales(std::size_t(256 * K / 16)),
        S(4);
    x.upload(host.data(), host.size() * 2);
    const mxq::Tensor xt = mxq::Tensor::of(x.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    const mxq::Tensor yt = mxq::Tensor::of(y.get(), mxq::DType::bf16, R, K, 0, mxq::Device::cuda);
    auto opts = [&](mxq::QuantOptions o) {
      o.stream = g_stream;
      o.workspace = ws.get();
      return o;
    };
    const auto mxfp4 = opts(mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even));
    const auto mxfp8 = opts(mxq::QuantOptions::mx(mxq::Format::mxfp8_e4m3, mxq::ScaleRule::floor));
    const auto nv_given = opts(mxq::QuantOptions::nvfp4(100.0f));
    const auto nv_auto = opts(mxq::QuantOptions::nvfp4());
    mxq::QuantOptions mxfp4_h128 = mxfp4, nv_h128 = nv_given;
    for (mxq::QuantOptions* o : {&mxfp4_h128, &nv_h128}) o->rotation = mxq::Rotation::hadamard, o->rotation_size = 128;
    for (auto [fmt, o, mode] : {std::tuple{"mxfp4", mxfp4, "even, graph"}, std::tuple{"mxfp8_e4m3", mxfp8, "floor, graph"},
                                std::tuple{"nvfp4", nv_given, "given S, graph"}, std::tuple{"nvfp4", nv_auto, "computed S, graph"},
                                std::tuple{"mxfp4", mxfp4_h128, "even, had128, graph"}, std::tuple{"nvfp4", nv_h128, "given S, had128, graph"}})
      if (selected(only, "qdq", fmt, mode)) rows.push_back({"qdq", fmt, shape, mode, time_graph([&] { mxq::qdq(xt, yt, o); }, 64, reps), 4.0 * n});
    mxq::QuantOptions q = mxfp4;
    q.scale_layout = mxq::ScaleLayout::swizzled;
    const mxq::Shape2 ss = mxq::scale_shape(q, R, K);
    mxq::QuantizedOut out;
    out.codes = mxq::Tensor::of(codes.get(), mxq::DType::u8, R, K / 2, 0, mxq::Device::cuda);
    out.scales = mxq::Tensor::of(scales.get(), mxq::DType::u8, ss.rows, ss.cols, 0, mxq::Device::cuda);
    if (selected(only, "quantize", "mxfp4", "even, swizzled, graph")) rows.push_back({"quantize", "mxfp4", shape, "even, swizzled, graph",
                    time_graph([&] { mxq::quantize(xt, out, q); }, 64, reps), n * (2.0 + 0.5 + 1.0 / 32)});
  }

  std::printf("GPU: %s (sm_%d%d, %d SMs), device copy bandwidth %.0f GB/s, median of %d runs\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, copy_gbs, reps);
  std::printf("%-11s %-11s %-12s %-24s %10s %9s %8s\n", "op", "format", "shape", "mode", "us", "GB/s", "% copy");
  FILE* jf = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  if (jf)
    std::fprintf(jf, "{\"kind\": \"copy\", \"gbs\": %.3f, \"gpu\": \"%s\"}\n", copy_gbs, prop.name);
  for (const Row& r : rows) {
    const double gbs = r.bytes / r.us / 1e3;
    std::printf("%-11s %-11s %-12s %-24s %10.2f %9.1f %7.1f%%\n", r.op.c_str(), r.format.c_str(), r.shape.c_str(),
                r.mode.c_str(), r.us, gbs, 100.0 * gbs / copy_gbs);
    if (jf)
      std::fprintf(jf,
                   "{\"kind\": \"mxq\", \"op\": \"%s\", \"format\": \"%s\", \"shape\": \"%s\", \"mode\": \"%s\", \"us\": %.3f, "
                   "\"bytes\": %.0f}\n",
                   r.op.c_str(), r.format.c_str(), r.shape.c_str(), r.mode.c_str(), r.us, r.bytes);
  }
  if (jf) std::fclose(jf);
  delete g_flush;
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_bench: %s\n", e.what());
    return 1;
  }
}
