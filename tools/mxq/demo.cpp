// `mxq demo`: a deterministic LLM-like workload through every format x scale rule on the fastest
// backend present, with the error each one introduces. Run by scripts/demo.
//
// Workload: a weight matrix (Gaussian bulk, sigma 0.02, plus heavy-tailed outlier input channels)
// and an activation matrix (Student-t bulk plus a few massive outlier channels), at a real layer
// width (K = 4096), fewer rows on a CPU.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <mxq/mxq.hpp>

#include "commands.hpp"
#include "engine.hpp"
#include "stats.hpp"  // support/ (mxq_support): the median

namespace {

using mxq::bf16_to_f32;
using mxq::f32_to_bf16;

struct Workload {
  const char* name;
  std::int64_t rows, K;
  std::vector<std::uint16_t> x;
};

Workload weights(std::int64_t rows, std::int64_t K) {
  Workload w{"weights", rows, K, std::vector<std::uint16_t>(rows * K)};
  std::mt19937 rng(2024);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::student_t_distribution<float> t3(3.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < K; ++k) w.x[r * K + k] = f32_to_bf16(k % 257 == 7 ? 0.08f * t3(rng) : nd(rng));
  return w;
}

Workload activations(std::int64_t rows, std::int64_t K) {
  Workload a{"activations", rows, K, std::vector<std::uint16_t>(rows * K)};
  std::mt19937 rng(7);
  std::student_t_distribution<float> t4(4.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < K; ++k) {
      float v = 0.5f * t4(rng);
      if (k == 1021 || k == 2900 || k == 3333) v *= 60.0f;  // massive-activation channels
      a.x[r * K + k] = f32_to_bf16(v);
    }
  return a;
}

}  // namespace

