// CPU benchmark: the fast path against the reference and against memcpy on the same machine.
//
// Byte model (bytes moved per element, each input read once and each output written once):
//   qdq        2 * sizeof(dtype)                       (bf16: 4)
//   quantize   sizeof(dtype) + code bytes + 1/g scale   (bf16 -> MXFP4: 2 + 0.5 + 1/32)
//   dequantize code bytes + 1/g scale + sizeof(out)
//   memcpy     read + write
// Timing: median of the runs, each run on the next of several input/output sets whose total is
// larger than 3x the last-level cache (cold cache); the reference is timed on fewer runs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <mxq/mxq.hpp>

#include "stats.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median_seconds(int runs, const std::function<void(int)>& f) {
  std::vector<double> t;
  f(0);  // warm-up
  for (int i = 0; i < runs; ++i) {
    const auto a = Clock::now();
    f(i + 1);
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  return mxq::bench::median(t);
}

struct Buffers {
  std::vector<std::vector<std::uint16_t>> x, y;
  std::vector<std::vector<std::uint8_t>> codes, scales;
};

int threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 15;
  bool ref = true;
  std::string only;
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4096}, {16, 8192}};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      runs = 5;
      shapes = {{1024, 4096}};
    } else if (!std::strcmp(argv[i], "--no-ref")) {
      ref = false;  // skip timing the reference backend (the "x ref" column prints -)
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];  // run the cases whose "op format" contains this string
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::atoi(argv[++i]);
    }
  }
  const std::size_t kSets = 4;  // 4 x (4096 x 4096 bf16 in + out) = 256 MiB, well above any LLC here

  // memcpy baseline: one thread, then every thread.
  const std::size_t mb = 256u << 20;
  std::vector<char> src(mb, 1), dst(mb, 2);
  const double t1 = median_seconds(runs, [&](int) { std::memcpy(dst.data(), src.data(), mb); });
  const double memcpy1 = 2.0 * mb / t1 / 1e9;
  const int nt = threads();
  const double tn = median_seconds(runs, [&](int) {
#if defined(_OPENMP)
#pragma omp parallel for
#endif
    for (int c = 0; c < 64; ++c) std::memcpy(dst.data() + c * (mb / 64), src.data() + c * (mb / 64), mb / 64);
  });
  const double memcpyN = 2.0 * mb / tn / 1e9;
  std::printf("# mxq CPU benchmark: %d threads (%u hardware); memcpy 1 thread %.2f GB/s, %d threads %.2f GB/s\n", nt,
              std::thread::hardware_concurrency(), memcpy1, nt, memcpyN);
  std::printf("# target: MXFP4/MXFP8 QDQ bf16 per-core GB/s >= 25%% of the 1-thread memcpy (%.2f GB/s)\n", 0.25 * memcpy1);
  std::printf("%-11s %-11s %-11s %-11s %10s %8s %9s %12s %8s\n", "op", "format", "rule", "shape", "us", "GB/s",
              "%memcpyN", "%memcpy1/core", "x ref");

  struct Case {
    const char* op;
    mxq::QuantOptions opt;
    const char* mode = "";  // printed after the rule: "S" for a given NVFP4 tensor scale, "sr8"...
  };
  std::vector<Case> cases;
  for (auto [f, r] : {std::pair{mxq::Format::mxfp4, mxq::ScaleRule::even}, {mxq::Format::mxfp8_e4m3, mxq::ScaleRule::floor},
                      {mxq::Format::mxfp6_e2m3, mxq::ScaleRule::rceil}, {mxq::Format::mxint8, mxq::ScaleRule::floor},
                      {mxq::Format::mxfp4, mxq::ScaleRule::quest}, {mxq::Format::mxfp4, mxq::ScaleRule::qutlass_absmax}})
    cases.push_back({"qdq", mxq::QuantOptions::mx(f, r)});
  cases.push_back({"qdq", mxq::QuantOptions::nvfp4(1.0f), "S"});
  cases.push_back({"qdq", mxq::QuantOptions::nvfp4()});
  for (int bits : {32, 8}) {
    mxq::QuantOptions sr = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
    sr.rounding = mxq::Rounding::stochastic;
    sr.random_bits = bits;
    cases.push_back({"qdq-sr", sr, bits == 8 ? "r8" : ""});
  }
  {
    mxq::QuantOptions sr = mxq::QuantOptions::nvfp4(1.0f);
    sr.rounding = mxq::Rounding::stochastic;
    cases.push_back({"qdq-sr", sr, "S"});
  }
  for (auto f : {mxq::Format::mxfp4, mxq::Format::mxfp8_e4m3}) {
    mxq::QuantOptions q = mxq::QuantOptions::mx(f, mxq::ScaleRule::rceil);
    q.scale_layout = mxq::ScaleLayout::swizzled;
    cases.push_back({"quantize", q, "swz"});
    cases.push_back({"dequantize", q, "swz"});
  }
  // every other MX format (linear scales), NVFP4 (given and computed tensor scale), stochastic rounding
  for (auto [f, r] : {std::pair{mxq::Format::mxfp4, mxq::ScaleRule::even}, {mxq::Format::mxfp6_e2m3, mxq::ScaleRule::rceil},
                      {mxq::Format::mxfp6_e3m2, mxq::ScaleRule::floor}, {mxq::Format::mxfp8_e5m2, mxq::ScaleRule::even},
                      {mxq::Format::mxint8, mxq::ScaleRule::floor}, {mxq::Format::mxfp4, mxq::ScaleRule::quest}})
    cases.push_back({"quantize", mxq::QuantOptions::mx(f, r)});
  cases.push_back({"quantize", mxq::QuantOptions::nvfp4(1.0f), "S"});
  cases.push_back({"quantize", mxq::QuantOptions::nvfp4()});
  {
    mxq::QuantOptions q = mxq::QuantOptions::nvfp4();  // QuTLASS's NVFP4 quest (the staged path)
    q.rule = mxq::ScaleRule::quest;
    cases.push_back({"quantize", q});
  }
  {
    mxq::QuantOptions q = mxq::QuantOptions::nvfp4(1.0f);
    q.scale_layout = mxq::ScaleLayout::swizzled;
    cases.push_back({"quantize", q, "S,swz"});
    cases.push_back({"dequantize", q, "S,swz"});
  }
  {
    mxq::QuantOptions sr = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::even);
    sr.rounding = mxq::Rounding::stochastic;
    cases.push_back({"quantize-sr", sr});
    sr.random_bits = 8;
    cases.push_back({"quantize-sr", sr, "r8"});
    sr = mxq::QuantOptions::nvfp4(1.0f);
    sr.rounding = mxq::Rounding::stochastic;
    cases.push_back({"quantize-sr", sr, "S"});
  }
  cases.push_back({"dequantize", mxq::QuantOptions::mx(mxq::Format::mxint8, mxq::ScaleRule::floor)});

  for (auto [rows, K] : shapes) {
    Buffers b;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t s = 0; s < kSets; ++s) {
      b.x.emplace_back(rows * K);
      b.y.emplace_back(rows * K);
      for (auto& v : b.x.back()) {
        v = mxq::f32_to_bf16(nd(rng));
      }
    }
    for (const Case& c : cases) {
      if (!only.empty() && (std::string(c.op) + " " + std::string(mxq::to_string(c.opt.format))).find(only) == std::string::npos)
        continue;
      mxq::QuantOptions o = c.opt;
      const std::string op = std::string(c.op).substr(0, std::string(c.op).find('-'));
      const std::int64_t cc = mxq::code_cols(o.format, K);
      const mxq::Shape2 ss = mxq::scale_shape(o, rows, K);
      b.codes.assign(kSets, std::vector<std::uint8_t>(rows * cc));
      b.scales.assign(kSets, std::vector<std::uint8_t>(ss.rows * ss.cols));
      auto run = [&](int i, mxq::Backend be) {
        o.backend = be;
        const std::size_t s = std::size_t(i) % kSets;
        const mxq::Tensor x = mxq::Tensor::of(b.x[s].data(), mxq::DType::bf16, rows, K);
        const mxq::Tensor y = mxq::Tensor::of(b.y[s].data(), mxq::DType::bf16, rows, K);
        mxq::QuantizedOut out;
        out.codes = mxq::Tensor::of(b.codes[s].data(), mxq::DType::u8, rows, cc);
        out.scales = mxq::Tensor::of(b.scales[s].data(), mxq::DType::u8, ss.rows, ss.cols);
        if (op == "quantize") mxq::quantize(x, out, o);
        else if (op == "dequantize") mxq::dequantize({out.codes, out.scales}, y, o);
        else mxq::qdq(x, y, o);
      };
      // dequantize decodes real codes and scales (all-zero bytes would be scale 2^-127, a subnormal
      // factor that costs microcode assists and that no quantized tensor has)
      if (op == "dequantize") {
        for (std::size_t s = 0; s < kSets; ++s) {
          mxq::QuantOptions qo = o;
          qo.backend = mxq::Backend::cpu;
          mxq::QuantizedOut out;
          out.codes = mxq::Tensor::of(b.codes[s].data(), mxq::DType::u8, rows, cc);
          out.scales = mxq::Tensor::of(b.scales[s].data(), mxq::DType::u8, ss.rows, ss.cols);
          mxq::quantize(mxq::Tensor::of(b.x[s].data(), mxq::DType::bf16, rows, K), out, qo);
        }
      }
      const double g = mxq::group_size(o);
      const double code_b = mxq::format_info(o.format).elem_bits == 4 ? 0.5 : 1.0;
      const double bytes_per_el = op == "quantize" ? 2 + code_b + 1 / g : (op == "dequantize" ? code_b + 1 / g + 2 : 4.0);
      const double bytes = bytes_per_el * double(rows * K);
      const double tf = median_seconds(runs, [&](int i) { run(i, mxq::Backend::cpu); });
      const double tr = ref ? median_seconds(std::max(1, runs / 5), [&](int i) { run(i, mxq::Backend::reference); }) : 0.0;
      const double gbs = bytes / tf / 1e9;
      char shape[32];
      std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)rows, (long long)K);
      std::string rule(mxq::to_string(o.rule));
      if (*c.mode) rule += std::string(",") + c.mode;
      char xref[16] = "-";
      if (ref) std::snprintf(xref, sizeof xref, "%.1f", tr / tf);
      std::printf("%-11s %-11s %-11s %-11s %10.1f %8.2f %8.1f%% %12.1f%% %8s\n", c.op,
                  std::string(mxq::to_string(o.format)).c_str(), rule.c_str(), shape, tf * 1e6, gbs,
                  100 * gbs / memcpyN, 100 * gbs / nt / memcpy1, xref);
    }
  }
  return 0;
}
