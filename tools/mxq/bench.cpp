// `mxq bench`: each operation x format on each usable backend at the given shapes: us, GB/s, % of
// the memcpy bandwidth measured here on the same device, and the speed-up over the reference.
//
// Byte model (what must cross memory once): QDQ in + out; quantize input + codes + scales;
// dequantize the reverse; the linear and the MoE: packed weight bytes + x + y. Median of --reps runs after one warm-up. CPU memcpy: all hardware threads
// copying disjoint slices of a buffer larger than the caches. GPU: device-to-device cudaMemcpy.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <mxq/mxq.hpp>

#include "commands.hpp"

#if defined(MXQ_TOOL_HAVE_CUDA)
#include "cuda_util.hpp"
#endif

#include "stats.hpp"  // support/ (mxq_support)

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

#if defined(MXQ_TOOL_HAVE_CUDA)
// The median seconds of f on the GPU (CUDA events) over max(reps, 5) runs after one warm-up.
double time_device(const std::function<void()>& f, int reps) {
  cuda_util::EventTimer timer;
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < std::max(reps, 5); ++i) t.push_back(timer.time(f));
  return median(t);
}
#endif

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

// The tensors one benchmarked operation reads and writes.
struct Views {
  Tensor x, y;
  QuantizedOut q;
};

// The named operation (qdq, quantize or dequantize) on v; v and o must outlive the function.
std::function<void()> op_function(const std::string& name, const Views& v, const QuantOptions& o) {
  const Views* pv = &v;
  const QuantOptions* po = &o;
  if (name == "qdq") return [pv, po] { qdq(pv->x, pv->y, *po); };
  if (name == "quantize") return [pv, po] { quantize(pv->x, pv->q, *po); };
  return [pv, po] { dequantize(QuantizedIn{pv->q.codes, pv->q.scales}, pv->y, *po); };
}

// `--op linear`: y [M, N] = x [M, K] @ W^T for a random weight quantized to f (mxfp4, nvfp4) and
// prepacked; weight GB/s = packed weight bytes / time, % copy of those bytes plus x and y.
void bench_linear(const BenchArgs& a, Format f, std::int64_t N, std::int64_t K, bool cuda, double host_bw, double dev_bw) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<std::uint16_t> w(std::size_t(N * K));
  for (auto& v : w) v = f32_to_bf16(nd(rng));
  QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(f, ScaleRule::even);
  const std::int64_t g = f == Format::nvfp4 ? 16 : 32;
  std::vector<std::uint8_t> codes(std::size_t(N * K / 2)), scales(std::size_t(N * K / g));
  float S = 1.0f;
  QuantizedOut q{Tensor::of(codes.data(), DType::u8, N, K / 2), Tensor::of(scales.data(), DType::u8, N, K / g), {}, &S};
  quantize(Tensor::of(w.data(), DType::bf16, N, K), q, o);
  const PackedLayout L = packed_layout(f, N, K);
  std::vector<std::uint8_t> pc(std::size_t(L.codes.rows * L.codes.cols)), ps(std::size_t(L.scales.rows * L.scales.cols));
  PackedWeight pw;
  pw.format = f;
  pw.N = N;
  pw.K = K;
  pw.codes = Tensor::of(pc.data(), DType::u8, L.codes.rows, L.codes.cols);
  pw.scales = Tensor::of(ps.data(), DType::u8, L.scales.rows, L.scales.cols);
  pw.tensor_scale = S;
  prepack({q.codes, q.scales}, o, pw);
  const double wbytes = double(pc.size() + ps.size());
  for (std::int64_t M : a.tokens) {
    std::vector<std::uint16_t> x(std::size_t(M * K)), y(std::size_t(M * N));
    for (auto& v : x) v = f32_to_bf16(nd(rng) * 50);
    const double bytes = wbytes + double(x.size() + y.size()) * 2;
    auto print = [&](std::string_view backend, double s, double bw) {
      fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11.1f} {:>9.2f} {:>8.1f}% {:>8}\n", "linear", to_string(f),
                 fmt::format("{}x{} M={}", N, K, M), backend, s * 1e6, wbytes / s / 1e9, 100 * bytes / s / bw, "-");
    };
    const Tensor xt = Tensor::of(x.data(), DType::bf16, M, K), yt = Tensor::of(y.data(), DType::bf16, M, N);
    if (a.reference) print("reference", time_host([&] { linear(xt, pw, nullptr, yt, Backend::reference); }, 1), host_bw);