namespace mxq::cli {

int run_demo(const DemoArgs& args) {
  Engine eng(args.device);
  const std::int64_t K = args.K;
  const std::int64_t wr = args.weight_rows ? args.weight_rows : eng.gpu() ? 4096 : 1024;
  const std::int64_t ar = args.activation_rows ? args.activation_rows : eng.gpu() ? 2048 : 256;
  std::vector<Workload> loads = {weights(wr, K), activations(ar, K)};
  std::printf("mxq %s demo: backend %s (%s)\n", MXQ_VERSION_STRING, eng.name().c_str(), eng.why().c_str());
  std::printf("workloads: weights [%lld, %lld] bf16 (Gaussian + outlier channels), activations [%lld, %lld] bf16 "
              "(Student-t + massive channels)\n\n",
              (long long)wr, (long long)K, (long long)ar, (long long)K);
  std::printf("%-11s %-11s %-6s %-8s %9s %10s %9s %9s %9s  %s\n", "tensor", "format", "rule", "rotation", "SQNR dB",
              "rel RMS", "% clip", "nonfinite", "GB/s", "backend");

  struct Config {
    mxq::Format f;
    mxq::ScaleRule r;
    const char* rotation = "none";  // parse_rotation's names
  };
  std::vector<Config> configs;
  for (mxq::Format f : {mxq::Format::mxfp4, mxq::Format::mxfp6_e2m3, mxq::Format::mxfp6_e3m2, mxq::Format::mxfp8_e4m3,
                        mxq::Format::mxfp8_e5m2, mxq::Format::mxint8})
    for (mxq::ScaleRule r : {mxq::ScaleRule::floor, mxq::ScaleRule::ceil, mxq::ScaleRule::even, mxq::ScaleRule::rceil,
                             mxq::ScaleRule::quest})
      if (mxq::rule_refusal(f, r).empty()) configs.push_back({f, r});  // quest: mxfp4 only (an E2M1 constant)
  configs.push_back({mxq::Format::nvfp4, mxq::ScaleRule::nvfp4});
  // The 4-bit formats again behind a rotation (QuTLASS's use): the error is measured in the input's own
  // domain (quantize with the rotation, dequantize with its inverse); GB/s is the rotated QDQ's.
  for (const char* rot : {"had16", "had32", "had128", "rhad128"}) {
    configs.push_back({mxq::Format::mxfp4, mxq::ScaleRule::even, rot});
    configs.push_back({mxq::Format::mxfp4, mxq::ScaleRule::quest, rot});
    configs.push_back({mxq::Format::nvfp4, mxq::ScaleRule::nvfp4, rot});
  }

  for (const Workload& w : loads) {
    std::vector<std::uint16_t> y(w.x.size());
    const mxq::Tensor xt = mxq::Tensor::of(w.x.data(), mxq::DType::bf16, w.rows, w.K);
    const mxq::Tensor yt = mxq::Tensor::of(y.data(), mxq::DType::bf16, w.rows, w.K);
    for (const Config& c : configs) {
      mxq::QuantOptions o = c.f == mxq::Format::nvfp4 ? mxq::QuantOptions::nvfp4() : mxq::QuantOptions::mx(c.f, c.r);
      std::tie(o.rotation, o.rotation_size) = mxq::parse_rotation(c.rotation);
      o.rotation_seed = 1;
      if (o.rotation != mxq::Rotation::none && w.K % o.rotation_size != 0) continue;  // --K not a multiple of RS
      eng.qdq(xt, yt, o);  // warm-up
      // NOTE: the median of 5 timings (a GPU op is short: each the mean of 20): one timing swung by
      // 2-3x on a loaded 2-core machine.
      std::vector<double> secs;
      for (int t = 0; t < 5; ++t) secs.push_back(eng.qdq(xt, yt, o, eng.gpu() ? 20 : 1));
      const double sec = mxq::bench::median(secs);
      // Clipping and non-finite blocks from the quantized form.
      const std::int64_t cc = mxq::code_cols(o.format, w.K);
      const mxq::Shape2 ss = mxq::scale_shape(o, w.rows, w.K), ms = mxq::clip_mask_shape(w.rows, w.K);
      std::vector<std::uint8_t> codes(w.rows * cc), scales(ss.rows * ss.cols), mask(ms.rows * ms.cols);
      mxq::QuantizedOut out;
      out.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, w.rows, cc);
      out.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, ss.rows, ss.cols);
      out.clip_mask = mxq::Tensor::of(mask.data(), mxq::DType::u8, ms.rows, ms.cols);
      float S = 1.0f;
      if (o.format == mxq::Format::nvfp4) out.tensor_scale = &S;
      eng.quantize(xt, out, o);
      if (o.rotation != mxq::Rotation::none) {  // back to the input's domain: y = dequantize + un-rotate
        mxq::QuantOptions od = o;
        if (o.format == mxq::Format::nvfp4) od.tensor_scale = S;
        eng.dequantize(mxq::QuantizedIn{out.codes, out.scales}, yt, od);
      }
      double err = 0, ref = 0;
      for (std::size_t i = 0; i < w.x.size(); ++i) {
        const double a = bf16_to_f32(w.x[i]), d = bf16_to_f32(y[i]) - a;
        err += d * d;
        ref += a * a;
      }
      std::int64_t kept = 0, nonfinite = 0;
      for (std::uint8_t m : mask) kept += __builtin_popcount(m);
      const std::uint8_t nan_byte = c.f == mxq::Format::nvfp4 ? 0x7F : 0xFF;
      for (std::uint8_t s : scales) nonfinite += (s & nan_byte) == nan_byte;  // NVFP4: either sign
      const double n = double(w.rows * w.K);
      std::printf("%-11s %-11s %-6s %-8s %9.2f %10.4f %9.3f %9lld %9.2f  %s\n", w.name,
                  std::string(mxq::to_string(c.f)).c_str(), std::string(mxq::to_string(c.r)).c_str(), c.rotation,
                  10 * std::log10(ref / err), std::sqrt(err / ref), 100.0 * (n - double(kept)) / n, (long long)nonfinite,
                  4.0 * n / sec / 1e9, eng.name().c_str());
    }
  }
  std::printf("\nSQNR = 10 log10(sum x^2 / sum (qdq(x) - x)^2); %% clip = elements at or beyond the element maximum "
              "after scaling;\nGB/s = QDQ bytes moved (bf16 in + out, 4 B/element) per second by the operation itself, "
              "%s\n",
              eng.gpu() ? "on the GPU (the median of 5 means of 20 back-to-back runs, host transfers excluded, L2 warm; "
                          "`mxq bench` measures cold)"
                        : "on the CPU (the median of 5 runs)");
  std::printf("GB/s is indicative: on a machine busy with other work it varies from run to run (`mxq bench` "
              "reports medians against the measured memcpy bandwidth).\n");
  std::printf("rotation: had<RS> / rhad<RS> = the (randomised) Hadamard transform of each group of RS before "
              "quantizing; its SQNR is of dequantize + the inverse rotation against x (docs/numerics.md, \"Rotation\").\n");
  return 0;
}

}  // namespace mxq::cli
