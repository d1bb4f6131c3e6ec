// `mxq verify`: what this build and machine are, which backends are usable (and why not), then a
// bit-exactness self-test of every usable backend against the reference. Exit status 1 on any
// mismatch.
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <mxq/mxq.hpp>

#include "commands.hpp"

#if defined(MXQ_TOOL_HAVE_CUDA)
#include "cuda_util.hpp"
#endif

namespace mxq::cli {

namespace {

struct Case {
  Format format;
  ScaleRule rule;
  Rounding rounding;
  ScaleLayout layout;
  int random_bits = 32;  // stochastic rounding
};

// Every format x rule x layout with RNE and with stochastic rounding (32 random bits per element; not
// nvfp4_e5m3, which rounds to nearest only); the linear layout with 8 random bits too.
std::vector<Case> cases() {
  std::vector<Case> v;
  for (Rounding rd : {Rounding::nearest_even, Rounding::stochastic})
    for (ScaleLayout l : {ScaleLayout::linear, ScaleLayout::swizzled}) {
      for (Format f : all_formats())
        for (ScaleRule r : rules_for(f))
          if (f != Format::nvfp4_e5m3 || rd == Rounding::nearest_even) v.push_back({f, r, rd, l});
    }
  for (Format f : all_formats())
    for (ScaleRule r : rules_for(f))
      if (f != Format::nvfp4_e5m3) v.push_back({f, r, Rounding::stochastic, ScaleLayout::linear, 8});
  return v;
}

// bf16 input with outliers, a NaN block and an Inf block.
std::vector<std::uint16_t> input(std::int64_t rows, std::int64_t K, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::uint16_t> x(rows * K);
  for (std::int64_t i = 0; i < rows * K; ++i) {
    x[i] = f32_to_bf16(nd(rng) * (i % 97 == 5 ? 40.0f : 1.0f));
  }
  if (rows > 2) {
    x[1 * K] = 0x7FC0;      // NaN
    x[2 * K + 3] = 0xFF80;  // -Inf
  }
  return x;
}

// Output buffers of one quantize + dequantize + qdq run, as bytes.
struct Outputs {
  std::vector<std::uint8_t> codes, scales, mask, deq, qdq;
  float S = 0;
};

// Runs the three operations on host buffers with `backend` (CPU backends).
Outputs run_host(const std::vector<std::uint16_t>& x, std::int64_t rows, std::int64_t K, QuantOptions o) {
  Outputs r;
  const Tensor xt = Tensor::of(const_cast<std::uint16_t*>(x.data()), DType::bf16, rows, K);
  const std::int64_t cc = code_cols(o.format, K);
  const Shape2 ss = scale_shape(o, rows, K), ms = clip_mask_shape(rows, K);
  r.codes.assign(rows * cc, 0);
  r.scales.assign(ss.rows * ss.cols, 0);
  r.mask.assign(ms.rows * ms.cols, 0);
  QuantizedOut out;
  out.codes = Tensor::of(r.codes.data(), DType::u8, rows, cc);
  out.scales = Tensor::of(r.scales.data(), DType::u8, ss.rows, ss.cols);
  out.clip_mask = Tensor::of(r.mask.data(), DType::u8, ms.rows, ms.cols);
  out.tensor_scale = &r.S;
  quantize(xt, out, o);
  QuantOptions d = o;
  if (o.format == Format::nvfp4) d.tensor_scale = r.S;
  r.deq.assign(rows * K * 2, 0);
  dequantize(QuantizedIn{out.codes, out.scales}, Tensor::of(r.deq.data(), DType::bf16, rows, K), d);
  r.qdq.assign(rows * K * 2, 0);
  qdq(xt, Tensor::of(r.qdq.data(), DType::bf16, rows, K), o);
  return r;
}

#if defined(MXQ_TOOL_HAVE_CUDA)
using cuda_util::DeviceBuffer;

// A zeroed device buffer of n bytes.
DeviceBuffer zeroed(std::size_t n) {
  DeviceBuffer b(n);
  b.fill(0);
  return b;
}

Outputs run_cuda(const std::vector<std::uint16_t>& x, std::int64_t rows, std::int64_t K, QuantOptions o) {
  Outputs r;
  const std::int64_t cc = code_cols(o.format, K);
  const Shape2 ss = scale_shape(o, rows, K), ms = clip_mask_shape(rows, K);
  r.codes.assign(rows * cc, 0);
  r.scales.assign(ss.rows * ss.cols, 0);
  r.mask.assign(ms.rows * ms.cols, 0);
  r.deq.assign(rows * K * 2, 0);
  r.qdq.assign(rows * K * 2, 0);
  DeviceBuffer xd = zeroed(x.size() * 2), cd = zeroed(r.codes.size()), sd = zeroed(r.scales.size()),
               md = zeroed(r.mask.size()), Sd = zeroed(4), ws = zeroed(4), dd = zeroed(r.deq.size()),
               qd = zeroed(r.qdq.size());
  xd.upload(x.data(), x.size() * 2);
  const Tensor xt = Tensor::of(xd.get(), DType::bf16, rows, K, 0, Device::cuda);
  QuantizedOut out;
  out.codes = Tensor::of(cd.get(), DType::u8, rows, cc, 0, Device::cuda);
  out.scales = Tensor::of(sd.get(), DType::u8, ss.rows, ss.cols, 0, Device::cuda);
  out.clip_mask = Tensor::of(md.get(), DType::u8, ms.rows, ms.cols, 0, Device::cuda);
  out.tensor_scale = Sd.as<float>();
  o.workspace = ws.get();
  quantize(xt, out, o);
  Sd.download(&r.S, 4);
  QuantOptions d = o;
  if (o.format == Format::nvfp4) d.tensor_scale = r.S;
  dequantize(QuantizedIn{out.codes, out.scales}, Tensor::of(dd.get(), DType::bf16, rows, K, 0, Device::cuda), d);
  qdq(xt, Tensor::of(qd.get(), DType::bf16, rows, K, 0, Device::cuda), o);
  MXQ_CUDA_CHECK(cudaDeviceSynchronize());  // the self-test kernels
  cd.download(r.codes.data(), r.codes.size()), sd.download(r.scales.data(), r.scales.size());
  md.download(r.mask.data(), r.mask.size()), dd.download(r.deq.data(), r.deq.size());
  qd.download(r.qdq.data(), r.qdq.size());
  return r;
}
#endif

// Number of differing bytes; prints the first few.
long compare(const char* what, const std::string& name, const std::vector<std::uint8_t>& want,
             const std::vector<std::uint8_t>& got, bool verbose) {
  long n = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i] && n++ < 3 && verbose)
      fmt::print("    {} {}: byte {} is {:#04x}, reference {:#04x}\n", name, what, i, got[i], want[i]);
  return n;
}

}  // namespace