#if defined(MXQ_TOOL_HAVE_CUDA)
    if (cuda && a.gpu) {
      cuda_util::DeviceBuffer xd(x.size() * 2), yd(y.size() * 2), cd(pc.size()), sd(ps.size());
      xd.upload(x.data(), x.size() * 2);
      cd.upload(pc.data(), pc.size());
      sd.upload(ps.data(), ps.size());
      PackedWeight dw = pw;
      dw.codes = Tensor::of(cd.get(), DType::u8, L.codes.rows, L.codes.cols, 0, Device::cuda);
      dw.scales = Tensor::of(sd.get(), DType::u8, L.scales.rows, L.scales.cols, 0, Device::cuda);
      const Tensor xg = Tensor::of(xd.get(), DType::bf16, M, K, 0, Device::cuda), yg = Tensor::of(yd.get(), DType::bf16, M, N, 0, Device::cuda);
      const auto fn = [&] { linear(xg, dw, nullptr, yg, Backend::cuda); };
      print("cuda", time_device(fn, a.reps), dev_bw);
    }
#else
    (void)cuda;
    (void)dev_bw;
#endif
  }
}

// Host copies of E random experts [N, K] of format f, prepacked: random code bytes (every E2M1 value),
// MXFP4 scales E8M0 118..124, NVFP4 scales E4M3 bytes 0x28..0x47 with S = 100 (the benchmark times
// bytes, so the values need only be ordinary).
struct HostExperts {
  std::vector<std::uint8_t> codes, scales;
  std::vector<std::int32_t> shift;
  std::vector<float> S;
  PackedExperts w;
};
void make_experts(Format f, std::int64_t E, std::int64_t N, std::int64_t K, std::uint32_t seed, HostExperts& h) {
  std::mt19937 rng(seed);
  const QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(100.0f) : QuantOptions::mx(f, ScaleRule::even);
  const std::int64_t g = f == Format::nvfp4 ? 16 : 32;
  std::vector<std::uint8_t> qc(std::size_t(E * N * (K / 2))), qs(std::size_t(E * N * (K / g)));
  for (auto& b : qc) b = std::uint8_t(rng());
  for (auto& b : qs) b = f == Format::nvfp4 ? std::uint8_t(0x28 + rng() % 32) : std::uint8_t(118 + rng() % 7);
  std::vector<QuantizedIn> q(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e)
    q[std::size_t(e)] = {Tensor::of(qc.data() + e * N * (K / 2), DType::u8, N, K / 2), Tensor::of(qs.data() + e * N * (K / g), DType::u8, N, K / g)};
  const Shape2 b = packed_expert_bytes(f, N, K);
  h.codes.assign(std::size_t(E * b.rows), 0);
  h.scales.assign(std::size_t(E * b.cols), 0);
  h.shift.assign(std::size_t(E), 0);
  h.S.assign(std::size_t(E), f == Format::nvfp4 ? 100.0f : 1.0f);
  h.w.format = f;
  h.w.E = E;
  h.w.N = N;
  h.w.K = K;
  h.w.codes = Tensor::of(h.codes.data(), DType::u8, E, b.rows);
  h.w.scales = Tensor::of(h.scales.data(), DType::u8, E, b.cols);
  h.w.exp_shift = Tensor::of(h.shift.data(), DType::i32, 1, E);
  h.w.tensor_scale = Tensor::of(h.S.data(), DType::f32, 1, E);
  prepack_experts(q.data(), o, f == Format::nvfp4 ? h.S.data() : nullptr, h.w);
}

