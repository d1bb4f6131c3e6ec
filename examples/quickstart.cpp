// The README's quick start: QDQ a bf16 tensor to MXFP4, then produce packed codes and swizzled
// scales for a Blackwell GEMM and dequantize them back. Built and run by ctest (example_quickstart).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <mxq/mxq.hpp>

using mxq::bf16_to_f32;  // mxq/convert.hpp: bits <-> fp32, exact / round to nearest even
using mxq::f32_to_bf16;

int main() {
  const std::int64_t rows = 256, K = 1024;
  std::vector<std::uint16_t> x(rows * K), y(rows * K);
  for (std::int64_t i = 0; i < rows * K; ++i) x[i] = f32_to_bf16(std::sin(0.001f * float(i)) * (i % 61 == 0 ? 8.0f : 1.0f));

  // 1. Fake-quantize (quantize + dequantize in one pass), output in the input dtype.
  const mxq::Tensor xt = mxq::Tensor::of(x.data(), mxq::DType::bf16, rows, K);
  const mxq::Tensor yt = mxq::Tensor::of(y.data(), mxq::DType::bf16, rows, K);
  mxq::qdq(xt, yt, mxq::presets::vllm_mxfp4_qdq());  // MXFP4, "even" scale rule, RNE

  double err = 0, ref = 0;
  for (std::int64_t i = 0; i < rows * K; ++i) {
    const double d = bf16_to_f32(y[i]) - bf16_to_f32(x[i]);
    err += d * d;
    ref += double(bf16_to_f32(x[i])) * bf16_to_f32(x[i]);
  }
  std::printf("MXFP4 QDQ: SQNR %.2f dB\n", 10 * std::log10(ref / err));

  // 2. Real packed weights: E2M1 codes (two per byte) + E8M0 scales in the 128x4 swizzled layout.
  mxq::QuantOptions opt = mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::rceil);
  opt.scale_layout = mxq::ScaleLayout::swizzled;
  const mxq::Shape2 ss = mxq::scale_shape(opt, rows, K);  // [256, 32]: padded to 128 rows x 4 columns
  std::vector<std::uint8_t> codes(rows * mxq::code_cols(opt.format, K)), scales(ss.rows * ss.cols);
  mxq::QuantizedOut out;
  out.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, rows, mxq::code_cols(opt.format, K));
  out.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, ss.rows, ss.cols);
  mxq::quantize(xt, out, opt);

  // 3. Back to fp32.
  std::vector<float> z(rows * K);
  mxq::dequantize({out.codes, out.scales}, mxq::Tensor::of(z.data(), mxq::DType::f32, rows, K), opt);
  std::printf("packed %zu code bytes + %zu scale bytes; x[700] = %g -> %g\n", codes.size(), scales.size(),
              bf16_to_f32(x[700]), z[700]);

  // Errors name the argument and the expected shape.
  try {
    mxq::qdq(xt, mxq::Tensor::of(y.data(), mxq::DType::bf16, rows, K - 1), opt);
  } catch (const mxq::Error& e) {
    std::printf("error, as expected: %s\n", e.what());
    return 0;
  }
  return 1;
}