int run_verify(const VerifyArgs& args) {
  fmt::print("mxq {}\n", MXQ_VERSION_STRING);
  fmt::print("build: CUDA backend {}", cuda_compiled() ? "compiled" : "not compiled");
#if defined(MXQ_TOOL_CUDA_ARCHS)
  if (cuda_compiled()) fmt::print(" (architectures {})", MXQ_TOOL_CUDA_ARCHS);
#endif
  fmt::print("\nmachine: {} hardware threads\n", std::thread::hardware_concurrency());
  std::string why;
  const bool have_cuda = cuda_available(&why);
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (have_cuda) {
    int dev = 0, driver = 0;
    const cudaDeviceProp prop = cuda_util::device_properties(&dev);
    MXQ_CUDA_CHECK(cudaDriverGetVersion(&driver));
    fmt::print("GPU {}: {} (compute capability {}.{}, {} SMs), driver API {}.{}\n", dev, prop.name, prop.major,
               prop.minor, prop.multiProcessorCount, driver / 1000, (driver % 1000) / 10);
  }
#endif
  fmt::print("backends:\n  reference  usable (the definition every backend is checked against)\n");
  fmt::print("  cpu        usable (multi-threaded fast path)\n");
  fmt::print("  cuda       {}\n", have_cuda ? std::string("usable") : "not usable: " + why);

  struct Backend_ {
    const char* name;
    bool cuda;
  };
  std::vector<Backend_> test = {{"cpu", false}};
#if defined(MXQ_TOOL_HAVE_CUDA)
  if (have_cuda) test.push_back({"cuda", true});
#endif
  const std::int64_t rows = 37, K = 320;
  const std::vector<std::uint16_t> x = input(rows, K, 7);
  long total_bad = 0;
  for (const Backend_& b : test) {
    long bad_cases = 0, n = 0;
    for (const Case& c : cases()) {
      QuantOptions o = c.format == Format::nvfp4 ? QuantOptions::nvfp4() : QuantOptions::mx(c.format, c.rule);
      o.rule = c.rule;
      o.rounding = c.rounding;
      o.scale_layout = c.layout;
      o.seed = 1234;
      o.random_bits = c.random_bits;
      QuantOptions oref = o;
      oref.backend = Backend::reference;
      const Outputs want = run_host(x, rows, K, oref);
      Outputs got;
#if defined(MXQ_TOOL_HAVE_CUDA)
      if (b.cuda) got = run_cuda(x, rows, K, o);
      else
#endif
      {
        QuantOptions oc = o;
        oc.backend = Backend::cpu;
        got = run_host(x, rows, K, oc);
      }
      const std::string name = fmt::format("{} {} {} {}", to_string(c.format), to_string(c.rule),
                                           c.rounding == Rounding::stochastic ? fmt::format("stochastic{}", c.random_bits) : std::string("rne"),
                                           c.layout == ScaleLayout::swizzled ? "swizzled" : "linear");
      long bad = compare("codes", name, want.codes, got.codes, args.verbose) +
                 compare("scales", name, want.scales, got.scales, args.verbose) +
                 compare("clip mask", name, want.mask, got.mask, args.verbose) +
                 compare("dequantize", name, want.deq, got.deq, args.verbose) +
                 compare("qdq", name, want.qdq, got.qdq, args.verbose);
      if (want.S != got.S) ++bad;
      if (bad) {
        ++bad_cases;
        fmt::print("  MISMATCH {} on {}: {} bytes differ\n", name, b.name, bad);
      }
      ++n;
    }
    fmt::print("self-test {}: {} of {} cases bit-exact with the reference ([{}, {}] bf16; quantize, dequantize, qdq)\n",
               b.name, n - bad_cases, n, rows, K);
    total_bad += bad_cases;
  }
  fmt::print("{}\n", total_bad ? "FAILED" : "OK");
  return total_bad ? 1 : 0;
}

}  // namespace mxq::cli