// `--op moe`: one MoE block (route, w13 [E, 2I, H], SwiGLU, w2 [E, H, I] with the routing weights, combine)
// on x [T, H] for each T of --tokens, the experts random bytes of format f, the routing k distinct uniformly
// random experts per token. Weight GB/s = the packed bytes of the experts the batch routes to / time;
// % copy of those bytes plus x and y.
// --experts E:k.
std::pair<std::int64_t, std::int64_t> parse_experts(const std::string& s) {
  std::int64_t E = 0, k = 0;
  char colon = 0;
  std::istringstream is(s);
  if (!(is >> E >> colon >> k) || colon != ':' || E <= 0 || k <= 0 || k > E || !is.eof())
    throw std::runtime_error("--experts '" + s + "': expected E:k with 1 <= k <= E, e.g. 128:4");
  return {E, k};
}

void bench_moe(const BenchArgs& a, Format f, std::int64_t H, std::int64_t I, bool cuda, double host_bw, double dev_bw) {
  const auto [E, k] = parse_experts(a.experts);  // H and I: run_bench checked them against f
  HostExperts w13, w2;
  make_experts(f, E, 2 * I, H, 3, w13);
  make_experts(f, E, H, I, 4, w2);
  const Shape2 b13 = packed_expert_bytes(f, 2 * I, H), b2 = packed_expert_bytes(f, H, I);
  const double expert_bytes = double(b13.rows + b13.cols + b2.rows + b2.cols);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t T : a.tokens) {
    std::vector<std::uint16_t> x(std::size_t(T * H)), y(std::size_t(T * H));
    for (auto& v : x) v = f32_to_bf16(nd(rng));
    std::vector<std::int32_t> ids(std::size_t(T * k));
    std::vector<float> wt(std::size_t(T * k));
    std::vector<char> active(std::size_t(E), 0);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t e = 0; e < E; ++e) perm[std::size_t(e)] = std::int32_t(e);
      for (std::int64_t j = 0; j < k; ++j) {  // k distinct experts: a partial Fisher-Yates shuffle
        std::swap(perm[std::size_t(j)], perm[std::size_t(j + std::int64_t(rng() % std::uint32_t(E - j)))]);
        ids[std::size_t(t * k + j)] = perm[std::size_t(j)];
        wt[std::size_t(t * k + j)] = 1.0f / float(k);
        active[std::size_t(perm[std::size_t(j)])] = 1;
      }
    }
    const double wbytes = expert_bytes * double(std::count(active.begin(), active.end(), 1));
    const double bytes = wbytes + double(x.size() + y.size()) * 2;
    auto print = [&](std::string_view backend, double s, double bw) {
      fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11.1f} {:>9.2f} {:>8.1f}% {:>8}\n", "moe", to_string(f),
                 fmt::format("E{}k{} {}x{} T={}", E, k, H, I, T), backend, s * 1e6, wbytes / s / 1e9, 100 * bytes / s / bw, "-");
    };
    const Tensor xt = Tensor::of(x.data(), DType::bf16, T, H), yt = Tensor::of(y.data(), DType::bf16, T, H);
    const Tensor idt = Tensor::of(ids.data(), DType::i32, T, k), wtt = Tensor::of(wt.data(), DType::f32, T, k);
    if (a.reference)
      print("reference",
            time_host([&] { moe(xt, w13.w, nullptr, w2.w, nullptr, idt, wtt, MoeActivation::swiglu, 0, 0, yt, nullptr, Backend::reference); }, 1),
            host_bw);
#if defined(MXQ_TOOL_HAVE_CUDA)
    if (cuda && a.gpu) {
      // The experts, x, the routing and the workspace on the device.
      auto to_device = [](const HostExperts& h, std::vector<cuda_util::DeviceBuffer>& keep) {
        PackedExperts d = h.w;
        auto up = [&](const void* p, std::size_t n) {
          keep.emplace_back(n);
          keep.back().upload(p, n);
          return keep.back().get();
        };
        d.codes = Tensor::of(up(h.codes.data(), h.codes.size()), DType::u8, h.w.codes.rows, h.w.codes.cols, 0, Device::cuda);
        d.scales = Tensor::of(up(h.scales.data(), h.scales.size()), DType::u8, h.w.scales.rows, h.w.scales.cols, 0, Device::cuda);
        d.exp_shift = Tensor::of(up(h.shift.data(), h.shift.size() * 4), DType::i32, 1, h.w.E, 0, Device::cuda);
        d.tensor_scale = Tensor::of(up(h.S.data(), h.S.size() * 4), DType::f32, 1, h.w.E, 0, Device::cuda);
        return d;
      };
      std::vector<cuda_util::DeviceBuffer> keep;
      keep.reserve(16);
      const PackedExperts d13 = to_device(w13, keep), d2 = to_device(w2, keep);
      const MoeWorkspace ws = moe_workspace(T, k, E, 2 * I, I, H, MoeActivation::swiglu);
      cuda_util::DeviceBuffer xd(x.size() * 2), yd(y.size() * 2), idd(ids.size() * 4), wtd(wt.size() * 4), wsd(std::size_t(ws.bytes));
      xd.upload(x.data(), x.size() * 2);
      idd.upload(ids.data(), ids.size() * 4);
      wtd.upload(wt.data(), wt.size() * 4);
      const Tensor xg = Tensor::of(xd.get(), DType::bf16, T, H, 0, Device::cuda), yg = Tensor::of(yd.get(), DType::bf16, T, H, 0, Device::cuda);
      const Tensor idg = Tensor::of(idd.get(), DType::i32, T, k, 0, Device::cuda), wtg = Tensor::of(wtd.get(), DType::f32, T, k, 0, Device::cuda);
      const Tensor wsg = Tensor::of(wsd.get(), DType::u8, 1, ws.bytes, 0, Device::cuda);
      const auto fn = [&] { moe(xg, d13, nullptr, d2, nullptr, idg, wtg, MoeActivation::swiglu, 0, 0, yg, &wsg, Backend::cuda); };
      print("cuda", time_device(fn, a.reps), dev_bw);
    }
#else
    (void)cuda;
    (void)dev_bw;
#endif
  }
}

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
  if (std::find(a.ops.begin(), a.ops.end(), "moe") != a.ops.end()) {  // refused before any work
    parse_experts(a.experts);
    for (const auto& [H, I] : shapes)
      for (Format f : formats) {
        const int g = format_info(f).default_group;
        if ((f == Format::mxfp4 || f == Format::nvfp4) && (H % g || I % g))
          throw std::runtime_error(fmt::format("--op moe --shape {}x{}: H and I must be multiples of {} ({})", H, I, g, to_string(f)));
      }
  }

  std::string why;
  const bool cuda = cuda_available(&why);
  const double host_bw = host_memcpy_bandwidth();
  fmt::print("mxq bench: host memcpy {:.1f} GB/s ({} threads, read + write)", host_bw / 1e9, std::thread::hardware_concurrency());
#if defined(MXQ_TOOL_HAVE_CUDA)
  double dev_bw = 0;
  if (cuda && a.gpu) {
    const std::size_t n = 1u << 30;
    cuda_util::DeviceBuffer s(n), d(n);
    cuda_util::EventTimer timer;
    std::vector<double> t;
    for (int i = 0; i < 6; ++i) {
      const double sec = timer.time([&] { MXQ_CUDA_CHECK(cudaMemcpy(d.get(), s.get(), n, cudaMemcpyDeviceToDevice)); });
      if (i) t.push_back(sec);
    }
    dev_bw = 2.0 * double(n) / median(t);
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
    for (auto& v : x) v = f32_to_bf16(nd(rng));
    std::vector<std::uint16_t> y(x.size());
    for (Format f : formats) {
      QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(1.0f) : QuantOptions::mx(f, ScaleRule::even);
      const Shape2 ss = scale_shape(o, rows, K);
      const std::int64_t cc = code_cols(f, K);
      std::vector<std::uint8_t> codes(rows * cc), scales(ss.rows * ss.cols);
      const double n = double(rows * K), qbytes = double(codes.size() + scales.size());
      if (std::find(a.ops.begin(), a.ops.end(), "linear") != a.ops.end()) {
        if (f != Format::mxfp4 && f != Format::nvfp4) {
          fmt::print("{:<11} {:<11} (the W4A16 linear takes mxfp4 and nvfp4 weights)\n", "linear", to_string(f));
        } else {
#if defined(MXQ_TOOL_HAVE_CUDA)
          bench_linear(a, f, rows, K, cuda, host_bw, dev_bw);
#else
          bench_linear(a, f, rows, K, cuda, host_bw, 0);
#endif
        }
      }
      if (std::find(a.ops.begin(), a.ops.end(), "moe") != a.ops.end()) {
        if (f != Format::mxfp4 && f != Format::nvfp4) {
          fmt::print("{:<11} {:<11} (the W4A16 MoE takes mxfp4 and nvfp4 experts)\n", "moe", to_string(f));
        } else {
#if defined(MXQ_TOOL_HAVE_CUDA)
          bench_moe(a, f, rows, K, cuda, host_bw, dev_bw);
#else
          bench_moe(a, f, rows, K, cuda, host_bw, 0);
#endif
        }
      }
      const Op ops[] = {{"qdq", 4 * n}, {"quantize", 2 * n + qbytes}, {"dequantize", qbytes + 2 * n}};
      for (const Op& op : ops) {
        if (!a.ops.empty() && std::find(a.ops.begin(), a.ops.end(), op.name) == a.ops.end()) continue;
        double ref_s = 0;
        // The views of x, y, codes and scales at these addresses, and the operation on them.
        auto bind = [&](Views& v, void* xp, void* yp, void* cp, void* sp, Device dev, const QuantOptions& ob) {
          v.x = Tensor::of(xp, DType::bf16, rows, K, 0, dev);
          v.y = Tensor::of(yp, DType::bf16, rows, K, 0, dev);
          v.q.codes = Tensor::of(cp, DType::u8, rows, cc, 0, dev);
          v.q.scales = Tensor::of(sp, DType::u8, ss.rows, ss.cols, 0, dev);
          return op_function(op.name, v, ob);
        };
        auto print = [&](std::string_view backend, double s, double bw) {
          fmt::print("{:<11} {:<11} {:<12} {:<10} {:>11.1f} {:>9.2f} {:>8.1f}% {:>8}\n", op.name, to_string(f),
                     fmt::format("{}x{}", rows, K), backend, s * 1e6, op.bytes / s / 1e9, 100 * op.bytes / s / bw,
                     ref_s > 0 ? fmt::format("{:.1f}", ref_s / s) : "-");
        };
        for (Backend b : {Backend::reference, Backend::cpu}) {
          if (b == Backend::reference && !a.reference) continue;
          QuantOptions ob = o;
          ob.backend = b;
          Views v;
          const auto fn = bind(v, x.data(), y.data(), codes.data(), scales.data(), Device::cpu, ob);
          if (op.name == std::string("dequantize")) quantize(v.x, v.q, ob);
          const double s = time_host(fn, b == Backend::reference ? std::max(1, a.reps / 5) : a.reps);
          if (b == Backend::reference) ref_s = s;
          print(to_string(b), s, host_bw);
        }
#if defined(MXQ_TOOL_HAVE_CUDA)
        if (cuda && a.gpu) {
          cuda_util::DeviceBuffer xd(x.size() * 2), yd(y.size() * 2), cd(codes.size()), sd(scales.size());
          xd.upload(x.data(), x.size() * 2);
          QuantOptions ob = o;
          ob.backend = Backend::cuda;
          Views v;
          const auto fn = bind(v, xd.get(), yd.get(), cd.get(), sd.get(), Device::cuda, ob);
          quantize(v.x, v.q, ob);
          print("cuda", time_device(fn, a.reps), dev_bw);
        }
#endif
      }
    }
  }
  fmt::print("bytes: qdq 4 B/element; quantize 2 B in + codes + scales; dequantize the reverse; linear: GB/s of the packed\n"
             "weight bytes, % copy of weight + x + y bytes (L2 warm: repeated runs); moe: the same over the experts\n"
             "the batch routes to (shape H x I, --experts E:k). % copy: of the memcpy\n"
             "bandwidth of the same device (host for cpu/reference). x ref: the reference backend's time over this one's.\n");
  return 0;
}

}  // namespace mxq::cli
